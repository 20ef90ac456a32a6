"""An authenticated fleet: node records in Redis are signed with the node token, and a forged
registration (a real node's record copied under a new id with another URL, unsigned or signed
with another key) is ignored and logged, while the real node keeps all the traffic.

Real parts: a private redis-server, the tiny model on the real cloud engine behind the real
node app publishing to Redis, and a real gateway reading the fleet from that Redis.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import pytest
import redis

from gateway.front.app import create_gateway_app
from gateway.front.config import GatewayConfig
from routing.fleet.redis_store import RedisFleetStore
from routing.fleet.redis_view import FleetKeys
from routing.fleet.signing import RecordSigner
from routing.fleet.store import KEY_PREFIX
from tests.nodes import Served, serve_node, tiny_cloud_engine

TOKEN = "node-token-Jx8!fleet-signing-test-4d1"


def test_forged_registration_is_ignored_and_logged(
    tiny_model_path: Path, redis_url: str, one_torch_thread: None, caplog: pytest.LogCaptureFixture
) -> None:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    r.flushdb()
    store = RedisFleetStore(redis_url, signer=RecordSigner(TOKEN))
    node = serve_node(
        tiny_cloud_engine(tiny_model_path), tiny_model_path, "cloud-real", store=store,
        node_token=TOKEN,
    )  # fmt: skip
    keys = FleetKeys(KEY_PREFIX)
    gw = None
    try:
        raw = None
        deadline = time.monotonic() + 30
        while raw is None:
            assert time.monotonic() < deadline, "the node never registered"
            raw = r.get(keys.node("cloud-real"))
            time.sleep(0.05)
        assert raw.startswith("ecsig1:")  # the node signs what it publishes
        state = json.loads(raw.partition(":")[2].partition(":")[2])
        gw = Served(create_gateway_app(GatewayConfig(redis_url=redis_url, node_token=TOKEN)))
        caplog.set_level(logging.WARNING, logger="routing.fleet.redis_store")

        def forge(node_id: str, record: str) -> None:  # rewritten as the node's own is
            r.set(keys.node(node_id), record, px=60_000)
            r.set(keys.legacy_node(node_id), record, px=60_000)
            r.zadd(keys.nodes, {node_id: time.time()})

        for _ in range(3):  # the rogue keeps re-registering, with a fresh time
            rogue = {
                **state,
                "id": "rogue-1",
                "url": "http://127.0.0.1:9",
                "timestamp": time.time(),
            }
            forge("rogue-1", json.dumps(rogue))
            forge("rogue-2", RecordSigner("not-the-fleet-token-xx").sign(json.dumps(rogue)))
            listed = httpx.get(gw.url + "/admin/nodes").json()["nodes"]
            assert [n["id"] for n in listed] == ["cloud-real"]
        body = {"model": tiny_model_path.name, "prompt": "hi", "max_tokens": 1}
        answered = [
            httpx.post(gw.url + "/v1/completions", json=body, timeout=60).headers[
                "x-edgecloud-node"
            ]
            for _ in range(10)
        ]
        assert answered == ["cloud-real"] * 10
        logged = [m for m in caplog.messages if "ignoring a node record" in m]
        assert len(logged) >= 2 and "unsigned" in logged[0]
        health = httpx.get(gw.url + "/health").json()
        assert health["store"]["rejected_records_total"] >= 2
    finally:
        if gw is not None:
            gw.stop()
        node.stop()


def test_unsafe_redis_urls_are_warned_of() -> None:
    loopback = GatewayConfig(redis_url="redis://127.0.0.1:6379/0")
    assert loopback.redis_warnings() == []
    remote = GatewayConfig(redis_url="redis://redis.internal:6379/0")
    warned = " ".join(remote.redis_warnings())
    assert "no password" in warned and "not TLS" in warned and "node_token" in warned
    safe = GatewayConfig(redis_url="rediss://:pw@redis.internal:6380/0", node_token=TOKEN)
    assert safe.redis_warnings() == []
