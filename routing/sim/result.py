""":class:`SimResult`, what one simulator run reports: per-request outcomes as parallel lists in
trace order (a failed request: node -1, NaN latencies), per-node stats (:func:`node_stats`) and
the load time series. Invariants: every per-request list has the trace's length; latencies are
simulated seconds at the client; only ``wall_s`` depends on the machine that ran it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from routing.power import Watts, estimated_joules
from routing.sim.node import SimNode


@dataclass
class SimResult:
    """Per-request outcomes (parallel lists, trace order) and per-node and time-series stats."""

    policy: str
    node_ids: list[str]
    node_kinds: list[str]
    arrival_s: list[float]
    ttft_s: list[float]  # at the client; NaN for failed requests
    e2e_s: list[float]
    node: list[int]  # -1: failed
    prompt_tokens: list[int]
    output_tokens: list[int]
    cached_tokens: list[int]
    predicted_ttft_s: list[float]
    predicted_e2e_s: list[float]
    node_stats: dict[str, dict[str, float]]
    load_series: dict[str, list[tuple[float, float]]]  # tier -> (time, running + waiting)
    events: int = 0
    wall_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def node_stats(
    nodes: Sequence[SimNode], watts: Sequence[Watts | None], end_s: float
) -> dict[str, dict[str, float]]:
    """Each node's figures over a run that ended at ``end_s``, by node id: joules (its
    profile's idle watts over the run, load watts while it stepped; NaN without watts),
    requests served, prefix hit rate, busy share and steps."""
    stats: dict[str, dict[str, float]] = {}
    for node, w in zip(nodes, watts, strict=True):
        stats[node.id] = {
            "joules": estimated_joules(w, end_s, node.busy_s) if w else math.nan,
            "requests": float(node.served),
            "prefix_hit_rate": node.cached_tokens / node.prompt_tokens
            if node.prompt_tokens
            else 0.0,
            "busy_share": node.busy_s / max(1e-9, end_s),
            "steps": float(node.steps),
        }
    return stats
