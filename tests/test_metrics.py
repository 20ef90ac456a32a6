"""Gateway metrics: own registry per gateway, the expected series and values in the exposition."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import LATENCY_BUCKETS, GatewayMetrics, metrics_response


def samples(m: GatewayMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.text()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: GatewayMetrics, name: str, **labels: str) -> float | None:
    return samples(m).get((name, frozenset(labels.items())))


def test_series_and_values_after_observations() -> None:
    m = GatewayMetrics()
    for status in (200, 200, 429):
        m.observe_request("/v1/chat/completions", status, "edge", "edge-eu-1")
    m.observe_request("/v1/models", 401, None, None)
    m.observe_ttft("edge", "edge-eu-1", 0.08, predicted_s=0.05)
    m.observe_ttft("edge", "edge-eu-1", 0.4, predicted_s=0.6)
    m.observe_ttft("cloud", "cloud-1", 2.0)
    m.observe_e2e("edge", "edge-eu-1", 1.2)
    m.observe_e2e("edge", "edge-eu-1", 61.0)  # beyond the last bucket: only +Inf
    for _ in range(4):
        m.observe_decision("latency", "least_e2e")
    m.observe_decision("latency", "prefix_hit")
    m.redis_error("fleet")
    m.redis_error("fleet")
    m.redis_error("ratelimit")
    m.set_redis_up("fleet", False)
    m.observe_rate_limited("tokens")

    p = "edgecloud_"
    chat = {"route": "/v1/chat/completions", "tier": "edge", "node": "edge-eu-1"}
    assert value(m, p + "requests_total", status="200", **chat) == 2
    assert value(m, p + "requests_total", status="429", **chat) == 1
    assert (
        value(m, p + "requests_total", route="/v1/models", status="401", tier="none", node="none")
        == 1
    )
    edge = {"tier": "edge", "node": "edge-eu-1"}
    assert value(m, p + "ttft_seconds_count", **edge) == 2
    assert value(m, p + "ttft_seconds_sum", **edge) == pytest.approx(0.48)
    assert value(m, p + "ttft_seconds_bucket", le="0.1", **edge) == 1
    assert value(m, p + "ttft_seconds_bucket", le="0.5", **edge) == 2
    assert value(m, p + "ttft_seconds_bucket", le="0.075", **edge) == 0
    assert value(m, p + "ttft_seconds_count", tier="cloud", node="cloud-1") == 1
    assert value(m, p + "e2e_seconds_bucket", le="60.0", **edge) == 1
    assert value(m, p + "e2e_seconds_bucket", le="+Inf", **edge) == 2
    # 30 ms late (the model was optimistic) and 200 ms early; no prediction, no observation.
    late, early = {"tier": "edge", "direction": "late"}, {"tier": "edge", "direction": "early"}
    assert value(m, p + "ttft_error_seconds_count", **late) == 1
    assert value(m, p + "ttft_error_seconds_sum", **late) == pytest.approx(0.03)
    assert value(m, p + "ttft_error_seconds_bucket", le="0.025", **late) == 0
    assert value(m, p + "ttft_error_seconds_bucket", le="0.05", **late) == 1
    assert value(m, p + "ttft_error_seconds_sum", **early) == pytest.approx(0.2)
    assert value(m, p + "ttft_error_seconds_bucket", le="0.1", **early) == 0
    assert value(m, p + "ttft_error_seconds_bucket", le="0.25", **early) == 1
    assert value(m, p + "ttft_error_seconds_count", tier="cloud", direction="late") is None
    assert value(m, p + "decisions_total", policy="latency", reason="least_e2e") == 4
    assert value(m, p + "decisions_total", policy="latency", reason="prefix_hit") == 1
    assert value(m, p + "redis_errors_total", component="fleet") == 2
    assert value(m, p + "redis_errors_total", component="ratelimit") == 1
    assert value(m, p + "redis_up", component="fleet") == 0
    assert value(m, p + "rate_limited_total", limit="tokens") == 1
    assert value(m, p + "in_flight_requests") == 0


def test_latency_buckets_span_10ms_to_60s() -> None:
    assert LATENCY_BUCKETS[0] == 0.01 and LATENCY_BUCKETS[-1] == 60.0
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)


def test_in_flight_gauge() -> None:
    m = GatewayMetrics()
    with m.track_in_flight():
        with m.track_in_flight():
            assert value(m, "edgecloud_in_flight_requests") == 2
        assert value(m, "edgecloud_in_flight_requests") == 1
    with pytest.raises(RuntimeError), m.track_in_flight():
        raise RuntimeError("upstream broke")
    assert value(m, "edgecloud_in_flight_requests") == 0


def test_registries_are_independent() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    a.observe_request("/v1/completions", 200, "cloud", "c1")
    labels = {"route": "/v1/completions", "status": "200", "tier": "cloud", "node": "c1"}
    assert value(a, "edgecloud_requests_total", **labels) == 1
    assert value(b, "edgecloud_requests_total", **labels) is None
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("edgecloud_requests_total", labels) is None


async def test_metrics_route() -> None:
    m = GatewayMetrics()
    m.observe_decision("threshold", "short_prompt")
    app = FastAPI()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return metrics_response(m, request)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        resp = await client.get("/metrics")
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert (
            'edgecloud_decisions_total{policy="threshold",reason="short_prompt"} 1.0' in resp.text
        )
        om = await client.get(
            "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.rstrip().endswith("# EOF")
