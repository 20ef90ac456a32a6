"""Edge or cloud by the latency model, on the default model with real rates.

An edge node (ONNX Runtime, in the client's region) and a cloud node (torch, far away) serve
the default model and push their state and the cloud's prefix-block events to the test Redis;
a gateway reads that fleet. Nothing here forces a tier: both nodes can hold every prompt used,
and the decisions come from predicted latency with each node's own measured rates. On one CPU
neither node prefills much faster than the other (in production the cloud's GPU does), so here
the cloud wins a long prompt by holding its prefix (a shared document another client sent
before): its predicted time to first token is then the round trip plus a few uncached tokens,
while the edge would prefill the whole document.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.conftest import free_port
from tests.nodes import Proc, cli

# About 900 tokens of a shared document.
DOC = " ".join(
    f"Clause {i}: the tenant keeps unit {i} clean and pays on day {i % 28 + 1}." for i in range(40)
)
OTHER_DOC = " ".join(
    f"Item {i}: ship crate {i} to dock {i % 9} before week {i % 52}." for i in range(44)
)


def _node(kind: str, model: Path, redis_url: str, folder: Path, node_id: str, region: str) -> Proc:
    port = free_port()
    extra = ["--variant", "fp32"] if kind == "edge" else ["--device", "cpu"]
    args = [kind, "serve", "--model", str(model), "--port", str(port), "--region", region]
    args += ["--node-id", node_id, "--threads", "1", "--redis", redis_url, *extra]
    return Proc(cli(*args), port, folder / f"{node_id}.log")


@pytest.fixture(scope="module")
def fleet(default_model_path: Path, redis_url: str, tmp_path_factory):
    import redis

    redis.Redis.from_url(redis_url).flushdb()  # no nodes left over from other tests
    folder = tmp_path_factory.mktemp("latency-routing")
    edge = _node("edge", default_model_path, redis_url, folder, "edge-eu", "eu-west")
    cloud = _node("cloud", default_model_path, redis_url, folder, "cloud-us", "us-east")
    policy = folder / "policy.yaml"
    policy.write_text(
        yaml.safe_dump(
            {
                "default_region": "eu-west",
                "gateway_region": "eu-west",
            }
        )
    )
    cfg = folder / "gateway.yaml"
    model = default_model_path.name
    cfg.write_text(
        yaml.safe_dump(
            {"redis_url": redis_url, "policy_file": str(policy), "virtual_models": {"auto": model}}
        )
    )
    gp = free_port()
    gw = Proc(cli("gateway", "--config", str(cfg), "--port", str(gp)), gp, folder / "gw.log")
    for p in (edge, cloud, gw):
        p.wait_ready(timeout=600)  # the first run exports the edge graph
    deadline = time.monotonic() + 15
    while len(httpx.get(gw.url + "/admin/nodes").json()["nodes"]) < 2:
        assert time.monotonic() < deadline, "the gateway never saw both nodes"
        time.sleep(0.2)
    for node in (edge, cloud):  # each node measures its own prefill and decode rates
        r = httpx.post(
            node.url + "/v1/completions",
            timeout=120,
            json={"model": model, "prompt": "warm " * 300, "max_tokens": 8, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
    time.sleep(1.5)  # the next state push carries the rates
    yield {"edge": edge, "cloud": cloud, "gw": gw, "model": model}
    for p in (gw, edge, cloud):
        p.stop()


def _chat(system: str, user: str, model: str = "auto", **kw) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, **kw}


def _route(fleet, body: dict) -> dict:
    r = httpx.post(fleet["gw"].url + "/v1/route", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_short_prompt_goes_to_the_edge(fleet) -> None:
    sdk = openai.OpenAI(base_url=fleet["gw"].url + "/v1", api_key="unused", max_retries=0)
    raw = sdk.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4, temperature=0
    )
    h = raw.headers
    assert (h["x-edgecloud-tier"], h["x-edgecloud-node"]) == ("edge", "edge-eu")
    assert h["x-edgecloud-reason"] == "latency_e2e"
    assert raw.parse().choices[0].message.content
    # what the reply took beyond the edge's engine (the gateway's share, the node's admission)
    # is learned from its headers and predicted for the next one
    deadline = time.monotonic() + 5
    while True:  # the gateway learns once the reply is accounted, just after it is sent
        cands = {c["node"]: c for c in _route(fleet, _chat("Be brief.", "Hi!"))["candidates"]}
        if cands["edge-eu"]["overhead_ms"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert 0 < cands["edge-eu"]["overhead_ms"] < cands["edge-eu"]["predicted_ttft_ms"]


def test_long_prompt_goes_to_the_cloud_that_holds_its_prefix(fleet) -> None:
    model = fleet["model"]
    before = _route(fleet, _chat(DOC, "When does unit 7 pay?"))
    assert before["prompt_tokens"] > 600
    cold = {c["node"]: c for c in before["candidates"]}
    assert cold["cloud-us"]["cached_tokens"] == 0
    # another client of the cloud node sent the document before
    warm = httpx.post(
        fleet["cloud"].url + "/v1/chat/completions",
        json=_chat(DOC, "Summarize.", model, max_tokens=1),
        timeout=120,
    )
    assert warm.status_code == 200, warm.text
    deadline = time.monotonic() + 10  # block events land with the node's next state push
    while True:
        route = _route(fleet, _chat(DOC, "When does unit 7 pay?"))
        cands = {c["node"]: c for c in route["candidates"]}
        if cands["cloud-us"]["cached_tokens"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert route["prompt_tokens"] > 600
    assert route["node"] == "cloud-us", json.dumps(route, indent=1)
    assert route["reason"] == "latency_e2e"
    assert cands["cloud-us"]["cached_tokens"] >= route["prompt_tokens"] - 64
    assert cands["cloud-us"]["rtt_ms"] > cands["edge-eu"]["rtt_ms"]  # despite the far region
    assert cands["cloud-us"]["predicted_ttft_ms"] < cands["edge-eu"]["predicted_ttft_ms"]
    # what changed is the cloud's prefill: a few uncached tokens instead of the document
    assert cands["cloud-us"]["prefill_ms"] < 0.2 * cold["cloud-us"]["prefill_ms"]

    r = httpx.post(
        fleet["gw"].url + "/v1/chat/completions",
        json=_chat(DOC, "When does unit 7 pay?"),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert (r.headers["x-edgecloud-tier"], r.headers["x-edgecloud-node"]) == ("cloud", "cloud-us")
    assert int(r.headers["x-edgecloud-cached-tokens"]) >= route["prompt_tokens"] - 64
    # the node's compute of the prompt, passed on, fits inside its time to first token
    node_prefill = float(r.headers["x-edgecloud-prefill-ms"])
    node_ttft = float(r.headers["x-edgecloud-node-ttft-ms"])
    assert 0 < node_prefill <= node_ttft <= float(r.headers["x-edgecloud-measured-ttft-ms"])
    assert float(r.headers["x-edgecloud-predicted-prefill-ms"]) > 0
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 64
