"""Helpers for in-process gateway tests: the real gateway app over httpx's ASGI transport, in
front of real nodes (tests/nodes.py) and of deliberately broken ones, and the counters a
finished request must leave at zero."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from routing import policies
from routing.policies import Decision, PolicyInput


@dataclass
class ById:
    """A test policy: candidates in node-id order, so a test says which node is tried first."""

    name: str = "by_id"

    def decide(self, inp: PolicyInput) -> Decision:
        ordered = sorted(inp.candidates, key=lambda c: c.node.id)
        return policies._decision(self.name, inp, ordered, "by_id", "test order")


policies.POLICIES.setdefault("by_id", ById)


@dataclass
class FlakyNode:
    """An OpenAI-compatible node that fails as told: ``mode`` is one of ``500`` (answers 500),
    ``drop`` (200, then closes before the first event), ``partial`` (a whole reply cut short),
    ``slow`` (answers after ``delay_s``, or stops when the caller closes the connection: then
    ``gone`` counts it)."""

    mode: str = "500"
    delay_s: float = 0.0
    hits: int = 0
    gone: int = 0
    app: FastAPI = field(init=False)

    def __post_init__(self) -> None:
        app = FastAPI()

        async def handle(request: Request) -> Response:
            self.hits += 1
            body = await request.json()
            if self.mode == "500":
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if self.mode == "slow":
                deadline = time.monotonic() + self.delay_s
                while time.monotonic() < deadline:
                    if await request.is_disconnected():
                        self.gone += 1
                        return Response(status_code=499)
                    await asyncio.sleep(0.05)
                return JSONResponse({"choices": [], "usage": {}})
            if self.mode == "partial":
                return Response(b'{"choices": [', headers={"content-length": "400"})

            async def nothing() -> AsyncIterator[bytes]:
                raise RuntimeError("the node dies before its first event")
                yield b""  # pragma: no cover

            del body
            return StreamingResponse(nothing(), media_type="text/event-stream")

        app.add_api_route("/v1/chat/completions", handle, methods=["POST"])
        app.add_api_route("/v1/completions", handle, methods=["POST"])
        self.app = app


async def started_gateway(config: Any, nodes: int) -> tuple[FastAPI, Any, httpx.AsyncClient]:
    """The gateway app for ``config`` (its store started), once its view has ``nodes`` nodes,
    and an httpx client on it over the ASGI transport (app exceptions become 500s)."""
    from gateway.front.app import create_gateway_app

    app = create_gateway_app(config)
    gw = app.state.gateway
    await gw.start()
    deadline = time.monotonic() + 30
    while len((await gw.store.view([])).nodes) < nodes:
        if time.monotonic() > deadline:
            raise TimeoutError("the gateway did not see every node")
        await asyncio.sleep(0.05)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    client = httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60)
    # the first request fetches and loads the model's tokenizer (seconds on this machine,
    # during which node states may expire): done here, before the test
    model = (await gw.store.view([])).nodes[0].models[0]
    for body in (
        {"model": model, "prompt": "warm up", "max_tokens": 1},
        {"model": model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1},
    ):
        for _ in range(3):
            if (await client.post("/v1/route", json=body)).status_code == 200:
                break
            await asyncio.sleep(0.5)
    return app, gw, client


def assert_idle(gw: Any, node_ids: list[str] | None = None) -> None:
    """Nothing of any request is left: slot, router tickets, trackers."""
    assert gw.in_flight == 0, f"{gw.in_flight} concurrency slots still held"
    ledger = gw.router.ledger
    for node_id in node_ids or list(ledger._times):
        assert ledger.in_flight(node_id) == 0, f"tickets left on {node_id}"
    for tr in gw.trackers.values():
        assert tr.in_flight == 0, f"tracker {tr.id} counts {tr.in_flight} in flight"


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


class CutProxy:
    """A TCP proxy in front of a node, in its own thread: ``kill()`` drops every connection
    at once and refuses new ones, as a node process that died would; ``cut_after(n)`` does
    so once ``n`` SSE content events (``data:`` lines with ``"content"``, ``"text"`` or
    ``"tool_calls"``) of a reply went through."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cut_after: int | None = None
        self._seen = 0
        self.killed = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._conns: set[asyncio.StreamWriter] = set()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def cut_after(self, events: int) -> None:
        """Kill once ``events`` more content events went through (any connection)."""
        self._seen = 0
        self._cut_after = events

    def kill(self) -> None:
        self._loop.call_soon_threadsafe(self._kill)
        self.killed.wait(5)

    def revive(self) -> None:
        """Accept connections again (the node 'restarted'); no cut armed."""
        self._cut_after = None
        fut = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        fut.result(10)
        self.killed.clear()

    async def _listen(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None and server.is_serving():
            return
        if server is not None:
            await server.wait_closed()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    def stop(self) -> None:
        self.kill()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._listen())
        ready.set()
        self._loop.run_forever()

    def _kill(self) -> None:
        self._server.close()
        for w in list(self._conns):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self.killed.set()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            cw.transport.abort()
            return
        self._conns.update((cw, uw))

        async def up() -> None:
            with contextlib.suppress(Exception):
                while data := await cr.read(65536):
                    uw.write(data)
                    await uw.drain()

        async def down() -> None:
            with contextlib.suppress(Exception):
                while data := await ur.read(65536):
                    limit = self._cut_after
                    if limit is not None:
                        pos, cut_at = 0, None
                        while (j := data.find(b"\n\n", pos)) >= 0:  # count events as they pass
                            seg = data[pos:j]
                            if b'"content"' in seg or b'"text"' in seg or b'"tool_calls"' in seg:
                                if self._seen >= limit:
                                    cut_at = pos
                                    break
                                self._seen += 1
                            pos = j + 2
                        if cut_at is not None:
                            cw.write(data[:cut_at])
                            await cw.drain()
                            self._kill()
                            return
                    cw.write(data)
                    await cw.drain()

        try:
            await asyncio.gather(up(), down())
        finally:
            for w in (cw, uw):
                self._conns.discard(w)
                with contextlib.suppress(Exception):
                    w.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
