"""Prefix caches isolated by tenant: the prefix oracle across two keys shows nothing.

Real parts: the tiny model on the real cloud engine and the real edge engine, each behind the
real node app, a real gateway with two API keys in front of each (in-process store), and the
official openai SDK as the client. Alice sends a long system prompt; Bob guesses it exactly.
Bob is credited with 0 tokens by ``/v1/route``, reads 0 in ``x-edgecloud-cached-tokens`` and
in the usage, on both engines; Alice's own repeat hits. ``decision_headers`` narrows what a
caller sees of the decision.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from gateway.auth import generate_key, hash_key
from gateway.cache_scope import CacheScopes
from gateway.front.app import create_gateway_app
from gateway.front.config import GatewayConfig
from routing.blocks import block_hashes, model_seed, scope_seed
from tests.nodes import Served, serve_node, tiny_cloud_engine, tiny_edge_engine

SALT = "k3Y-salt-for-tenant-tests-9f2e1c"
SYSTEM = " ".join(f"Secret rule {i}: the vault code is {i * 7919 % 10007}." for i in range(30))
KEYS = {name: generate_key() for name in ("alice", "bob", "ops")}


def _gateway(node_url: str, **config: Any) -> Served:
    auth = {
        "salt": SALT,
        "keys": [{"name": n, "key_hash": hash_key(KEYS[n], SALT)} for n in ("alice", "bob")],
        "admin_keys": [{"name": "ops", "key_hash": hash_key(KEYS["ops"], SALT)}],
    }
    cfg = GatewayConfig(nodes=[node_url], poll_interval_s=0.2, auth=auth, **config)
    gw = Served(create_gateway_app(cfg))
    admin = {"authorization": f"Bearer {KEYS['ops']}"}
    deadline = time.monotonic() + 30
    while not httpx.get(gw.url + "/admin/nodes", headers=admin).json()["nodes"]:
        assert time.monotonic() < deadline, "the gateway never saw its node"
        time.sleep(0.05)
    return gw


@pytest.fixture(scope="module", params=["cloud", "edge"])
def tier(
    request: pytest.FixtureRequest, tiny_model_path: Path, edge_home: None, one_torch_thread: None
) -> Iterator[dict[str, Any]]:
    make = tiny_cloud_engine if request.param == "cloud" else tiny_edge_engine
    node = serve_node(make(tiny_model_path), tiny_model_path, f"{request.param}-tc")
    gws: list[Served] = []
    try:
        gws.append(_gateway(node.url))
        yield {"gw": gws[0].url, "model": tiny_model_path.name, "node": node.url}
    finally:
        for s in (*gws, node):
            s.stop()


def _client(url: str, who: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=KEYS[who], max_retries=0)


def _ask(url: str, who: str, model: str, question: str) -> tuple[int, int, int]:
    """(header cached tokens, header credited tokens, usage cached tokens) of one chat."""
    raw = _client(url, who).chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
    )
    usage = raw.parse().usage
    details = usage.prompt_tokens_details if usage else None
    return (
        int(raw.headers["x-edgecloud-cached-tokens"]),
        int(raw.headers["x-edgecloud-credited-tokens"]),
        (details.cached_tokens or 0) if details else 0,
    )


def _route(url: str, who: str, model: str, question: str) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }
    headers = {"authorization": f"Bearer {KEYS[who]}"}
    resp = httpx.post(url + "/v1/route", json=body, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _until_credited(url: str, who: str, model: str, question: str) -> int:
    """The tokens ``/v1/route`` credits ``who`` with, once the index has them (bounded)."""
    deadline = time.monotonic() + 15
    while True:
        cached = _route(url, who, model, question)["cached_tokens"]
        if cached > 0 or time.monotonic() > deadline:
            return cached
        time.sleep(0.1)


def test_prefix_oracle_across_two_keys_shows_nothing(tier: dict[str, Any]) -> None:
    url, model = tier["gw"], tier["model"]
    assert _ask(url, "alice", model, "What is rule 3?")[0] == 0  # cold
    own = _until_credited(url, "alice", model, "What is rule 3?")
    assert own >= 256, "alice's own prefix is in the index"
    # Bob guesses alice's prompt exactly: nothing is credited, reused or reported to him
    assert _route(url, "bob", model, "What is rule 3?")["cached_tokens"] == 0
    assert _ask(url, "bob", model, "What is rule 3?") == (0, 0, 0)
    # ...while alice's own repeat still hits, in the index and in the engine
    cached, credited, usage_cached = _ask(url, "alice", model, "What is rule 3?")
    assert credited >= 256 and cached >= 256 and usage_cached == cached


def test_scope_salts() -> None:
    """key scope: a salt per key; team scope: one per team; global and anonymous: none."""
    from gateway.auth import KeyIdentity

    a, b = KeyIdentity("a", team="t"), KeyIdentity("b", team="t")
    key, team = CacheScopes("key", SALT), CacheScopes("team", SALT)
    assert key.salt(a) != key.salt(b) and len(key.salt(a)) == 32
    assert team.salt(a) == team.salt(b) != key.salt(a)
    assert CacheScopes("global", SALT).salt(a) == ""
    assert key.salt(KeyIdentity("anonymous", source="anonymous")) == ""
    assert CacheScopes("key", "another-deployment-secret").salt(a) != key.salt(a)
    seed = model_seed("m")
    ids = list(range(40))
    assert scope_seed(seed, "") == seed  # one scope: the hashes as before
    assert not set(block_hashes(ids, scope_seed(seed, "x"))) & set(block_hashes(ids, seed))


def test_decision_headers_minimal_and_off(tiny_model_path: Path, one_torch_thread: None) -> None:
    node = serve_node(tiny_cloud_engine(tiny_model_path), tiny_model_path, "cloud-dh")
    gws: list[Served] = []
    try:
        gws = [_gateway(node.url, decision_headers=lvl) for lvl in ("minimal", "off")]
        model = tiny_model_path.name
        seen = []
        for gw in gws:
            raw = _client(gw.url, "bob").chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            seen.append(sorted(k for k in raw.headers if k.startswith("x-edgecloud-")))
        assert seen[0] == ["x-edgecloud-attempts", "x-edgecloud-tier"]
        assert seen[1] == []
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        bob = {"authorization": f"Bearer {KEYS['bob']}"}
        ops = {"authorization": f"Bearer {KEYS['ops']}"}
        minimal = httpx.post(gws[0].url + "/v1/route", json=body, headers=bob, timeout=30)
        assert sorted(minimal.json()) == ["client_region", "tier"]
        off = httpx.post(gws[1].url + "/v1/route", json=body, headers=bob, timeout=30)
        assert off.status_code == 403 and off.json()["error"]["code"] == "decision_hidden"
        admin = httpx.post(gws[1].url + "/v1/route", json=body, headers=ops, timeout=30)
        assert admin.status_code == 200 and "candidates" in admin.json()
    finally:
        for s in (*gws, node):
            s.stop()
