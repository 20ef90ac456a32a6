"""The latency model: a producer of per-node estimates, learned online from every reply.

``LatencyModel.estimate`` predicts one request's timings on one node (``estimate``); ``observe``
learns from a finished request (``learning``); the rates it reads live in ``rates``, their fits
in ``fits``, its starting assumptions in ``priors`` and its error statistics in ``errors``. It
has no settings: everything it uses is learned or reported by the nodes.
"""

from __future__ import annotations

from collections.abc import Mapping

from routing.fleet.state import NodeState
from routing.latency.errors import ErrorStats, PredictionErrors
from routing.latency.estimate import Basis, Estimate, predict
from routing.latency.learning import Observation, learn
from routing.latency.rates import NodeRates, RateBook

__all__ = [
    "Basis",
    "ErrorStats",
    "Estimate",
    "LatencyModel",
    "NodeRates",
    "Observation",
    "PredictionErrors",
]


class LatencyModel(RateBook):
    """Predicts per-node TTFT and end-to-end latency and learns each node's rates online."""

    def __init__(self) -> None:
        super().__init__()
        self.errors = PredictionErrors()

    # predict one request's timings on a node from these rates (``estimate.predict``)
    estimate = predict

    def observe(self, obs: Observation) -> dict[str, float]:
        """Learn from one finished request; returns the prediction errors recorded (ms)."""
        return learn(self, self.errors, obs)

    def snapshot(self, nodes: Mapping[str, NodeState] | None = None) -> dict[str, dict[str, float]]:
        """Learned rates per node (and the blended ones when the node's state is given)."""
        out: dict[str, dict[str, float]] = {}
        for node_id, r in sorted(self.rates.items()):
            row = {
                "measured_prefill_tokens_per_s": r.prefill_tokens_per_s.value,
                "prefill_samples": float(r.prefill_tokens_per_s.n),
                "measured_decode_ms_per_token_b1": r.decode_ms_per_token_b1.value,
                "decode_samples": float(r.decode_ms_per_token_b1.n),
                "mean_output_tokens": r.output_tokens.value,
                "gateway_overhead_ms": r.gateway_ms.value,
                "node_admission_ms": r.admission_ms.value,
            }
            node = (nodes or {}).get(node_id)
            if node is not None:
                row["prefill_tokens_per_s"] = self.prefill_tokens_per_s(node)
                row["decode_ms_per_token_b1"] = self.decode_ms_per_token_b1(node)
                row["batch_slope"] = self.batch_slope(node)
                row["decode_ms_per_context_token"] = self.context_cost(node)
                fixed, per_token, per_cached = self.prefill_cost(node)
                row["prefill_fixed_ms"] = fixed
                row["prefill_ms_per_token"] = per_token
                row["prefill_ms_per_cached_token"] = per_cached
            out[node_id] = row
        return out
