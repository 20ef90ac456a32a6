"""The routes of the translated APIs: ``POST/GET/DELETE /v1/responses`` and ``POST
/v1/messages``, ``POST /v1/messages/count_tokens``.

Each route authenticates as chat completions do (``/v1/messages`` also takes Anthropic's
``x-api-key``; ``anthropic-version`` and ``anthropic-beta`` are accepted and not needed),
translates the body, runs it through :func:`gateway.apis.bridge.run_chat`, and writes the
reply in its API's shape, keeping the chat path's headers (the decision's ``x-edgecloud-*``).

Invariants:
- Errors: ``/v1/responses`` answers OpenAI's error shape (the Responses API's own), with the
  chat field a translated body failed on renamed to the field the client sent
  (``max_tokens`` -> ``max_output_tokens``, ...); ``/v1/messages`` answers Anthropic's shape
  for every error it can meet, auth and limits included. 5xx bodies never name nodes.
- A stored response is read, chained or deleted only by the key that created it; anyone else
  gets the same 404 as for an id never stored.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from gateway.apis import messages_request, responses_request
from gateway.apis.bridge import ChatStream, ChatWhole, profile_only, run_chat, wrap_stream
from gateway.apis.chat_events import ChatStreamReader, whole_events
from gateway.apis.messages_reply import MessageWriter, error_response
from gateway.apis.messages_request import CountTokensRequest, MessagesRequest
from gateway.apis.response_store import ResponseStore, StoredResponse, make_response_store
from gateway.apis.responses_reply import ResponseWriter, sse
from gateway.apis.responses_request import ResponsesRequest, assistant_message, input_messages
from gateway.auth import KeyIdentity, bearer_token, enforce_rate_limit
from gateway.errors import APIError, public_error, validation_error
from gateway.front.gateway import Gateway
from gateway.front.request_path import parse_json

log = logging.getLogger(__name__)

# a chat field a translated body failed on -> the field the client sent
RESPONSES_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
MESSAGES_PARAMS = {"stop": "stop_sequences"}


def renamed(exc: APIError, names: dict[str, str]) -> APIError:
    """``exc`` with its ``param`` named as the client's API names it."""
    p = exc.param
    if p is None:
        return exc
    for chat, theirs in names.items():
        if p == chat or p.startswith(chat + ".") or p.startswith(chat + "["):
            new = theirs + p[len(chat) :]
            exc.message = exc.message.replace(f"'{p}'", f"'{new}'")
            exc.param = new
            return exc
    return exc


def _body_schema(model: Any) -> dict[str, Any]:
    return {
        "requestBody": {
            "content": {"application/json": {"schema": model.model_json_schema()}},
            "required": True,
        }
    }


def _not_found(what: str, rid: str) -> APIError:
    return APIError(404, f"{what} with id '{rid}' not found.", code="not_found")


def install_api_routes(app: FastAPI, gw: Gateway) -> ResponseStore:
    """Add the Responses and Messages routes to ``app``; returns the response store."""
    store = make_response_store(gw.redis, gw.config.responses_ttl_s)

    # ---- the Responses API ----------------------------------------------------------------
    @app.post(
        "/v1/responses",
        tags=["Responses"],
        openapi_extra=_body_schema(ResponsesRequest),
        summary="Create a model response (OpenAI's Responses API)",
    )
    async def create_response(request: Request) -> Response:
        who = await gw.auth(request)
        rate = await gw.charges.admit(request, who)  # limits before the body is read
        try:
            raw = await request.body()
            _, req, _ = parse_json(raw, ResponsesRequest, request.headers.get("content-type"))  # type: ignore[arg-type]
            assert isinstance(req, ResponsesRequest)
            history: list[dict[str, Any]] = []
            if req.previous_response_id is not None:
                prev = await store.get(req.previous_response_id, who.key_id)
                if prev is None:
                    raise APIError(
                        404,
                        f"Previous response with id '{req.previous_response_id}' not found.",
                        param="previous_response_id",
                        code="previous_response_not_found",
                    )
                history = prev.messages
            new = input_messages(req.input)
            body = responses_request.chat_body(req, history, new)
        except BaseException:
            await gw.limiter.settle(rate, 0)  # the request counts, its tokens do not
            raise
        try:
            result = await run_chat(gw, request, body, who, rate)
        except APIError as exc:
            raise renamed(exc, RESPONSES_PARAMS) from None
        if not isinstance(result, (ChatWhole, ChatStream)):
            return result.response
        writer = ResponseWriter(req, gw.path.concrete_model(req.model))

        async def save() -> None:
            if req.store and writer.status != "failed":
                done = [*history, *new, assistant_message(writer.output)]
                await store.put(StoredResponse(owner=who.key_id, response=writer.response(),
                                               messages=done))  # fmt: skip

        if isinstance(result, ChatWhole):
            for ev in whole_events(result.reply):
                writer.take(ev)
            writer.end()
            await save()
            return JSONResponse(writer.response(), headers=result.headers)

        async def translate(chat: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
            reader = ChatStreamReader()
            for e in writer.start():
                yield sse(e)
            async for data in chat:
                for ev in reader.feed(data):
                    for e in writer.take(ev):
                        yield sse(e)
            for ev in reader.close():
                for e in writer.take(ev):
                    yield sse(e)
            final = writer.end()
            try:
                await save()
            except APIError as exc:  # the reply stands; only its chaining is lost
                log.warning("a streamed response was not stored: %s", exc.message)
            for e in final:
                yield sse(e)

        return wrap_stream(result, translate)

    @app.get("/v1/responses/{response_id}", tags=["Responses"], summary="A stored response")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        who = await _charged(request)
        found = await store.get(response_id, who.key_id)
        if found is None:
            raise _not_found("Response", response_id)
        return found.response

    @app.delete("/v1/responses/{response_id}", tags=["Responses"], summary="Delete a response")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        who = await _charged(request)
        if not await store.delete(response_id, who.key_id):
            raise _not_found("Response", response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def _charged(request: Request) -> KeyIdentity:
        """The caller, charged one request (no tokens) against its rate limit."""
        who = await gw.auth(request)
        await enforce_rate_limit(gw.limiter, who, 0, gw.metrics.observe_rate_limited)
        return who

    # ---- Anthropic's Messages API ---------------------------------------------------------
    async def anthropic_caller(request: Request) -> KeyIdentity:
        return await gw.auth.identify(bearer_token(request) or request.headers.get("x-api-key"))

    async def messages_body(request: Request, model: type[MessagesRequest]) -> MessagesRequest:
        raw = await request.body()
        try:
            _, req, _ = parse_json(raw, model, request.headers.get("content-type"))  # type: ignore[arg-type]
        except RequestValidationError as exc:
            raise validation_error(list(exc.errors())) from None
        assert isinstance(req, MessagesRequest)
        return req

    @app.post(
        "/v1/messages",
        tags=["Anthropic"],
        openapi_extra=_body_schema(MessagesRequest),
        summary="Create a message (Anthropic's Messages API)",
    )
    async def create_message(request: Request) -> Response:
        try:
            who = await anthropic_caller(request)
            rate = await gw.charges.admit(request, who)  # limits before the body is read
            try:
                req = await messages_body(request, MessagesRequest)
                body = messages_request.chat_body(req)
            except BaseException:
                await gw.limiter.settle(rate, 0)  # the request counts, its tokens do not
                raise
            result = await run_chat(gw, request, body, who, rate)
        except APIError as exc:
            return error_response(public_error(request, renamed(exc, MESSAGES_PARAMS)))
        if not isinstance(result, (ChatWhole, ChatStream)):
            return result.response
        writer = MessageWriter(gw.path.concrete_model(req.model))
        if isinstance(result, ChatWhole):
            for ev in whole_events(result.reply):
                writer.take(ev)
            return JSONResponse(writer.message(), headers=result.headers)
        stream = result

        async def translate(chat: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
            reader = ChatStreamReader()
            for b in writer.start(stream.prompt_tokens, stream.cached_tokens):
                yield b
            async for data in chat:
                for ev in reader.feed(data):
                    for b in writer.take(ev):
                        yield b
            for ev in reader.close():
                writer.take(ev)
            for b in writer.end():
                yield b

        return wrap_stream(stream, translate)

    @app.post(
        "/v1/messages/count_tokens",
        tags=["Anthropic"],
        openapi_extra=_body_schema(CountTokensRequest),
        summary="Count a message's input tokens, as the node will",
    )
    async def count_tokens(request: Request) -> Response:
        try:
            who = await anthropic_caller(request)
            await enforce_rate_limit(gw.limiter, who, 0, gw.metrics.observe_rate_limited)
            req = await messages_body(request, CountTokensRequest)
            body = messages_request.chat_body(req)
            prof = await profile_only(gw, request, body, who)
        except APIError as exc:
            return error_response(public_error(request, renamed(exc, MESSAGES_PARAMS)))
        return JSONResponse({"input_tokens": prof.prompt_tokens})

    app.state.responses = store
    return store
