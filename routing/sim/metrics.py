"""Summaries of a :class:`routing.sim.result.SimResult`: latency percentiles, SLO
attainment and goodput, cloud share, per-node load and prefix hit rate, and text tables.

Invariants: percentiles are over finished requests only (failed ones are counted apart);
``slo_attainment`` is the share of *all* requests (failed ones miss) whose TTFT and time per
output token both meet the SLO; ``goodput_rps`` is those requests per second of trace span;
``joules_per_request`` is the fleet's energy over the whole run (each node's profile watts: idle
throughout, load while it steps) over the requests finished, NaN unless every node has figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from routing.sim.result import SimResult


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 1.0
    tpot_s: float = 0.1


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if x.size else math.nan


def summarize(
    res: SimResult, slo: Slo = Slo(), t0: float | None = None, t1: float | None = None
) -> dict[str, float]:
    """Headline numbers (optionally only for requests arriving in ``[t0, t1)``)."""
    arr = np.asarray(res.arrival_s)
    sel = np.ones(arr.size, dtype=bool)
    if t0 is not None:
        sel &= arr >= t0
    if t1 is not None:
        sel &= arr < t1
    ttft = np.asarray(res.ttft_s)[sel]
    e2e = np.asarray(res.e2e_s)[sel]
    node = np.asarray(res.node)[sel]
    out = np.asarray(res.output_tokens)[sel]
    ok = ~np.isnan(e2e)
    tt, ee = ttft[ok], e2e[ok]
    tpot = np.where(out[ok] > 1, (ee - tt) / np.maximum(out[ok] - 1, 1), 0.0)
    good = (tt <= slo.ttft_s) & (tpot <= slo.tpot_s)
    cloud_idx = {i for i, k in enumerate(res.node_kinds) if k == "cloud"}
    on_cloud = np.isin(node[ok], list(cloud_idx)) if cloud_idx else np.zeros(ok.sum(), bool)
    span = (arr[sel].max() - arr[sel].min()) if sel.any() else 0.0
    n = int(sel.sum())
    return {
        "requests": float(n),
        "failed": float(n - ok.sum()),
        "mean_ttft_s": float(tt.mean()) if tt.size else math.nan,
        "p50_ttft_s": _pct(tt, 50),
        "p90_ttft_s": _pct(tt, 90),
        "p99_ttft_s": _pct(tt, 99),
        "mean_e2e_s": float(ee.mean()) if ee.size else math.nan,
        "p50_e2e_s": _pct(ee, 50),
        "p90_e2e_s": _pct(ee, 90),
        "p99_e2e_s": _pct(ee, 99),
        "slo_attainment": float(good.sum() / n) if n else math.nan,
        "goodput_rps": float(good.sum() / span) if span > 0 else math.nan,
        "cloud_share": float(on_cloud.mean()) if on_cloud.size else math.nan,
        "prefix_hit_rate": float(np.asarray(res.cached_tokens)[sel][ok].sum())
        / max(1.0, float(np.asarray(res.prompt_tokens)[sel][ok].sum())),
        "joules_per_request": joules_per_request(res),
    }


def joules_per_request(res: SimResult) -> float:
    """The whole run's energy over its finished requests (NaN: a node without watts)."""
    joules = sum(s.get("joules", math.nan) for s in res.node_stats.values())
    done = int(np.count_nonzero(~np.isnan(np.asarray(res.e2e_s))))
    return joules / done if done else math.nan


def objective_value(summary: dict[str, float], objective: str) -> float:
    """The tuner's objective, to minimize (goodput is negated)."""
    if objective == "mean_e2e":
        v = summary["mean_e2e_s"]
    elif objective == "p99_ttft":
        v = summary["p99_ttft_s"]
    elif objective == "goodput":
        v = -summary["slo_attainment"]
    else:
        raise ValueError(f"unknown objective {objective!r}")
    penalty = summary["failed"] / max(1.0, summary["requests"])  # failures count as misses
    return (v if math.isfinite(v) else 1e9) + (
        10.0 * penalty if objective != "goodput" else penalty
    )


def fmt_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [
        [f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=False)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


POLICY_COLUMNS = [
    ("mean_ttft_s", "ttft mean"),
    ("p50_ttft_s", "p50"),
    ("p90_ttft_s", "p90"),
    ("p99_ttft_s", "p99"),
    ("mean_e2e_s", "e2e mean"),
    ("p50_e2e_s", "p50"),
    ("p90_e2e_s", "p90"),
    ("p99_e2e_s", "p99"),
    ("slo_attainment", "SLO"),
    ("cloud_share", "cloud"),
    ("failed", "failed"),
    ("joules_per_request", "J/req"),
]


def policy_table(summaries: dict[str, dict[str, float]]) -> str:
    headers = ["policy", *(h for _, h in POLICY_COLUMNS)]
    rows = [[name, *(s[k] for k, _ in POLICY_COLUMNS)] for name, s in summaries.items()]
    return fmt_table(headers, rows)


def node_table(res: SimResult) -> str:
    rows = []
    for nid, kind in zip(res.node_ids, res.node_kinds, strict=False):
        s = res.node_stats[nid]
        jpr = s.get("joules", math.nan) / s["requests"] if s["requests"] else math.nan
        rows.append([nid, kind, int(s["requests"]), s["busy_share"], s["prefix_hit_rate"], jpr])
    return fmt_table(["node", "tier", "requests", "busy", "prefix hit", "J/req"], rows)
