"""Usage per tenant (issue 49, item 7): prompt, cached and output tokens per key and team, in
``/metrics`` and ``GET /admin/usage`` by time window.

Real parts: the tiny model on the real cloud engine behind the real node app, a real gateway
with three keys (two in team ``red``) and an admin key, the openai SDK as client. Each key's
counts equal the sum of the usages its own replies reported (whole and streamed); the team
sums its keys; a window after the requests is empty. The ledger's buckets and retention are
checked on a fake clock.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from gateway.api_keys import generate_key, hash_key
from gateway.front.app import create_gateway_app
from gateway.front.config import GatewayConfig
from gateway.usage import BUCKET_S, UsageLedger
from tests.nodes import Served, serve_node, tiny_cloud_engine

SALT = "usage-salt-7Qx!c2Lm9Pz-k3Y"
KEYS = {name: generate_key() for name in ("alice", "bob", "carol", "ops")}
TEAMS = {"alice": "red", "bob": "red", "carol": None}


@pytest.fixture(scope="module")
def gw(tiny_model_path: Path, one_torch_thread: None) -> Iterator[dict[str, Any]]:
    node = serve_node(tiny_cloud_engine(tiny_model_path), tiny_model_path, "cloud-usage")
    auth = {
        "salt": SALT,
        "keys": [
            {"name": n, "key_hash": hash_key(KEYS[n], SALT), **({"team": t} if t else {})}
            for n, t in TEAMS.items()
        ],
        "admin_keys": [{"name": "ops", "key_hash": hash_key(KEYS["ops"], SALT)}],
    }
    served = Served(
        create_gateway_app(GatewayConfig(nodes=[node.url], poll_interval_s=0.2, auth=auth))
    )
    admin = {"authorization": f"Bearer {KEYS['ops']}"}
    deadline = time.monotonic() + 30
    while not httpx.get(served.url + "/admin/nodes", headers=admin).json()["nodes"]:
        assert time.monotonic() < deadline, "the gateway never saw its node"
        time.sleep(0.05)
    try:
        yield {"url": served.url, "model": tiny_model_path.name, "admin": admin}
    finally:
        served.stop()
        node.stop()


def _use(url: str, who: str, model: str, stream: bool) -> tuple[int, int, int]:
    """One chat of ``who``; (prompt, cached, output) tokens its reply's usage reported."""
    client = OpenAI(base_url=url + "/v1", api_key=KEYS[who], max_retries=0)
    msgs = [{"role": "user", "content": f"Say something, {who}."}]
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=model, messages=msgs, max_tokens=5, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        usage = chunks[-1].usage
    else:
        usage = client.chat.completions.create(model=model, messages=msgs, max_tokens=3).usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    return usage.prompt_tokens, cached, usage.completion_tokens


def test_usage_per_key_and_team_in_metrics_and_admin_usage(gw: dict[str, Any]) -> None:
    url, model = gw["url"], gw["model"]
    t0 = time.time()
    sent: dict[str, list[int]] = {n: [0, 0, 0, 0] for n in TEAMS}
    for who, stream in (("alice", False), ("alice", True), ("bob", True), ("carol", False)):
        for i, n in enumerate((1, *_use(url, who, model, stream))):
            sent[who][i] += n
    fields = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
    r = httpx.get(url + "/admin/usage", params={"since": t0 - BUCKET_S}, headers=gw["admin"])
    assert r.status_code == 200, r.text
    report = r.json()
    got = {k["key"]: [k[f] for f in fields] for k in report["keys"]}
    assert got == sent
    assert {k["key"]: k["team"] for k in report["keys"]} == TEAMS
    red = [a + b for a, b in zip(sent["alice"], sent["bob"], strict=True)]
    assert report["teams"] == [{"team": "red", **dict(zip(fields, red, strict=True))}]
    assert sent["alice"][3] > 0 and sent["alice"][1] > 0
    # a window after the requests holds none of them; a bad window is a 400
    later = httpx.get(
        url + "/admin/usage", params={"since": time.time() + 2 * BUCKET_S}, headers=gw["admin"]
    )
    assert later.status_code == 400  # since after until (now)
    empty = {"since": t0 + 2 * BUCKET_S, "until": t0 + 3 * BUCKET_S}
    assert httpx.get(url + "/admin/usage", params=empty, headers=gw["admin"]).json()["keys"] == []
    # users may not read it
    user = {"authorization": f"Bearer {KEYS['alice']}"}
    assert httpx.get(url + "/admin/usage", headers=user).status_code == 401
    # /metrics: the same counts, per key, team and kind
    text = httpx.get(url + "/metrics").text
    for who, (reqs, prompt, cached, output) in sent.items():
        team = TEAMS[who] or ""
        series = f'edgecloud_tenant_requests_total{{key="{who}",team="{team}"}}'
        assert _sample(text, series) == reqs
        for kind, n in (("prompt", prompt), ("cached", cached), ("output", output)):
            series = f'edgecloud_tenant_tokens_total{{key="{who}",kind="{kind}",team="{team}"}}'
            assert _sample(text, series) == n


def _sample(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert m, series
    return float(m.group(1))


def test_ledger_windows_and_retention_on_a_fake_clock() -> None:
    now = [10_000.0 * BUCKET_S]
    seen: list[tuple[str, str, int]] = []
    ledger = UsageLedger(
        retention_s=3 * BUCKET_S,
        on_record=lambda k, t, u: seen.append((k, t, u.prompt_tokens)),
        clock=lambda: now[0],
    )
    ledger.record("a", "red", 10, 4, 2)
    now[0] += BUCKET_S
    ledger.record("a", "red", 20, 99, 3)  # cached is capped at the prompt
    ledger.record("b", None, 5, 0, 1)
    start = 10_000.0 * BUCKET_S
    first = ledger.window(start, start + BUCKET_S)["keys"]
    assert first == [{"key": "a", "team": "red", "requests": 1, "prompt_tokens": 10,
                      "cached_tokens": 4, "completion_tokens": 2}]  # fmt: skip
    both = ledger.window(start, start + 2 * BUCKET_S)
    assert [k["prompt_tokens"] for k in both["keys"]] == [30, 5]
    assert both["keys"][0]["cached_tokens"] == 24 and both["teams"][0]["requests"] == 2
    now[0] += 5 * BUCKET_S
    ledger.record("b", None, 1, 0, 0)  # a new bucket drops those past the retention
    assert [k["prompt_tokens"] for k in ledger.window(0, now[0] + BUCKET_S)["keys"]] == [1]
    assert seen == [("a", "red", 10), ("a", "red", 20), ("b", "", 5), ("b", "", 1)]
