"""The front gateway end to end: the official openai SDK -> gateway -> live edge and cloud
nodes on loopback (tiny random model, real engines), with decision headers read back."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.conftest import free_port
from tests.nodes import Proc, cli


@pytest.fixture(scope="module")
def fleet(tiny_model_path: Path, tiny_home: dict[str, str], tmp_path_factory):
    logs = tmp_path_factory.mktemp("e2e")
    ep, cp, gp = free_port(), free_port(), free_port()
    common = ["--model", str(tiny_model_path), "--threads", "1"]
    # the edge box sits in the client's region with a small context; the cloud is far away
    edge = Proc(
        cli(
            "edge",
            "serve",
            *common,
            "--port",
            str(ep),
            "--region",
            "eu-west",
            "--node-id",
            "edge-eu",
            "--variant",
            "fp32",
            "--context",
            "1024",
        ),
        ep,
        logs / "edge.log",
        env=tiny_home,
    )
    cloud = Proc(
        cli(
            "cloud",
            "serve",
            *common,
            "--port",
            str(cp),
            "--region",
            "us-east",
            "--node-id",
            "cloud-us",
            "--device",
            "cpu",
        ),
        cp,
        logs / "cloud.log",
    )
    edge.wait_ready()
    cloud.wait_ready()
    policy = logs / "policy.yaml"
    policy.write_text(yaml.safe_dump({"default_region": "eu-west", "gateway_region": "eu-west"}))
    cfg = logs / "gateway.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "nodes": [edge.url, cloud.url],
                "policy_file": str(policy),
                "virtual_models": {"auto": tiny_model_path.name},
                "poll_interval_s": 1.0,
                "max_body_bytes": 1_000_000,
            }
        )
    )
    gw = Proc(cli("gateway", "--config", str(cfg), "--port", str(gp)), gp, logs / "gw.log")
    gw.wait_ready(path="/health")
    deadline = time.monotonic() + 20  # until the in-process store has polled both nodes
    while len(httpx.get(gw.url + "/v1/models").json()["data"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    yield {"edge": edge, "cloud": cloud, "gw": gw, "model": tiny_model_path.name}
    for p in (gw, edge, cloud):
        p.stop()


@pytest.fixture(scope="module")
def sdk(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet["gw"].url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_auto_and_the_model(fleet) -> None:
    ids = [m["id"] for m in httpx.get(fleet["gw"].url + "/v1/models").json()["data"]]
    assert ids == ["auto", fleet["model"]]


def test_short_prompt_goes_to_the_edge_by_the_latency_model(fleet, sdk) -> None:
    raw = sdk.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0
    )
    h = raw.headers
    assert h["x-edgecloud-tier"] == "edge" and h["x-edgecloud-node"] == "edge-eu"
    assert h["x-edgecloud-reason"].startswith("latency")
    assert float(h["x-edgecloud-predicted-ttft-ms"]) > 0
    route = httpx.post(
        fleet["gw"].url + "/v1/route",
        json={"model": "auto", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8},
    ).json()
    cands = {c["node"]: c for c in route["candidates"]}
    assert route["node"] == "edge-eu"
    assert cands["edge-eu"]["predicted_e2e_ms"] < cands["cloud-us"]["predicted_e2e_ms"]
    assert cands["cloud-us"]["rtt_ms"] > cands["edge-eu"]["rtt_ms"]  # the far region costs RTT
    completion = raw.parse()
    assert completion.usage.completion_tokens <= 8 and completion.choices[0].message.content


def test_prompt_over_the_edge_context_goes_to_the_cloud(fleet, sdk) -> None:
    long = "word " * 1300  # more than the edge box's 1024-token context
    raw = sdk.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": long}], max_tokens=4, temperature=0
    )
    assert raw.headers["x-edgecloud-tier"] == "cloud"
    assert raw.parse().usage.prompt_tokens > 1024


def test_stream_through_the_gateway_equals_direct(fleet, sdk) -> None:
    msgs = [{"role": "user", "content": "Count with me"}]
    direct = openai.OpenAI(base_url=fleet["edge"].url + "/v1", api_key="x", max_retries=0)
    ref = direct.chat.completions.create(
        model=fleet["model"], messages=msgs, max_tokens=10, temperature=0
    )
    chunks = list(
        sdk.chat.completions.create(
            model="auto", messages=msgs, max_tokens=10, temperature=0, stream=True
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == ref.choices[0].message.content
    )
    assert all(c.usage is None for c in chunks)  # usage was not asked for: not forwarded
    with_usage = list(
        sdk.chat.completions.create(
            model="auto",
            messages=msgs,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert with_usage[-1].usage.completion_tokens == ref.usage.completion_tokens


def test_completions_through_the_gateway(fleet, sdk) -> None:
    r = sdk.completions.create(
        model=fleet["model"], prompt="Once upon", max_tokens=5, temperature=0
    )
    assert r.usage.completion_tokens == 5


@pytest.mark.parametrize(
    "body,status",
    [
        (b"{bad json", 400),
        (b'{"model": "auto"}', 400),
        (
            b'{"model": "auto", "messages": [{"role": "user", "content": "x"}], "max_tokens": "3"}',
            400,
        ),
        (
            b'{"model": "auto", "messages": [{"role": "user", "content": "x"}], "temperature": -1}',
            400,
        ),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404),
        (b"[1, 2, 3]", 400),
        (
            b'{"model": "auto", "messages": [{"role": "user", "content": "'
            + b"x" * 1_200_000
            + b'"}]}',
            413,
        ),
    ],
)
def test_bad_input_is_4xx(fleet, body, status) -> None:
    r = httpx.post(
        fleet["gw"].url + "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_prompt_over_every_context_is_400(fleet) -> None:
    r = httpx.post(
        fleet["gw"].url + "/v1/chat/completions",
        timeout=30,
        json={"model": "auto", "messages": [{"role": "user", "content": "word " * 2500}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_metrics_and_health(fleet, sdk) -> None:
    sdk.chat.completions.create(
        model="auto", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    text = httpx.get(fleet["gw"].url + "/metrics").text
    assert "edgecloud_requests_total{" in text and 'tier="edge"' in text
    health = httpx.get(fleet["gw"].url + "/health").json()
    assert health["status"] == "ok"


def test_failover_when_the_edge_dies(fleet, sdk) -> None:
    fleet["edge"].kill()
    raw = sdk.chat.completions.with_raw_response.create(
        model="auto",
        messages=[{"role": "user", "content": "Hi again"}],
        max_tokens=4,
        temperature=0,
    )
    assert raw.headers["x-edgecloud-tier"] == "cloud"  # retried on the next candidate, no error
    assert raw.parse().choices[0].message.content is not None
