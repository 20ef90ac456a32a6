"""Per-node circuit breakers: a node that keeps failing is skipped for a while.

States: closed (normal) -> open after ``failure_threshold`` consecutive failures -> after
``open_s`` half-open, where up to ``half_open_probes`` requests may try it: one success closes
it, a failure opens it again. Invariant: an open node is never a routing candidate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Breaker:
    failures: int = 0
    opened_at: float | None = None
    probes: int = 0


class CircuitBreakers:
    def __init__(
        self,
        failure_threshold: int = 5,
        open_s: float = 10.0,
        half_open_probes: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.half_open_probes = half_open_probes
        self.clock = clock
        self._nodes: dict[str, _Breaker] = {}

    def configure(self, failure_threshold: int, open_s: float, half_open_probes: int) -> None:
        self.failure_threshold, self.open_s, self.half_open_probes = (
            failure_threshold,
            open_s,
            half_open_probes,
        )

    def state(self, node_id: str) -> str:
        b = self._nodes.get(node_id)
        if b is None or b.opened_at is None:
            return "closed"
        return "open" if self.clock() - b.opened_at < self.open_s else "half_open"

    def open_nodes(self) -> set[str]:
        """Nodes to exclude now (open, or half-open with every probe slot taken)."""
        out = set()
        for node_id, b in self._nodes.items():
            st = self.state(node_id)
            if st == "open" or (st == "half_open" and b.probes >= self.half_open_probes):
                out.add(node_id)
        return out

    def on_dispatch(self, node_id: str) -> None:
        b = self._nodes.get(node_id)
        if b is not None and self.state(node_id) == "half_open":
            b.probes += 1

    def on_success(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)

    def on_failure(self, node_id: str) -> None:
        b = self._nodes.setdefault(node_id, _Breaker())
        if self.state(node_id) == "half_open":
            b.opened_at, b.probes = self.clock(), 0
            return
        b.failures += 1
        if b.failures >= self.failure_threshold and b.opened_at is None:
            b.opened_at = self.clock()

    def snapshot(self) -> dict[str, str]:
        return {n: self.state(n) for n in self._nodes}
