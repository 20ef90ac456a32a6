"""Figures of ``bench/morning_peak_live.py``: per request class, mean / p50 / p99 TTFT and
end-to-end latency of the live run and of the simulator on the same trace, requests lost, the
goals, and the markdown tables."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

GOAL_MEAN_E2E_S = 1.5  # chat and automation at the peak
GOAL_P99_TTFT_S = 1.0
GOAL_SIM_ERROR = 0.10
CLASSES = ("chat", "code", "automation")


@dataclass(frozen=True, slots=True)
class Figures:
    """One class's latencies in seconds (nan where it had no request)."""

    n: int
    mean_ttft: float
    p50_ttft: float
    p99_ttft: float
    mean_e2e: float
    p50_e2e: float
    p99_e2e: float

    @classmethod
    def of(cls, ttft: list[float], e2e: list[float]) -> Figures:
        t = np.asarray([x for x in ttft if x is not None and math.isfinite(x)], dtype=float)
        e = np.asarray([x for x in e2e if x is not None and math.isfinite(x)], dtype=float)

        def st(a: np.ndarray) -> tuple[float, float, float]:
            if not a.size:
                return math.nan, math.nan, math.nan
            return float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 99))

        return cls(int(e.size), *st(t), *st(e))


def lost(trace: list[Any], live: list[dict[str, Any]]) -> list[int]:
    """Indices of requests that failed or came back short of their trace length."""
    return [
        i
        for i, (tr, r) in enumerate(zip(trace, live, strict=True))
        if "error" in r or r.get("completion_tokens", 0) < tr.output_tokens
    ]


def live_figures(trace: list[Any], live: list[dict[str, Any]]) -> dict[str, Figures]:
    """Per class (and ``all``), over the requests that were not lost."""
    bad = set(lost(trace, live))
    out = {}
    for cls in (*CLASSES, "all"):
        idx = [i for i, tr in enumerate(trace) if i not in bad and cls in ("all", tr.kind)]
        out[cls] = Figures.of([live[i].get("ttft_s") for i in idx], [live[i]["e2e_s"] for i in idx])
    return out


def sim_figures(trace: list[Any], res: Any) -> dict[str, Figures]:
    """The simulator's figures per class (and ``all``), over every request it served."""
    out = {}
    for cls in (*CLASSES, "all"):
        idx = [i for i, tr in enumerate(trace) if cls in ("all", tr.kind)]
        out[cls] = Figures.of(
            [float(res.ttft_s[i]) for i in idx], [float(res.e2e_s[i]) for i in idx]
        )
    return out


def goals(peak: dict[str, Figures], sim: dict[str, Figures], lost_n: int) -> list[dict[str, Any]]:
    """The issue's goals at the peak (the 1x level), each with its value and whether it holds."""
    rows: list[dict[str, Any]] = [
        {"goal": "requests lost == 0", "value": lost_n, "ok": lost_n == 0}
    ]
    for cls in ("chat", "automation"):
        v = peak[cls].mean_e2e
        rows.append(
            {"goal": f"{cls} mean e2e < {GOAL_MEAN_E2E_S} s", "value": v, "ok": v < GOAL_MEAN_E2E_S}
        )
    v = peak["all"].p99_ttft
    rows.append({"goal": f"TTFT p99 < {GOAL_P99_TTFT_S} s", "value": v, "ok": v < GOAL_P99_TTFT_S})
    for key in ("mean_ttft", "mean_e2e"):
        live_v, sim_v = getattr(peak["all"], key), getattr(sim["all"], key)
        err = sim_v / live_v - 1 if live_v > 0 else math.nan
        rows.append(
            {
                "goal": f"sim {key} within 10% of live",
                "value": err,
                "ok": abs(err) <= GOAL_SIM_ERROR,
            }
        )
    return rows


def level_rows(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per level and class: live and simulated figures side by side."""
    rows = []
    for lv in levels:
        for cls in (*CLASSES, "all"):
            lf, sf = lv["live"][cls], lv["sim"].get(cls, {})
            rows.append(
                {
                    "level": lv["label"],
                    "class": cls,
                    "n": lf["n"],
                    **{
                        f"live_{k}": lf[k]
                        for k in (
                            "mean_ttft",
                            "p50_ttft",
                            "p99_ttft",
                            "mean_e2e",
                            "p50_e2e",
                            "p99_e2e",
                        )
                    },
                    **{
                        f"sim_{k}": sf.get(k, math.nan)
                        for k in ("mean_ttft", "p99_ttft", "mean_e2e", "p99_e2e")
                    },
                    "lost": lv["lost"] if cls == "all" else "",
                }
            )
    return rows


def crossing(levels: list[dict[str, Any]]) -> str | None:
    """The first level whose chat or automation mean e2e passes the goal (None: none did)."""
    for lv in levels:
        if any(lv["live"][c]["mean_e2e"] >= GOAL_MEAN_E2E_S for c in ("chat", "automation")):
            return str(lv["label"])
    return None


def as_dict(figs: dict[str, Figures]) -> dict[str, dict[str, float]]:
    return {k: asdict(v) for k, v in figs.items()}
