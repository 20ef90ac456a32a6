"""The front gateway's HTTP routes: the one endpoint apps see.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``POST /v1/route``
(where a request would go and why, without running it), ``GET /health``, ``GET /metrics``, the
probes (``/livez``, ``/startupz``, ``/readyz``: ``gateway.front.probes``) and the admin routes (``/admin/nodes``, ``/admin/policy``) behind the admin key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette._utils import is_async_callable
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.apis.routes import install_api_routes
from gateway.auth import KeyIdentity, enforce_rate_limit, is_local
from gateway.body_limit import BodyLimitMiddleware
from gateway.errors import APIError, bad_request, install_error_handlers, public_error
from gateway.fleet_gauges import FleetGauges
from gateway.front import fastjson, reports
from gateway.front.config import GatewayConfig
from gateway.front.gateway import Gateway
from gateway.front.headers import visible_route
from gateway.front.openapi import (
    ADMIN_ERRORS,
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    MODELS_RESPONSES,
    ROUTE_BODY,
    ROUTE_RESPONSES,
    NodesView,
    PolicyChange,
    PolicyView,
    install_docs,
)
from gateway.front.probes import register_probes
from gateway.front.request_path import parse_json
from gateway.gc_tuning import tune_gc
from gateway.metrics import metrics_response
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, model_card
from gateway.workers.spec import WorkerInfo
from routing.fleet.store import FleetStore
from routing.policies import make_policy

log = logging.getLogger(__name__)

# a hot route: (request, read the body) -> response
Endpoint = Callable[[Request, Callable[[], Awaitable[bytes]]], Awaitable[Response]]


class _TooLarge(Exception):
    pass


class GatewayApp(FastAPI):
    """The FastAPI app, with its hot routes served without the framework's per-request layers.

    ``POST /v1/chat/completions`` and ``POST /v1/completions`` are most of the traffic; going
    through Starlette's middleware stack and router (a coroutine and a wrapped ``send`` per
    layer) was about a tenth of the gateway's CPU per request. Served here, they keep exactly
    what those layers did for them: the request body limit (:class:`BodyLimitMiddleware`: 400
    on a bad Content-Length, 413 over the limit, counted as the body arrives), the app's
    exception handlers (looked up as Starlette does, by status for HTTP exceptions, then by the
    exception's class; anything unhandled gets the app's 500 handler and is re-raised for the
    server to log). Any other request, or any app whose middleware is not the gateway's own
    (someone added one), goes through FastAPI as usual.
    """

    def __init__(self, *args: Any, max_body_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_body_bytes = max_body_bytes
        self.hot_routes: dict[str, Endpoint] = {}
        self._fast: bool | None = None

    def _fast_ok(self) -> bool:
        um = self.user_middleware
        return (
            len(um) == 1
            and um[0].cls is BodyLimitMiddleware
            and um[0].kwargs.get("max_bytes") == self.max_body_bytes
            and getattr(self, "max_body_size", None) is None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and not scope.get("root_path")
            and not self.root_path
        ):
            endpoint = self.hot_routes.get(scope["path"])
            if endpoint is not None:
                if self._fast is None:
                    self._fast = self._fast_ok()
                if self._fast:
                    scope["app"] = self
                    await self._serve_hot(endpoint, scope, receive, send)
                    return
        await super().__call__(scope, receive, send)

    async def _serve_hot(
        self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send
    ) -> None:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await BodyLimitMiddleware._reject(send, 400, "invalid Content-Length header")
                    return
                if declared > limit:
                    await BodyLimitMiddleware._reject(send, 413, self._too_large())
                    return

        async def read_body() -> bytes:
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.request":
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise _TooLarge
                    if chunk:
                        chunks.append(chunk)
                    if not message.get("more_body", False):
                        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
                elif message["type"] == "http.disconnect":
                    raise ClientDisconnect()

        request = Request(scope, receive)
        try:
            response = await endpoint(request, read_body)
        except _TooLarge:
            await BodyLimitMiddleware._reject(send, 413, self._too_large())
            return
        except Exception as exc:
            response = await self._handled(request, exc, scope, receive, send)
        await response(scope, receive, send)

    def _too_large(self) -> str:
        return f"Request body too large: the limit is {self.max_body_bytes} bytes."

    async def _handled(
        self, request: Request, exc: Exception, scope: Scope, receive: Receive, send: Send
    ) -> Response:
        """What Starlette's exception middleware and server-error middleware do with ``exc``."""
        handlers: dict[Any, Any] = {}
        error_handler = None
        for key, value in self.exception_handlers.items():
            if key in (500, Exception):
                error_handler = value
            else:
                handlers[key] = value
        handler = None
        if isinstance(exc, HTTPException):
            handler = handlers.get(exc.status_code)
        if handler is None:
            handler = next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)
        if handler is not None:
            if is_async_callable(handler):
                response = await handler(request, exc)
            else:
                response = await run_in_threadpool(handler, request, exc)
            exc.__traceback__ = None
            return response
        if error_handler is None:
            response = PlainTextResponse("Internal Server Error", status_code=500)
        elif is_async_callable(error_handler):
            response = await error_handler(Request(scope), exc)
        else:
            response = await run_in_threadpool(error_handler, Request(scope), exc)
        await response(scope, receive, send)
        raise exc


def create_gateway_app(
    config: GatewayConfig, store: FleetStore | None = None, worker: WorkerInfo | None = None
) -> FastAPI:
    """The gateway's app; ``worker``: which of ``edgecloud gateway --workers N`` serves it."""
    gw = Gateway(config, store, worker)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        if config.tune_gc:
            tune_gc()
        try:
            yield
        finally:
            await gw.close()

    app = GatewayApp(
        title="edgecloud gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        max_body_bytes=config.max_body_bytes,
    )
    install_error_handlers(app)
    install_docs(app)  # /docs, /redoc, /openapi.json (hot routes included), /

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return public_error(request, exc).response()

    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.state.gateway = gw
    install_api_routes(app, gw)  # /v1/responses and /v1/messages over the chat path

    # The two hot routes: served by GatewayApp directly (see its docstring), and also plain
    # Starlette routes (FastAPI's per-request dependency solving was about a tenth of the
    # gateway's CPU per request) for when the app is not on its fast path. Either way the auth
    # check is the same ``gw.auth`` dependency, called first, then the rate limit on the
    # body's declared length (``gw.charges.admit``), and the body is read after both.
    def hot(model_cls: Any, route: str) -> Endpoint:
        async def endpoint(request: Request, read_body: Callable[[], Awaitable[bytes]]) -> Response:
            who = await gw.auth(request)
            rate = await gw.charges.admit(request, who)  # limits before the body is read
            try:
                data, req, strict = parse_json(
                    await read_body(), model_cls, request.headers.get("content-type")
                )
            except BaseException:
                await gw.limiter.settle(rate, 0)  # the request counts, its tokens do not
                raise
            return await gw.forward(request, data, route, req, who, strict_json=strict, rate=rate)

        return endpoint

    def route(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            return await endpoint(request, request.body)

        return handle

    for path, endpoint in (
        ("/v1/chat/completions", hot(ChatCompletionRequest, "chat")),
        ("/v1/completions", hot(CompletionRequest, "completion")),
    ):
        app.hot_routes[path] = endpoint
        app.router.routes.append(Route(path, route(endpoint), methods=["POST"]))

    @app.post("/v1/route", tags=["Gateway"], responses=ROUTE_RESPONSES, openapi_extra=ROUTE_BODY)
    async def route(request: Request) -> dict[str, Any]:
        """Where a request would go, in the caller's cache scope. Node URLs only for admins
        (with auth off: local callers); anyone else is charged one request (no tokens)
        against their rate limit first, and sees what ``decision_headers`` allows."""
        who = await gw.auth.admin_or_none(request) or await gw.auth(request)
        level = config.decision_headers
        if not who.admin:
            if level == "off":
                raise APIError(
                    403,
                    "Routing decisions are not shown to callers on this gateway.",
                    type_="permission_error",
                    code="decision_hidden",
                )
            await enforce_rate_limit(gw.limiter, who, 0, gw.metrics.observe_rate_limited)
        raw = await request.body()
        is_chat = b'"messages"' in raw
        model_cls = ChatCompletionRequest if is_chat else CompletionRequest
        data, req, _ = parse_json(raw, model_cls, request.headers.get("content-type"))
        out = await reports.route_only(
            gw, data, "chat" if is_chat else "completion", req, request, who
        )
        return out if who.admin else visible_route(out, level)

    async def observer(request: Request) -> bool:
        """May the caller see ``/metrics`` and ``/health``'s details (``config.observability``)?
        Raises the 403 where the mode protects them and it may not."""
        mode = config.observability
        privileged = (mode != "admin" and is_local(request.scope)) or (
            await gw.auth.admin_or_none(request) is not None
        )
        if privileged or mode == "open":
            return privileged
        raise APIError(
            403,
            f"{request.url.path} is served to loopback callers or admin keys only"
            if mode == "loopback"
            else f"{request.url.path} needs an admin key",
            type_="permission_error",
            code="forbidden",
        )

    @app.get("/metrics", tags=["Gateway"], responses=METRICS_RESPONSES)
    async def metrics(request: Request) -> Response:
        await observer(request)
        fleet_gauges.update((await gw.store.view([])).nodes, gw.breakers.snapshot())
        return metrics_response(gw.metrics, request)

    @app.get("/v1/models", tags=["OpenAI"], responses=MODELS_RESPONSES)
    async def models(_: KeyIdentity = Depends(gw.auth)) -> dict[str, Any]:
        return {"object": "list", "data": [model_card(m) for m in await reports.models(gw)]}

    register_probes(app, gw)
    fleet_gauges = FleetGauges(gw.metrics.registry)

    @app.get("/health", tags=["Gateway"], responses=HEALTH_RESPONSES)
    async def health(request: Request) -> dict[str, Any]:
        h = reports.health(gw)
        return h if await observer(request) else {"status": h["status"]}

    @app.get("/admin/nodes", tags=["Admin"], responses={200: {"model": NodesView}, **ADMIN_ERRORS})
    async def admin_nodes(_: KeyIdentity = Depends(gw.auth.require_admin)) -> dict[str, Any]:
        view = await gw.store.view([])
        model = gw.router.model
        ledger = gw.router.ledger
        return {
            "stale": view.stale,
            "nodes": [n.model_dump(mode="json") for n in view.nodes],
            # rows in flight per node: this process's, and the other workers' (--workers)
            "in_flight": {
                n.id: {
                    "here": ledger.rows_in_flight(n.id),
                    "other_workers": view.others_in_flight.get(n.id, 0),
                }
                for n in view.nodes
            },
            **({"worker": gw.worker.describe()} if gw.worker is not None else {}),
            "circuits": gw.breakers.snapshot(),
            "latency_model": model.snapshot({n.id: n for n in view.nodes}),
            "prediction_errors": model.errors.snapshot(),
        }

    @app.get("/admin/usage", tags=["Admin"], responses=ADMIN_ERRORS)
    async def admin_usage(
        since: float | None = None,
        until: float | None = None,
        _: KeyIdentity = Depends(gw.auth.require_admin),
    ) -> dict[str, Any]:
        """Tokens used per API key and team (prompt, cached, output) in ``[since, until)``
        (unix seconds; default: the last hour), in minute buckets (``gateway.usage``)."""
        end = time.time() if until is None else until
        start = end - 3600 if since is None else since
        if not start < end:
            raise APIError(400, "since must be before until", param="since")
        return gw.usage.window(start, end)

    @app.get(
        "/admin/policy", tags=["Admin"], responses={200: {"model": PolicyView}, **ADMIN_ERRORS}
    )
    async def admin_policy(_: KeyIdentity = Depends(gw.auth.require_admin)) -> dict[str, Any]:
        return {
            "active": gw.policy_override or gw.router.config.policy,
            "config": gw.router.config.model_dump(mode="json"),
        }

    @app.post(
        "/admin/policy",
        tags=["Admin"],
        responses={200: {"model": PolicyView}, **ADMIN_ERRORS},
        openapi_extra={
            "requestBody": {
                "content": {"application/json": {"schema": PolicyChange.model_json_schema()}},
                "required": True,
            }
        },
    )
    async def admin_set_policy(request: Request) -> dict[str, Any]:
        """The admin key is checked before the body is read (a body parameter would make
        FastAPI read it first)."""
        await gw.auth.require_admin(request)
        try:
            data, _ = fastjson.loads_request(
                await request.body(), request.headers.get("content-type")
            )
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"the body is not JSON: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object", code="invalid_json")
        name = data.get("policy")
        if name is not None:
            try:
                make_policy(str(name))
            except (KeyError, ValueError) as exc:
                raise bad_request(f"unknown policy {name!r}", param="policy") from exc
        gw.policy_override = name
        return {"active": gw.policy_override or gw.router.config.policy}

    return app
