"""The gateway's Prometheus metrics, in a registry of their own.

Invariants:
- Each :class:`GatewayMetrics` owns its ``CollectorRegistry``; nothing is registered in the
  global default registry, so a process (a test) can hold several gateways.
- Label values are bounded: routes are the route templates, tiers and nodes come from the
  fleet config, reasons and policies from the router's fixed vocabulary. An empty label value
  is written as ``none`` (a request refused before routing has no node).
- Latency histograms are in seconds, with buckets from 10 ms to 60 s.
- ``ttft_error_seconds`` observes |measured - predicted| TTFT, labelled ``direction="late"``
  when the measurement exceeded the prediction (the model was optimistic) and ``"early"``
  otherwise. (A histogram with negative buckets would lose its ``_sum``; this keeps the mean
  absolute error and the bias, ``(sum_late - sum_early) / count``, computable.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Request, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from gateway.usage import Usage
from routing.latency import PredictionErrors

NAMESPACE = "edgecloud"

LATENCY_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
)
ERROR_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


def _v(value: object) -> str:
    s = str(value) if value is not None else ""
    return s or "none"


def _children(metric: Any) -> Callable[..., Any]:
    """``metric.labels`` with the label values passed through :func:`_v`, remembered per
    argument tuple: a labelled series, once made, lives as long as its metric (nothing here
    removes one), so looking it up again (locking, checking and converting the labels each
    time) only costs."""
    cache: dict[tuple[Any, ...], Any] = {}

    def child(*values: Any) -> Any:
        c = cache.get(values)
        if c is None:
            c = cache[values] = metric.labels(*(_v(v) for v in values))
        return c

    return child


class GatewayMetrics:
    """Every series the gateway exports; one instance per gateway app."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "requests",
            "Requests answered, by route, HTTP status, tier and node.",
            ["route", "status", "tier", "node"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.ttft = Histogram(
            "ttft_seconds",
            "Time to first token seen by the gateway, by tier and node.",
            ["tier", "node"],
            namespace=NAMESPACE,
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "e2e_seconds",
            "End-to-end request latency seen by the gateway, by tier and node.",
            ["tier", "node"],
            namespace=NAMESPACE,
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.decisions = Counter(
            "decisions",
            "Routing decisions, by policy and reason.",
            ["policy", "reason"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.ttft_error = Histogram(
            "ttft_error_seconds",
            "|Measured - predicted| time to first token, by tier and direction (late, early).",
            ["tier", "direction"],
            namespace=NAMESPACE,
            registry=r,
            buckets=ERROR_BUCKETS,
        )
        self.redis_errors = Counter(
            "redis_errors",
            "Failed Redis calls, by component (fleet, ratelimit, keys).",
            ["component"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.redis_up = Gauge(
            "redis_up",
            "1 while the component reaches Redis, 0 while it serves from a fallback.",
            ["component"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.in_flight = Gauge(
            "in_flight_requests",
            "Requests being served right now.",
            namespace=NAMESPACE,
            registry=r,
        )
        self.rate_limited = Counter(
            "rate_limited",
            "Requests refused by a rate limit, by the limit hit (requests, tokens, too_large).",
            ["limit"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.tenant_tokens = Counter(
            "tenant_tokens",
            "Tokens used per API key and team (team '' for none), by kind: prompt, cached (the "
            "part of prompt served from a prefix cache), output.",
            ["key", "team", "kind"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.tenant_requests = Counter(
            "tenant_requests",
            "Requests answered with a usage, per API key and team.",
            ["key", "team"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.prediction_error = Gauge(
            "prediction_error_ratio",
            "Running mean of |measured - predicted| / measured (EWMA), by metric (ttft, e2e) "
            "and tier (all, edge, cloud, openai).",
            ["metric", "tier"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.prediction_bias = Gauge(
            "prediction_bias_seconds",
            "Running mean of measured - predicted (EWMA; > 0: the model is optimistic).",
            ["metric", "tier"],
            namespace=NAMESPACE,
            registry=r,
        )
        self._requests = _children(self.requests)
        self._ttft = _children(self.ttft)
        self._e2e = _children(self.e2e)
        self._decisions = _children(self.decisions)
        self._ttft_error = _children(self.ttft_error)

    # ---- recording ---------------------------------------------------------------------------
    def observe_request(self, route: str, status: int, tier: str | None, node: str | None) -> None:
        self._requests(route, status, tier, node).inc()

    def observe_ttft(
        self,
        tier: str | None,
        node: str | None,
        measured_s: float,
        predicted_s: float | None = None,
    ) -> None:
        """The measured TTFT and, when the router predicted one, the prediction error."""
        self._ttft(tier, node).observe(measured_s)
        if predicted_s is not None:
            err = measured_s - predicted_s
            direction = "late" if err > 0 else "early"
            self._ttft_error(tier, direction).observe(abs(err))

    def observe_e2e(self, tier: str | None, node: str | None, seconds: float) -> None:
        self._e2e(tier, node).observe(seconds)

    def observe_decision(self, policy: str, reason: str) -> None:
        self._decisions(policy, reason).inc()

    def redis_error(self, component: str) -> None:
        self.redis_errors.labels(_v(component)).inc()

    def set_redis_up(self, component: str, up: bool) -> None:
        self.redis_up.labels(_v(component)).set(1 if up else 0)

    def observe_prediction_errors(self, errors: PredictionErrors) -> None:
        """Export the latency model's running errors (called after each learned request)."""
        for (metric, tier), st in errors.stats.items():
            self.prediction_error.labels(metric, tier).set(st.mean_abs_rel)
            self.prediction_bias.labels(metric, tier).set(st.bias_ms / 1000.0)

    def observe_tenant_usage(self, key: str, team: str, usage: Usage) -> None:
        """One request's tokens, for chargeback (:mod:`gateway.usage`)."""
        self.tenant_requests.labels(key, team).inc()
        for kind, n in (
            ("prompt", usage.prompt_tokens),
            ("cached", usage.cached_tokens),
            ("output", usage.completion_tokens),
        ):
            self.tenant_tokens.labels(key, team, kind).inc(n)

    def observe_rate_limited(self, limit: str) -> None:
        self.rate_limited.labels(_v(limit)).inc()

    @contextmanager
    def track_in_flight(self) -> Iterator[None]:
        """Counts the block as one in-flight request (decremented however it exits)."""
        self.in_flight.inc()
        try:
            yield
        finally:
            self.in_flight.dec()

    # ---- exposition --------------------------------------------------------------------------
    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The scrape body and its content type, negotiated from the scraper's Accept header
        (Prometheus text format by default, OpenMetrics when asked for)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def text(self) -> str:
        """The Prometheus text exposition (for tests and debugging)."""
        return self.exposition()[0].decode()


def metrics_response(metrics: GatewayMetrics, request: Request) -> Response:
    """The body of a ``GET /metrics`` route."""
    body, content_type = metrics.exposition(request.headers.get("accept"))
    return Response(content=body, media_type=None, headers={"Content-Type": content_type})
