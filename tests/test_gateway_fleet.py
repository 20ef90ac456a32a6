"""Gateways sharing the Redis fleet store with live cloud nodes: one view of the fleet and of
the prefix index from every gateway, Redis outages, and a node dying under load."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import RedisServer, free_port
from tests.nodes import Proc, cli

SYSTEM = " ".join(f"Rule {i}: answer politely and precisely." for i in range(40))  # ~300 tokens


def _gateway(redis_url: str, folder: Path, name: str) -> Proc:
    port = free_port()
    policy = folder / f"{name}-policy.yaml"
    policy.write_text(yaml.safe_dump({"default_region": "eu-west", "gateway_region": "eu-west"}))
    cfg = folder / f"{name}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"redis_url": redis_url, "policy_file": str(policy), "virtual_models": {"auto": "tiny"}}
        )
    )
    return Proc(
        cli("gateway", "--config", str(cfg), "--port", str(port)), port, folder / f"{name}.log"
    )


def _cloud(model: Path, redis_url: str, folder: Path, node_id: str) -> Proc:
    port = free_port()
    return Proc(
        cli(
            "cloud",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--region",
            "eu-west",
            "--node-id",
            node_id,
            "--device",
            "cpu",
            "--threads",
            "1",
            "--redis",
            redis_url,
        ),
        port,
        folder / f"{node_id}.log",
    )


@pytest.fixture(scope="module")
def fleet(tiny_model_path: Path, redis_url: str, tmp_path_factory):
    import redis

    redis.Redis.from_url(redis_url).flushdb()  # no nodes left over from other tests
    folder = tmp_path_factory.mktemp("fleet")
    nodes = [_cloud(tiny_model_path, redis_url, folder, f"cloud-{c}") for c in "ab"]
    gws = [_gateway(redis_url, folder, f"gw{i}") for i in (1, 2)]
    for p in (*nodes, *gws):
        p.wait_ready()
    for g in gws:  # until each gateway sees both nodes through Redis
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if len(httpx.get(g.url + "/admin/nodes").json()["nodes"]) == 2:
                break
            time.sleep(0.2)
    yield {"nodes": nodes, "gws": gws, "model": tiny_model_path.name}
    for p in (*gws, *nodes):
        p.stop()


def _chat(system: str, user: str, model: str, **kw) -> dict:
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        **kw,
    }


def test_both_gateways_see_the_same_nodes(fleet) -> None:
    views = [
        sorted(n["id"] for n in httpx.get(g.url + "/admin/nodes").json()["nodes"])
        for g in fleet["gws"]
    ]
    assert views[0] == views[1] == ["cloud-a", "cloud-b"]


def test_prefix_holder_wins_from_either_gateway(fleet) -> None:
    gw1, gw2 = fleet["gws"]
    model = fleet["model"]
    for node in fleet["nodes"]:  # both nodes have measured their own rates, as in service
        httpx.post(
            node.url + "/v1/completions",
            timeout=60,
            json={"model": model, "prompt": "warm " * 200, "max_tokens": 8},
        )
    time.sleep(1.2)
    first = httpx.post(
        gw1.url + "/v1/chat/completions",
        timeout=60,
        json=_chat(SYSTEM, "First question?", model, max_tokens=4, temperature=0),
    )
    assert first.status_code == 200
    holder = first.headers["x-edgecloud-node"]
    time.sleep(2.0)  # the node publishes its block events with its next state push (1 s)
    for gw in (gw1, gw2):
        route = httpx.post(
            gw.url + "/v1/route",
            timeout=30,
            json=_chat(SYSTEM, "A different question", model, max_tokens=4, stream=True),
        ).json()
        assert route["reason"] == "latency_ttft"  # streams: by first token, both end alike
        assert route["node"] == holder, json.dumps(route, indent=1)
        assert route["cached_tokens"] >= 256
        other = next(c for c in route["candidates"] if c["node"] != holder)
        assert other["cached_tokens"] == 0
    body = _chat(
        SYSTEM,
        "A different question",
        model,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    with httpx.stream("POST", gw2.url + "/v1/chat/completions", json=body, timeout=60) as second:
        node = second.headers["x-edgecloud-node"]
        events = [json.loads(x[6:]) for x in second.iter_lines() if x.startswith("data: {")]
    assert node == holder
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256, events[-1]


def test_redis_outage_degrades_then_recovers(fleet, redis_server: RedisServer) -> None:
    gw = fleet["gws"][0]
    body = _chat("Be brief.", "Hello", fleet["model"], max_tokens=3, temperature=0)
    assert httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    redis_server.stop()
    try:
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200  # routed from the last view
        assert httpx.get(gw.url + "/health").json()["status"] == "degraded"
    finally:
        redis_server.start()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
        if httpx.get(gw.url + "/health").json()["status"] == "ok":
            break
        time.sleep(0.5)
    assert httpx.get(gw.url + "/health").json()["status"] == "ok"
    deadline = time.monotonic() + 10  # the nodes push their states again by themselves
    while time.monotonic() < deadline:
        if len(httpx.get(gw.url + "/admin/nodes").json()["nodes"]) == 2:
            break
        time.sleep(0.3)
    assert len(httpx.get(gw.url + "/admin/nodes").json()["nodes"]) == 2


def test_node_killed_under_load(fleet) -> None:
    gw = fleet["gws"][1]
    model = fleet["model"]

    async def stream(i: int, client: httpx.AsyncClient) -> tuple[str, list[str]]:
        body = {
            "model": model,
            "prompt": f"Tale {i}:",
            "max_tokens": 1500,
            "temperature": 0,
            "stream": True,
        }
        async with client.stream("POST", gw.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            node = r.headers["x-edgecloud-node"]
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return node, lines

    async def main() -> list[tuple[str, list[str]]]:
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [asyncio.create_task(stream(i, client)) for i in range(6)]
            await asyncio.sleep(1.5)
            fleet["nodes"][0].proc.send_signal(signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)

    # spread the streams over both nodes (the latency policy would batch them on one cloud)
    assert httpx.post(gw.url + "/admin/policy", json={"policy": "round_robin"}).status_code == 200
    try:
        results = asyncio.run(main())
    finally:
        httpx.post(gw.url + "/admin/policy", json={"policy": None})
    fleet["nodes"][0].proc.wait()
    on_victim = [lines for node, lines in results if node == "cloud-a"]
    on_other = [lines for node, lines in results if node == "cloud-b"]
    assert on_victim and on_other, [n for n, _ in results]
    for lines in on_victim:  # broken streams are resumed on the survivor (issue 15.5)
        assert lines[-1] == "data: [DONE]"
        assert all("error" not in json.loads(x[6:]) for x in lines[:-1])
    streams = httpx.get(gw.url + "/health").json()["streams"]
    assert streams["resumed"] == streams["broken"] == len(on_victim), streams
    for lines in on_other:
        assert lines[-1] == "data: [DONE]"
        assert all("error" not in json.loads(x[6:]) for x in lines[:-1])
    # requests not yet started go to the surviving node, even while the dead one's state lingers
    for _ in range(4):
        r = httpx.post(
            gw.url + "/v1/completions",
            timeout=60,
            json={"model": model, "prompt": "After", "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200 and r.headers["x-edgecloud-node"] == "cloud-b"
