"""The Node API (DESIGN.md): one FastAPI app that serves any engine.

Routes: POST /v1/chat/completions, POST /v1/completions (SSE streaming, usage, stop, ...),
GET /v1/models, GET /health, GET /load (NodeState), GET /tokenizer/{model}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from gateway import gc_tuning
from gateway.body_limit import BodyLimitMiddleware
from gateway.errors import APIError, install_error_handlers
from gateway.json_limits import validated_body
from gateway.node.logprob_format import TokenTexts
from gateway.node.publisher import StatePublisher
from gateway.node.replies import Reply
from gateway.node.service import Delta, NodeService, Prepared
from gateway.node_headers import (
    CACHE_SALT_HEADER,
    HEADERS_AT_FIRST_TOKEN,
    MAX_CACHE_SALT_CHARS,
    NODE_TTFT_HEADER,
    PREFILL_MS_HEADER,
)
from gateway.node_token import NodeTokenMiddleware
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, model_card
from gateway.sse import sse_event
from gateway.token_ids import TOKEN_IDS_HEADER, ids_line
from routing.engine import PrefixCacheEngine
from routing.fleet.block_feed import BlockFeed
from routing.fleet.store import FleetStore
from routing.prompt import TOKENIZER_FILES

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_node_app(
    service: NodeService,
    store: FleetStore | None = None,
    node_token: str | None = None,
    tune_gc: bool = False,
) -> FastAPI:
    """The Node API over ``service``; with ``node_token``, every route but ``GET /health``
    answers 401 without it (:class:`gateway.node_token.NodeTokenMiddleware`); with ``tune_gc``
    (a node process of its own), what exists once the engine has started is frozen
    (:mod:`gateway.gc_tuning`)."""
    publisher: StatePublisher | None = None
    feed: BlockFeed | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal publisher, feed
        await service.engine.start()
        engine = service.engine
        if isinstance(engine, PrefixCacheEngine) and engine.stats().traits.prefix_cache:
            feed = BlockFeed(engine)
        if store is not None:
            publisher = StatePublisher(service, store, feed)
            await publisher.start()
        if tune_gc:
            gc_tuning.tune_gc()
        try:
            yield
        finally:
            if publisher is not None:
                await publisher.stop()
            await service.engine.shutdown()

    app = FastAPI(title="edgecloud node", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=service.config.max_body_bytes)
    if node_token:  # added last: the outermost layer, before any body is read
        app.add_middleware(NodeTokenMiddleware, token=node_token)
    app.state.service = service

    def headers(prep: Prepared, first: Delta | None, t0: float, t_first: float) -> dict[str, str]:
        """The node's figures for the gateway (:mod:`gateway.node_headers`): the prefix it
        reused, its time from the request's arrival to the first token and, from an engine
        that measures it, the part of that its own prompt's compute took."""
        h = {
            "x-edgecloud-node": service.config.node_id,
            "x-edgecloud-tier": service.engine.kind,
            "x-request-id": prep.gen.request_id,
        }
        if first is not None:
            h["x-edgecloud-cached-tokens"] = str(first.event.cached_tokens)
            h[NODE_TTFT_HEADER] = f"{(t_first - t0) * 1000:.1f}"
            if first.event.prefill_ms is not None:
                h[PREFILL_MS_HEADER] = f"{first.event.prefill_ms:.1f}"
        return h

    texts = TokenTexts(service.formatter.tokenizer)

    async def respond(prep: Prepared, stream: bool, request: Request) -> Response:
        t0 = time.perf_counter()
        plain = len(prep.choices) == 1 and prep.logprobs is None and prep.echo is None
        with_ids = stream and plain and request.headers.get(TOKEN_IDS_HEADER) == "1"
        salt = request.headers.get(CACHE_SALT_HEADER)
        if salt:  # the gateway's cache scope for this request's prefix blocks
            for gen in prep.choices:
                gen.cache_salt = salt[:MAX_CACHE_SALT_CHARS]
        deltas = service.run_choices(prep, with_ids=with_ids)
        if stream:
            return await stream_response(prep, deltas, request, t0, with_ids)
        return await full_response(prep, deltas, request, t0)

    async def until_first(deltas: AsyncIterator[Delta], request: Request) -> Delta | None:
        """The first delta, or None when the client left first (a request still queued is
        then given up at once: the engine frees it when ``deltas`` is closed)."""
        task = asyncio.ensure_future(anext(deltas))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return None
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await task

    async def stream_response(
        prep: Prepared,
        deltas: AsyncIterator[Delta],
        request: Request,
        t0: float,
        with_ids: bool = False,
    ) -> Response:
        # Wait for the first delta so that queue and engine errors still get a 4xx status.
        try:
            first = await until_first(deltas, request)
        except StopAsyncIteration:
            raise APIError(500, "engine produced no output", type_="server_error") from None
        if first is None:
            await deltas.aclose()  # type: ignore[attr-defined]
            return Response(status_code=499)
        reply = Reply(prep, texts)
        pending: list[int] = []  # ids of deltas whose text a tool-call parser held back

        def events(d: Delta) -> list[bytes]:
            out = [sse_event(obj) for obj in reply.chunks(d)]
            if with_ids and d.text:
                pending.extend(d.token_ids)
                if out:  # the ids of every delta up to here go with the first chunk after it
                    out[0] = ids_line(pending, d.clean) + out[0]
                    pending.clear()
            return out

        async def body() -> AsyncIterator[bytes]:
            try:
                for obj in reply.opening():
                    yield sse_event(obj)
                for ev in events(first):
                    yield ev
                if not reply.done:
                    async for d in deltas:
                        for ev in events(d):
                            yield ev
                        if reply.done:
                            break
                for i, c in enumerate(reply.choices):
                    if c.finish is None:  # its stream ended without a finish: say so
                        yield sse_event(reply.envelope([reply.choice_chunk(i, None, "stop")]))
                if prep.include_usage:
                    yield sse_event(reply.usage_chunk())
                yield b"data: [DONE]\n\n"
            except APIError as exc:
                yield sse_event(exc.body())
                yield b"data: [DONE]\n\n"
            finally:
                await deltas.aclose()  # type: ignore[attr-defined]

        hdrs = {**SSE_HEADERS, **headers(prep, first, t0, time.perf_counter())}
        if with_ids:
            hdrs[TOKEN_IDS_HEADER] = "1"
        return StreamingResponse(body(), media_type="text/event-stream", headers=hdrs)

    async def full_response(
        prep: Prepared, deltas: AsyncIterator[Delta], request: Request, t0: float
    ) -> Response:
        """A reply sent whole: its headers at the first token (marked, see
        :mod:`gateway.node_headers`), its JSON body once the last token is out. An engine error
        after the first token ends the connection without a body, so the client sees a failed
        node, never a 200 with half an answer; a client that leaves cancels the request (the
        response's disconnect listener cancels the body, which closes ``deltas``)."""
        try:
            first = await until_first(deltas, request)
        except StopAsyncIteration:
            raise APIError(500, "engine produced no output", type_="server_error") from None
        if first is None:
            await deltas.aclose()  # type: ignore[attr-defined]
            return Response(status_code=499)
        t_first = time.perf_counter()

        async def body() -> AsyncIterator[bytes]:
            reply = Reply(prep, texts)
            reply.take(first)
            try:
                if not reply.done:
                    async for d in deltas:
                        reply.take(d)
                        if reply.done:
                            break
            finally:
                await deltas.aclose()  # type: ignore[attr-defined]
            obj = reply.whole()
            yield json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

        hdrs = {**headers(prep, first, t0, t_first), HEADERS_AT_FIRST_TOKEN: "1"}
        return StreamingResponse(body(), media_type="application/json", headers=hdrs)

    # Bodies are read and validated here, not by FastAPI: Content-Type and nesting depth are
    # checked first (gateway.json_limits), so every bad body is a 4xx naming what is wrong.
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = validated_body(
            await request.body(), request.headers.get("content-type"), ChatCompletionRequest
        )
        prep = await service.prepare_chat(req)
        return await respond(prep, req.stream, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = validated_body(
            await request.body(), request.headers.get("content-type"), CompletionRequest
        )
        prep = await service.prepare_completion(req)
        return await respond(prep, req.stream, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(service.config.model_name)]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "node": service.config.node_id,
            "tier": service.engine.kind,
            "model": service.config.model_name,
            "store": None if publisher is None else publisher.status(),
        }

    @app.get("/load")
    async def load() -> dict[str, Any]:
        return service.node_state().model_dump(mode="json")

    @app.get("/prefix/events")
    async def prefix_events(epoch: str | None = None, since: int = 0) -> dict[str, Any]:
        """The node's prefix-cache changes after cursor ``(epoch, since)``, or its whole index
        (``full``) when the cursor is from another run or too old (routing.fleet.block_feed)."""
        if feed is None:
            raise APIError(
                404,
                "this node keeps no prefix cache",
                type_="invalid_request_error",
                code="no_prefix_cache",
            )
        return feed.since(epoch, since).to_json()

    @app.get("/tokenizer/{model:path}")
    async def tokenizer(model: str) -> dict[str, Any]:
        service.check_model(model)
        files = {
            f: (service.config.model_path / f).read_text()
            for f in TOKENIZER_FILES
            if (service.config.model_path / f).is_file()
        }
        return {
            "model": service.config.model_name,
            "identity": service.config.model_identity,
            "files": files,
        }

    return app
