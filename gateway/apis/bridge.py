"""Running a translated chat-completions body through the gateway's own request path, in process.

:func:`run_chat` validates the body with the chat schema and hands it to
:meth:`gateway.front.gateway.Gateway.forward`, exactly as ``POST /v1/chat/completions`` does
(same auth identity, rate limits, routing, failover, mid-stream resume, decision headers), and
sorts what comes back into a whole reply, a stream, or an :class:`APIError`.

Invariants:
- The body's errors, the path's errors and a node's 4xx all come out as :class:`APIError`
  (the chat API's status, type, param and code), for the caller to write in its own shape.
- A :class:`ChatStream`'s response still owns its dispatch: the caller wraps its body
  (:func:`wrap_stream`) and returns the same response object, which ends the dispatch once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from gateway.auth import KeyIdentity
from gateway.errors import APIError, validation_error
from gateway.front.gateway import Gateway
from gateway.front.relay import RelayResponse
from gateway.openai_schema import ChatCompletionRequest
from gateway.ratelimit import RateDecision
from routing.profile import RequestProfile

_DROPPED = {"content-length", "content-type"}


@dataclass
class ChatWhole:
    reply: dict[str, Any]  # the chat.completion body
    headers: dict[str, str]  # the decision headers and the like


@dataclass
class ChatStream:
    response: RelayResponse  # owns the dispatch; its body is the chat SSE stream
    prompt_tokens: int  # the prompt as the gateway counted it (the node's count)
    cached_tokens: int  # the prefix the chosen node was credited with


@dataclass
class ClientLeft:
    response: Response  # the 499 the chat path answers a client gone before the reply


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """``body`` validated as a chat request; an :class:`APIError` (400) naming the field."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def _kept(resp: Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _DROPPED}


def _upstream_error(resp: Response) -> APIError:
    try:
        err = json.loads(bytes(resp.body)).get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    return APIError(
        resp.status_code,
        str(err.get("message") or "the request failed"),
        type_=str(err.get("type") or "invalid_request_error"),
        param=err.get("param"),
        code=err.get("code"),
        headers=_kept(resp),
    )


async def run_chat(
    gw: Gateway,
    request: Request,
    body: dict[str, Any],
    who: KeyIdentity,
    rate: RateDecision | None = None,
) -> ChatWhole | ChatStream | ClientLeft:
    """Run ``body`` (a chat-completions request) as ``who`` through the gateway's request path;
    ``rate``: the early charge made before the body was read (``Charges.admit``), which the
    request path brings up to the real bound."""
    req = chat_request(body)
    resp = await gw.forward(request, body, "chat", req, who, rate=rate)
    if isinstance(resp, RelayResponse):
        plan = resp.relay.plan
        return ChatStream(resp, plan.profile.prompt_tokens, plan.decision.cached_tokens)
    if resp.status_code == 499:
        return ClientLeft(resp)
    if resp.status_code != 200:
        raise _upstream_error(resp)
    return ChatWhole(json.loads(bytes(resp.body)), _kept(resp))


async def profile_only(
    gw: Gateway, request: Request, body: dict[str, Any], who: KeyIdentity
) -> RequestProfile:
    """The profile the request path builds for ``body`` (its prompt tokens), without running it."""
    req = chat_request(body)
    model = gw.path.concrete_model(req.model)
    prof, _ = await gw.path.profile(body, "chat", model, gw.path.client_region(request), who.key_id)
    return prof


def wrap_stream(
    stream: ChatStream, translate: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]
) -> RelayResponse:
    """``stream``'s response with its body passed through ``translate`` (chat SSE in, the
    API's SSE out); closing the translated body closes the chat one."""
    resp = stream.response
    inner: AsyncIterator[bytes] = resp.body_iterator  # type: ignore[assignment]

    async def body() -> AsyncIterator[bytes]:
        try:
            async for data in translate(inner):
                yield data
        finally:
            await inner.aclose()  # type: ignore[attr-defined]

    resp.body_iterator = body()
    return resp
