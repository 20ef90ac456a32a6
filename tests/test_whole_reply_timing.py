"""A reply sent whole: the node's headers come at the first token, and the gateway reports the
time to first token its client would have seen streamed, not the end-to-end time."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from gateway.front.headers import ttft_of_whole_reply
from gateway.node_headers import HEADERS_AT_FIRST_TOKEN, PREFILL_MS_HEADER, node_wait_ms
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


def test_node_wait_is_its_ttft_less_its_own_prompts_compute():
    h = {"x-edgecloud-measured-ttft-ms": "900.0", PREFILL_MS_HEADER: "150.5"}
    assert node_wait_ms(h) == 749.5
    assert node_wait_ms({"x-edgecloud-measured-ttft-ms": "900.0"}) is None  # a node unsaid
    assert node_wait_ms({**h, PREFILL_MS_HEADER: "nan"}) is None
    assert node_wait_ms({**h, PREFILL_MS_HEADER: "950"}) == 0.0  # never negative


def test_both_nodes_report_their_prompts_compute(tiny_model_path: Path):
    with tiny_fleet(tiny_model_path, "p") as f:
        body = {"model": f["model"], "prompt": "Count: one two three four five six seven",
                "max_tokens": 4, "temperature": 0}  # fmt: skip
        edge = httpx.post(f["served"]["edge"].url + "/v1/completions", json=body, timeout=60)
        cloud = httpx.post(f["served"]["cloud"].url + "/v1/completions", json=body, timeout=60)
        assert edge.status_code == cloud.status_code == 200
        for reply in (edge, cloud):
            prefill = float(reply.headers[PREFILL_MS_HEADER])
            assert 0 < prefill <= float(reply.headers["x-edgecloud-measured-ttft-ms"])
