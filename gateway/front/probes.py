"""The gateway's three probes, each on its own endpoint, for orchestrators and load balancers.

``GET /livez``: 200 while the event loop answers (no I/O); restart the process when it fails.
``GET /startupz``: 200 once the fleet store has given one view that is not stale (Redis
answered, or the in-process store polled its nodes), else 503; it stays 200 after that.
``GET /readyz``: 200 while the gateway sees at least one fresh node of its Node API major
version, else 503 naming why; a
load balancer sends it traffic only then. None needs a key, and none names a node or a URL.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from gateway.front.gateway import Gateway
from routing.fleet.state import api_compatible


class StartupLatch:
    """Set once, by the first fleet view that is not stale; never unset."""

    def __init__(self) -> None:
        self.done = False


def _answer(ok: bool, body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body, status_code=200 if ok else 503)


def register_probes(app: FastAPI, gw: Gateway) -> None:
    """Add ``/livez``, ``/startupz`` and ``/readyz`` to ``app`` over ``gw``'s fleet store."""
    latch = StartupLatch()

    async def fresh_nodes() -> tuple[int, bool]:
        view = await gw.store.view([])
        if not view.stale:
            latch.done = True
        usable = [n for n in view.nodes if n.is_fresh() and api_compatible(n.api_version)]
        return len(usable), view.stale

    @app.get("/livez", tags=["Gateway"], include_in_schema=False)
    async def livez() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/startupz", tags=["Gateway"], include_in_schema=False)
    async def startupz() -> JSONResponse:
        if not latch.done:
            await fresh_nodes()
        return _answer(latch.done, {"status": "started" if latch.done else "starting"})

    @app.get("/readyz", tags=["Gateway"], include_in_schema=False)
    async def readyz() -> JSONResponse:
        nodes, stale = await fresh_nodes()
        status = "ready" if nodes else "no fresh node"
        return _answer(nodes > 0, {"status": status, "nodes": nodes, "store_stale": stale})
