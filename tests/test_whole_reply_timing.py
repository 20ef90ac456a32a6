"""A reply sent whole: the node's headers come at the first token, and the gateway reports the
time to first token its client would have seen streamed, not the end-to-end time."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from gateway.front.headers import ttft_of_whole_reply
from gateway.node_headers import HEADERS_AT_FIRST_TOKEN
from tests.nodes import tiny_fleet


def test_ttft_of_a_whole_reply_from_new_and_old_nodes():
    # a node that sends its headers at the first token: the time they arrived here
    new = {HEADERS_AT_FIRST_TOKEN: "1", "x-edgecloud-measured-ttft-ms": "40.0"}
    assert ttft_of_whole_reply(new, 900.0, headers_ms=55.0) == 55.0
    # an older node: our end-to-end time less its first-to-last-token time
    old = {"x-edgecloud-measured-ttft-ms": "40.0", "x-edgecloud-node-e2e-ms": "840.0"}
    assert ttft_of_whole_reply(old, 900.0, headers_ms=890.0) == 100.0
    assert ttft_of_whole_reply({}, 900.0, headers_ms=890.0) is None  # no figures, no guess


def test_gateway_whole_reply_reports_ttft_below_e2e(tiny_model_path: Path):
    with tiny_fleet(tiny_model_path, "w") as f:
        gw = f["served"]["gw"].url
        body = {"model": f["model"], "prompt": "Go on forever:", "max_tokens": 200,
                "temperature": 0}  # fmt: skip
        r = httpx.post(gw + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200
        tokens = r.json()["usage"]["completion_tokens"]
        ttft = float(r.headers["x-edgecloud-measured-ttft-ms"])
        e2e = float(r.headers["x-edgecloud-measured-e2e-ms"])
        assert tokens > 50 and 0 < ttft < e2e
        assert HEADERS_AT_FIRST_TOKEN not in r.headers  # between the node and the gateway only

        # While a long one runs, the gateway's ledger already knows its prompt is done (as a
        # stream's first chunk would tell it), so the next decision replays only its decode.
        ledger = f["gateway"].router.ledger
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(
                httpx.post, gw + "/v1/completions", json={**body, "max_tokens": 1500}, timeout=120
            )
            deadline = time.monotonic() + 60
            seen = False
            while not seen and not fut.done() and time.monotonic() < deadline:
                seen = any(e.first_token_at is not None for e in list(ledger._entries.values()))
                time.sleep(0.01)
            assert seen, "the whole reply's first token never reached the ledger"
            assert fut.result().status_code == 200
