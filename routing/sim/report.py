"""Plots (PNG, matplotlib's Agg backend) and the markdown report of a tuning run or of a
side-by-side comparison.

Plots: latency CDF per policy (TTFT and end-to-end), load per tier over time, cloud share over
time (per minute of arrivals), and the objective against each searched knob.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from routing.sim.metrics import POLICY_COLUMNS
from routing.sim.result import SimResult


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdf(results: Mapping[str, SimResult], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in results.items():
        for ax, values in zip(axes, (res.ttft_s, res.e2e_s), strict=True):
            x = np.sort(np.asarray(values)[~np.isnan(values)])
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=name)
    for ax, title in zip(axes, ("TTFT", "end-to-end"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (s)")
        ax.set_ylabel("share of requests")
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{title} CDF")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_load(results: Mapping[str, SimResult], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for name, res in results.items():
        for ax, tier in zip(axes, ("edge", "cloud"), strict=True):
            pts = res.load_series.get(tier, [])
            if pts:
                t, v = zip(*pts, strict=True)
                ax.plot(np.asarray(t) / 60.0, v, label=name, lw=0.8)
    for ax, tier in zip(axes, ("edge", "cloud"), strict=True):
        ax.set_xlabel("minutes")
        ax.set_ylabel("requests running + waiting")
        ax.set_title(f"{tier} load")
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cloud_share_series(res: SimResult, bucket_s: float = 60.0) -> tuple[np.ndarray, np.ndarray]:
    arr = np.asarray(res.arrival_s)
    node = np.asarray(res.node)
    cloud = np.asarray([k == "cloud" for k in res.node_kinds] + [False])  # -1 -> False
    on_cloud = cloud[node]
    ok = node >= 0
    b = (arr // bucket_s).astype(int)
    n = b.max() + 1 if b.size else 0
    tot = np.bincount(b[ok], minlength=n)
    cl = np.bincount(b[ok], weights=on_cloud[ok], minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(tot > 0, cl / np.maximum(tot, 1), np.nan)
    return np.arange(n) * bucket_s / 60.0, share


def plot_cloud_share(results: Mapping[str, SimResult], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, res in results.items():
        t, s = cloud_share_series(res)
        ax.plot(t, s, label=name, lw=1)
    ax.set_xlabel("minutes")
    ax.set_ylabel("share of requests sent to cloud")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_knobs(trials: Sequence[Any], objective: str, path: Path) -> Path:
    plt = _plt()
    knobs = sorted(
        {
            k
            for t in trials
            for k, v in t.params.items()
            if isinstance(v, int | float) and k != "policy"
        }
    )
    cats = sorted(
        {k for t in trials for k, v in t.params.items() if isinstance(v, str) and k != "policy"}
    )
    names = knobs + cats
    n = max(1, len(names))
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax, k in zip(axes.flat, names, strict=False):
        xs = [t.params[k] for t in trials if k in t.params]
        ys = [t.value for t in trials if k in t.params]
        if k in cats:
            levels = sorted(set(xs))
            xs = [levels.index(x) for x in xs]
            ax.set_xticks(range(len(levels)), levels)
        ax.scatter(xs, ys, s=10)
        ax.set_title(k, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.suptitle(f"objective ({objective}) per trial against each knob", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def comparison_table(summaries: Mapping[str, Mapping[str, float]]) -> str:
    """A markdown table, one row per policy."""
    head = "| policy | " + " | ".join(h for _, h in POLICY_COLUMNS) + " |"
    sep = "|---" * (len(POLICY_COLUMNS) + 1) + "|"
    lines = [head, sep]
    for name, s in summaries.items():
        cells = [f"{s[k]:.3f}" if isinstance(s[k], float) else str(s[k]) for k, _ in POLICY_COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _knobs(params: Mapping[str, Any]) -> str:
    return ", ".join(
        f"`{k}`={v:.3g}" if isinstance(v, float) else f"`{k}`={v}" for k, v in params.items()
    )


def write_report(result: Any, out_dir: Path, title: str, context: str = "") -> Path:
    """The tuning report: markdown plus PNGs next to it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, SimResult] = dict(result.baseline_results)
    if result.tuned_result is not None:
        runs["tuned"] = result.tuned_result
    pngs = {
        "cdf": plot_cdf(runs, out_dir / "latency_cdf.png"),
        "load": plot_load(runs, out_dir / "load_per_tier.png"),
        "cloud": plot_cloud_share(runs, out_dir / "cloud_share.png"),
        "knobs": plot_knobs(result.trials, result.objective, out_dir / "objective_vs_knobs.png"),
    }
    summaries = {**result.baselines, "tuned": result.tuned_summary}
    best = sorted(result.trials, key=lambda t: t.value)[:5]
    lines = [
        f"# {title}",
        "",
        context,
        "",
        f"Objective: `{result.objective}` (minimized; goodput is negated). Default knobs: "
        f"{result.default_value:.4f}; tuned: {result.best_value:.4f} "
        f"({len(result.trials)} trials).",
        "",
        "## Tuned against every baseline (latency in seconds)",
        "",
        comparison_table(summaries),
        "",
        "## Best trials",
        "",
        "| trial | value | knobs |",
        "|---|---|---|",
        *(f"| {t.number} | {t.value:.4f} | {_knobs(t.params)} |" for t in best),
        "",
        "## Plots",
        "",
        *(f"![{k}]({p.name})" for k, p in pngs.items()),
        "",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
