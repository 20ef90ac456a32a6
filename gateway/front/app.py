"""The front gateway's HTTP routes: the one endpoint apps see.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``POST /v1/route``
(where a request would go and why, without running it), ``GET /health``, ``GET /metrics`` and
the admin routes (``/admin/nodes``, ``/admin/policy``) behind the admin key.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.routing import Route

from gateway.auth import KeyIdentity
from gateway.body_limit import BodyLimitMiddleware
from gateway.errors import bad_request, install_error_handlers
from gateway.front.config import GatewayConfig
from gateway.front.gateway import Gateway
from gateway.metrics import metrics_response
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, model_card
from routing.fleet.store import FleetStore
from routing.policies import make_policy


def tune_gc(young_threshold: int = 10_000) -> None:
    """Keep the cyclic garbage collector off the request path.

    What exists once the gateway has started (modules, tokenizers, schemas, routes) lives as
    long as the process: frozen, full collections no longer walk it (unfrozen, each one took
    tens of ms here, a latency spike every few thousand requests). A request's objects are freed
    by reference counting; a larger young generation makes the collector run less often for the
    few that form cycles.
    """
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    if threshold[0] and threshold[0] < young_threshold:
        gc.set_threshold(young_threshold, *threshold[1:])


def create_gateway_app(config: GatewayConfig, store: FleetStore | None = None) -> FastAPI:
    gw = Gateway(config, store)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        if config.tune_gc:
            tune_gc()
        try:
            yield
        finally:
            await gw.close()

    app = FastAPI(title="edgecloud gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.state.gateway = gw

    # The two hot routes are plain Starlette routes: FastAPI's per-request dependency solving
    # was about a tenth of the gateway's CPU per request; errors still go through the app's
    # exception handlers, and the auth check is the same ``gw.auth`` dependency, called here.
    async def chat(request: Request) -> Response:
        who = await gw.auth(request)
        data, req = await gw.parse(request, ChatCompletionRequest)
        return await gw.forward(request, data, "chat", req, who)

    async def completions(request: Request) -> Response:
        who = await gw.auth(request)
        data, req = await gw.parse(request, CompletionRequest)
        return await gw.forward(request, data, "completion", req, who)

    app.router.routes.append(Route("/v1/chat/completions", chat, methods=["POST"]))
    app.router.routes.append(Route("/v1/completions", completions, methods=["POST"]))

    @app.post("/v1/route")
    async def route(request: Request, who: KeyIdentity = Depends(gw.auth)) -> dict[str, Any]:
        raw = await request.body()
        is_chat = b'"messages"' in raw
        data, req = await gw.parse(request, ChatCompletionRequest if is_chat else CompletionRequest)
        return await gw.route_only(
            data, "chat" if is_chat else "completion", req, request, who.key_id
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return metrics_response(gw.metrics, request)

    @app.get("/v1/models")
    async def models(_: KeyIdentity = Depends(gw.auth)) -> dict[str, Any]:
        return {"object": "list", "data": [model_card(m) for m in await gw.models()]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return gw.health()

    @app.get("/admin/nodes")
    async def admin_nodes(_: KeyIdentity = Depends(gw.auth.require_admin)) -> dict[str, Any]:
        view = await gw.store.view([])
        return {
            "stale": view.stale,
            "nodes": [n.model_dump(mode="json") for n in view.nodes],
            "circuits": gw.breakers.snapshot(),
        }

    @app.get("/admin/policy")
    async def admin_policy(_: KeyIdentity = Depends(gw.auth.require_admin)) -> dict[str, Any]:
        return {
            "active": gw.policy_override or gw.router.config.policy,
            "config": gw.router.config.model_dump(mode="json"),
        }

    @app.post("/admin/policy")
    async def admin_set_policy(
        body: dict[str, Any], _: KeyIdentity = Depends(gw.auth.require_admin)
    ) -> dict[str, Any]:
        name = body.get("policy")
        if name is not None:
            try:
                make_policy(str(name))
            except (KeyError, ValueError) as exc:
                raise bad_request(f"unknown policy {name!r}", param="policy") from exc
        gw.policy_override = name
        return {"active": gw.policy_override or gw.router.config.policy}

    return app
