"""Predicted-vs-measured error statistics of the latency model (reported in /metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ErrorStats:
    """EWMAs of one quantity's signed, absolute and relative error (measured - predicted)."""

    count: int = 0
    bias_ms: float = 0.0
    mean_abs_ms: float = 0.0
    mean_abs_rel: float = 0.0  # |error| / measured
    last_error_ms: float = 0.0

    def add(self, predicted: float, measured: float, alpha: float) -> None:
        err = measured - predicted
        rel = abs(err) / max(measured, 1.0)
        a = 1.0 if self.count == 0 else alpha
        self.bias_ms += a * (err - self.bias_ms)
        self.mean_abs_ms += a * (abs(err) - self.mean_abs_ms)
        self.mean_abs_rel += a * (rel - self.mean_abs_rel)
        self.last_error_ms = err
        self.count += 1


class PredictionErrors:
    """Error stats of TTFT and end-to-end predictions, overall (tier ``all``) and per tier."""

    def __init__(self) -> None:
        self.stats: dict[tuple[str, str], ErrorStats] = {}

    def add(self, metric: str, tier: str, predicted: float, measured: float, alpha: float) -> float:
        """Record one pair; returns the signed error (measured - predicted) in ms."""
        for key in ((metric, "all"), (metric, tier)):
            s = self.stats.get(key)
            if s is None:
                s = self.stats[key] = ErrorStats()
            s.add(predicted, measured, alpha)
        return measured - predicted

    def get(self, metric: str, tier: str = "all") -> ErrorStats:
        return self.stats.get((metric, tier), ErrorStats())

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {
            f"{m}:{t}": {
                "count": s.count,
                "bias_ms": s.bias_ms,
                "mean_abs_ms": s.mean_abs_ms,
                "mean_abs_rel": s.mean_abs_rel,
            }
            for (m, t), s in sorted(self.stats.items())
        }
