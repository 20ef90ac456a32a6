"""One owner per dispatch (issue 15.1): whatever path a request takes through the gateway, its
concurrency slot, router tickets, circuit-breaker accounting and openai-node tracker end
exactly once.

The real gateway app over httpx's ASGI transport, in front of a real tiny cloud node and of
a deliberately broken ``openai`` node (tests/inproc.py) that the test policy tries first.
After each failure path: ``gateway.in_flight == 0``, no router ticket left on any node, the
trackers' counts exactly what happened.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.inproc import FlakyNode, assert_idle, eventually, started_gateway
from tests.nodes import Served, serve_node, tiny_cloud_engine


@pytest.fixture(scope="module")
def fleet(
    tiny_model_path: Path, tiny_home: dict[str, str], one_torch_thread: None
) -> Iterator[dict]:
    from routing.model_store import resolve

    info = resolve(tiny_model_path)
    cloud = serve_node(tiny_cloud_engine(tiny_model_path), tiny_model_path, "b-cloud")
    flaky = FlakyNode()
    bad = Served(flaky.app)
    try:
        yield {"cloud": cloud, "flaky": flaky, "bad": bad, "model": info.name}
    finally:
        cloud.stop()
        bad.stop()


@pytest.fixture
async def gw(fleet: dict) -> AsyncIterator[tuple[Any, Any]]:
    """(gateway, client); the app is ``gateway.app`` (set here for the raw ASGI tests)."""
    from gateway.front.config import GatewayConfig
    from routing.fleet.memory_store import OpenAINodeConfig

    flaky = OpenAINodeConfig(
        id="a-flaky", url=fleet["bad"].url, region="test", models=[fleet["model"]]
    )
    config = GatewayConfig(
        nodes=[fleet["cloud"].url], openai_nodes=[flaky], poll_interval_s=2.0, max_in_flight=8
    )
    app, gateway, client = await started_gateway(config, nodes=2)
    gateway.test_app = app
    gateway.policy_override = "by_id"
    fleet["flaky"].mode = "500"
    try:
        yield gateway, client
    finally:
        await client.aclose()
        await gateway.close()


def _chat(model: str, stream: bool, **extra: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": stream,
    }
    return {**body, **extra}


def _cloud_only(gateway: Any) -> None:
    """Take the flaky node out of the picture (its circuit open)."""
    gateway.breakers.configure(1, 60.0, 1)
    gateway.breakers.on_failure("a-flaky")


async def test_stream_that_a_node_refuses_gives_its_slot_back(gw, fleet) -> None:
    """The red team's leak: streams a node answers with a 4xx (an out-of-vocabulary token
    id) kept their concurrency slot; 8 slots, 30 such requests, then a good one still runs."""
    gateway, client = gw
    _cloud_only(gateway)
    bad = {"model": fleet["model"], "prompt": [49152 + 7], "max_tokens": 2, "stream": True}
    for _ in range(30):
        r = await client.post("/v1/completions", json=bad)
        assert r.status_code == 400, r.text
        assert "vocabulary" in r.text
    assert_idle(gateway, ["b-cloud"])
    r = await client.post("/v1/chat/completions", json=_chat(fleet["model"], True))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert_idle(gateway, ["b-cloud"])


async def test_exception_inside_the_relay_ends_the_dispatch(gw, fleet, monkeypatch) -> None:
    from gateway.front.relay import StreamRelay

    gateway, client = gw
    _cloud_only(gateway)

    def boom(self: Any, data: bytes) -> bytes:
        raise RuntimeError("a bug in the relay")

    monkeypatch.setattr(StreamRelay, "_usage_and_done", boom)
    for _ in range(10):
        r = await client.post("/v1/chat/completions", json=_chat(fleet["model"], True))
        assert r.status_code == 200  # the headers had gone out; the body ends early
        assert "[DONE]" not in r.text
    assert_idle(gateway, ["b-cloud"])


async def test_exception_before_a_stream_starts_ends_the_dispatch(gw, fleet, monkeypatch) -> None:
    gateway, client = gw

    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("a bug in the request path")

    monkeypatch.setattr(gateway.path, "decide", boom)
    for stream in (True, False):
        for _ in range(10):
            r = await client.post("/v1/chat/completions", json=_chat(fleet["model"], stream))
            assert r.status_code == 500
    assert gateway.in_flight == 0


@pytest.mark.parametrize("mode", ["500", "drop"])
async def test_failover_before_the_first_byte_finishes_the_failed_node_once(
    gw, fleet, mode: str
) -> None:
    """The flaky openai node is tried first and fails (a 500, or a stream that breaks before
    its first event); the cloud answers. The flaky node's tracker is finished once (failed),
    not again when the replacement answers; its breaker counts one failure per request."""
    gateway, client = gw
    fleet["flaky"].mode = mode
    tracker = gateway.trackers["a-flaky"]
    failed0 = tracker.failed
    n = 3
    for i in range(n):
        stream = mode == "drop" or i % 2 == 0
        r = await client.post("/v1/chat/completions", json=_chat(fleet["model"], stream))
        assert r.status_code == 200, r.text
        assert r.headers["x-edgecloud-node"] == "b-cloud"
        assert r.headers["x-edgecloud-attempts"] == "2"
    assert tracker.failed - failed0 == n
    assert tracker.completed == 0
    assert gateway.breakers._nodes["a-flaky"].failures == n
    assert_idle(gateway, ["a-flaky", "b-cloud"])


async def test_every_node_failing_is_a_503_and_leaves_nothing(gw, fleet) -> None:
    gateway, client = gw
    gateway.breakers.configure(100, 60.0, 1)
    fleet["flaky"].mode = "500"
    # only the flaky node serves this (the cloud's context is too small for it)
    body = _chat(fleet["model"], False, max_tokens=4000)
    tracker = gateway.trackers["a-flaky"]
    failed0 = tracker.failed
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 503, r.text
    assert tracker.failed - failed0 == 1
    assert_idle(gateway, ["a-flaky", "b-cloud"])


async def test_whole_reply_cut_short_goes_to_the_next_node(gw, fleet) -> None:
    """Nothing of a whole reply reached the client when its node broke off mid-body: the
    next candidate answers; the broken leg ends once, failed, in its tracker and breaker."""
    gateway, client = gw
    gateway.breakers.configure(100, 60.0, 1)
    fleet["flaky"].mode = "partial"
    tracker = gateway.trackers["a-flaky"]
    failed0 = tracker.failed
    r = await client.post("/v1/chat/completions", json=_chat(fleet["model"], False))
    assert r.status_code == 200, r.text
    assert r.headers["x-edgecloud-node"] == "b-cloud"
    assert r.headers["x-edgecloud-reason"] == "failover"
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert tracker.failed - failed0 == 1
    assert gateway.breakers._nodes["a-flaky"].failures >= 1
    assert_idle(gateway, ["a-flaky", "b-cloud"])


async def test_whole_reply_cut_short_with_no_node_left_is_a_502(gw, fleet) -> None:
    gateway, client = gw
    gateway.breakers.configure(100, 60.0, 1)
    fleet["flaky"].mode = "partial"
    for _ in range(100):  # b-cloud's circuit open: no node to send it to again
        gateway.breakers.on_failure("b-cloud")
    tracker = gateway.trackers["a-flaky"]
    failed0 = tracker.failed
    r = await client.post("/v1/chat/completions", json=_chat(fleet["model"], False))
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "upstream_error"
    assert tracker.failed - failed0 == 1
    assert_idle(gateway, ["a-flaky", "b-cloud"])


async def test_whole_reply_success_teaches_the_router(gw, fleet) -> None:
    gateway, client = gw
    _cloud_only(gateway)
    before = gateway.router.model.errors.snapshot()
    r = await client.post("/v1/chat/completions", json=_chat(fleet["model"], False))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert_idle(gateway, ["b-cloud"])
    assert gateway.router.model.errors.snapshot() != before  # the router learned from it


# ---- the client leaves -------------------------------------------------------------------------
def _scope(path: str, spec: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"gw")],
        "client": ("127.0.0.1", 5555),
        "server": ("gw", 80),
    }


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
async def test_client_gone_before_the_body_starts(gw, fleet, spec: str) -> None:
    """The client is gone when the reply's first bytes are written: Starlette never iterates
    the body (its generator never starts), and the dispatch still ends."""
    gateway, _ = gw
    _cloud_only(gateway)
    body = json.dumps(_chat(fleet["model"], True)).encode()
    sent = False
    hang = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await hang.wait()  # the disconnect is never announced: the write fails instead
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("the client is gone")

    app = gateway.test_app
    with pytest.raises(Exception):  # noqa: B017 - whatever the server would log
        await app(_scope("/v1/chat/completions", spec), receive, send)
    hang.set()
    assert gateway.in_flight == 0
    assert_idle(gateway, ["b-cloud"])


async def test_client_gone_while_the_node_works(gw, fleet) -> None:
    """The client leaves before its reply started (a whole reply; the node is slow): the
    dispatch is cancelled and ends, the node's connection is closed."""
    gateway, _ = gw
    gateway.breakers.configure(100, 60.0, 1)
    fleet["flaky"].mode, fleet["flaky"].delay_s = "slow", 30.0
    body = json.dumps(_chat(fleet["model"], False)).encode()
    sent = False
    gone = asyncio.Event()
    answers: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        answers.append(message)

    app = gateway.test_app
    task = asyncio.ensure_future(app(_scope("/v1/chat/completions", "2.3"), receive, send))
    await eventually(lambda: gateway.in_flight == 1 and fleet["flaky"].hits > 0)
    gone.set()
    await asyncio.wait_for(task, 5)
    assert answers and answers[0]["status"] == 499
    assert_idle(gateway, ["a-flaky", "b-cloud"])
    await eventually(lambda: fleet["flaky"].gone == 1)  # the node saw its connection closed


async def test_relay_response_dropped_uncalled_ends_its_dispatch(gw, fleet) -> None:
    """A streamed reply that nobody ever calls (the server dropped it): its finalizer ends
    the dispatch."""
    from starlette.requests import Request

    from gateway.auth import KeyIdentity
    from gateway.front.relay import RelayResponse
    from gateway.openai_schema import ChatCompletionRequest

    gateway, _ = gw
    _cloud_only(gateway)
    data = _chat(fleet["model"], True)
    req = ChatCompletionRequest.model_validate(data)

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    request = Request(_scope("/v1/chat/completions", "2.3"), receive)
    resp = await gateway.forward(
        request, data, "chat", req, KeyIdentity("test", source="anonymous")
    )
    assert isinstance(resp, RelayResponse)
    assert gateway.in_flight == 1
    del resp
    gc.collect()
    assert_idle(gateway, ["b-cloud"])
