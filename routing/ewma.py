"""The exponentially weighted moving average every learned rate in routing uses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Ewma:
    """EWMA with weight ``alpha`` per new sample; the first sample is taken whole (``n`` counts
    the samples, so ``n == 0`` means nothing was seen and ``value`` is 0)."""

    alpha: float = 0.2
    value: float = 0.0
    n: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.n == 0 else self.value + self.alpha * (x - self.value)
        self.n += 1
