"""The starvation attack (issue 49, item 1) on a real gateway over a Redis fleet and a real
node: a key opens many long streams; another key's short request is admitted before any of
the attacker's queued requests, and the attacker never holds more than the fleet's slots
(its share while nobody else waits; its fair share while the victim does). Assertions on
order and counts only; the attack is bounded by the streams' ``max_tokens``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import redis

from gateway.api_keys import generate_key, hash_key
from gateway.front.app import create_gateway_app
from gateway.front.config import GatewayConfig
from routing.fleet.redis_store import RedisFleetStore
from tests.nodes import Served, serve_node, tiny_cloud_engine

SALT = "fair-salt-4Rt!q8Lz2Wm-h7V"
KEYS = {"attacker": generate_key(), "victim": generate_key()}
SLOTS = 2
STREAMS = 6


def test_victim_admitted_before_the_attackers_queued_streams(
    tiny_model_path: Path, redis_url: str, one_torch_thread: None
) -> None:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    r.flushdb()
    node = serve_node(
        tiny_cloud_engine(tiny_model_path), tiny_model_path, "cloud-fair",
        store=RedisFleetStore(redis_url),
    )  # fmt: skip
    auth = {
        "salt": SALT,
        "keys": [{"name": n, "key_hash": hash_key(k, SALT)} for n, k in KEYS.items()],
    }
    cfg = GatewayConfig(
        redis_url=redis_url, auth=auth, fair_share={"fleet_slots": SLOTS, "poll_s": 0.02}
    )
    gw = Served(create_gateway_app(cfg))
    events: list[tuple[str, int]] = []  # (who, index) in the order their replies started
    lock = threading.Lock()
    held_seen: list[int] = []

    def chat(who: str, i: int, max_tokens: int) -> None:
        body = {
            "model": tiny_model_path.name,
            "messages": [{"role": "user", "content": f"Tell a long story {i}."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {KEYS[who]}"}
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=120
        ) as resp:
            assert resp.status_code == 200, resp.read()
            with lock:
                events.append((who, i))
            for _ in resp.iter_bytes():
                pass

    def held() -> dict[str, int]:
        out: dict[str, int] = {}
        for f, n in r.hgetall("edgecloud:v1:{fair}:held").items():
            key = f.split("|", 1)[1]
            out[key] = out.get(key, 0) + int(n)
        return out

    try:
        deadline = time.monotonic() + 60
        while not r.keys("edgecloud:v1:node:*"):
            assert time.monotonic() < deadline, "the node never registered"
            time.sleep(0.05)
        # every stream has its own length (the two that take the slots, whichever they are, end
        # 60+ steps apart): one release frees one slot, so the victim's admission and the next
        # attacker's are never the same instant (their first bytes could arrive in either order)
        threads = [
            threading.Thread(target=chat, args=("attacker", i, 100 + 60 * i))
            for i in range(STREAMS)
        ]
        for t in threads:
            t.start()
            time.sleep(0.02)
        waiting = 0
        deadline = time.monotonic() + 60
        while waiting < STREAMS - SLOTS:  # the attacker fills the slots; the rest wait
            assert time.monotonic() < deadline, "the attacker's streams never queued"
            fair = httpx.get(gw.url + "/health").json()["fair_share"]
            waiting = fair["waiting_here"]  # one mark in Redis per key's head; the rest here
            held_seen.append(sum(held().values()))
            time.sleep(0.01)
        victim = threading.Thread(target=chat, args=("victim", 0, 4))
        victim.start()
        while True:  # the victim waits for a slot (or got one): from now on it goes first
            marked = any(f.endswith("|victim") for f in r.hgetall("edgecloud:v1:{fair}:wait"))
            with lock:
                started_before = len([e for e in events if e[0] == "attacker"])
                if marked or any(e[0] == "victim" for e in events):
                    break
            time.sleep(0.002)
        # an attacker admitted just before the mark may not have its reply headers yet: count
        # the gateway's admissions after the mark (an upper bound on those before it)
        admitted = httpx.get(gw.url + "/health").json()["fair_share"]["admitted_total"]
        started_before = max(started_before, admitted)
        while victim.is_alive() or any(t.is_alive() for t in threads):
            held_seen.append(sum(held().values()))
            time.sleep(0.01)
            assert time.monotonic() < deadline + 120, "the attack was not bounded in time"
        victim.join()
        for t in threads:
            t.join()
        order = [who for who, _ in events]
        assert order.count("attacker") == STREAMS and order.count("victim") == 1
        # nothing of the attacker's queued requests started before the victim's
        assert order.index("victim") <= started_before
        assert max(held_seen) <= SLOTS
        assert held() == {}  # every slot given back, fleet-wide
    finally:
        gw.stop()
        node.stop()
        r.close()
