"""Per-node fleet gauges in the gateway's /metrics, refreshed from the fleet view at each scrape.

``edgecloud_node_running`` and ``_waiting`` (the node's queue), ``_kv_blocks_used`` and
``_kv_blocks_total``, ``_prefix_hit_rate``, and ``edgecloud_circuit_open`` (1 while the
gateway's breaker for that node is not closed), each labelled by node and tier. Invariant: a
node that left the view has no series after the next scrape (stale series are removed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Gauge

from routing.fleet.state import NodeState

NAMESPACE = "edgecloud"

_FIELDS = {
    "node_running": ("running", "Requests the node is decoding, as it last reported."),
    "node_waiting": ("waiting", "Requests queued on the node, as it last reported."),
    "node_kv_blocks_used": ("kv_blocks_used", "KV cache blocks in use on the node."),
    "node_kv_blocks_total": ("kv_blocks_total", "KV cache blocks the node has."),
    "node_prefix_hit_rate": ("prefix_hit_rate", "Share of prompt tokens served from cache."),
}


class FleetGauges:
    """The gauges above, in ``registry``; :meth:`update` sets them from one view."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["node", "tier"]
        self.gauges = {
            field: Gauge(name, doc, labels, namespace=NAMESPACE, registry=registry)
            for name, (field, doc) in _FIELDS.items()
        }
        self.circuit_open = Gauge(
            "circuit_open",
            "1 while the gateway's circuit breaker for the node is open or half-open, else 0.",
            labels,
            namespace=NAMESPACE,
            registry=registry,
        )
        self._seen: set[tuple[str, str]] = set()

    def update(self, nodes: Sequence[NodeState], circuits: Mapping[str, str]) -> None:
        """Set every gauge from ``nodes`` and the breakers' states; drop nodes now gone."""
        now = {(n.id, n.kind.value) for n in nodes}
        for gone in self._seen - now:
            for gauge in (*self.gauges.values(), self.circuit_open):
                gauge.remove(*gone)
        for n in nodes:
            for field, gauge in self.gauges.items():
                gauge.labels(n.id, n.kind.value).set(float(getattr(n, field)))
            closed = circuits.get(n.id, "closed") == "closed"
            self.circuit_open.labels(n.id, n.kind.value).set(0.0 if closed else 1.0)
        self._seen = now
