"""Small helpers shared by the benchmarks: result files and table printing.

Each benchmark keeps one current summary in ``bench/results/`` (``NAME.json`` and ``NAME.md``,
committed); everything a run writes besides (per-request samples, per-run folders, logs, plots)
goes under ``bench/results/raw/``, which git ignores."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# per-run outputs: samples, logs, plots, profiles (ignored by git)
RAW = RESULTS / "raw"
# the shared data (MaxMind test databases, LLM traces): ``shared/data`` beside the checkout,
# or wherever EDGECLOUD_SHARED_DATA says
SHARED_DATA = Path(
    os.environ.get("EDGECLOUD_SHARED_DATA")
    or Path(__file__).resolve().parents[2] / "shared" / "data"
)
TRACES = SHARED_DATA / "traces"


def machine() -> dict[str, Any]:
    import os
    import shutil
    import subprocess

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if shutil.which("nvidia-smi"):  # the GPUs, where the machine has any
        q = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        r = subprocess.run(q, capture_output=True, text=True, timeout=30, check=False)
        if r.returncode == 0 and r.stdout.strip():
            out["gpus"] = r.stdout.strip().splitlines()
    return out


def recorded_command(script: str, argv: list[str], path_options: tuple[str, ...]) -> str:
    """The command line as results record it: without the values of ``path_options`` (local
    output folders have no place in committed results)."""
    out, skip = [f"python bench/{script}"], False
    for a in argv:
        if skip:
            skip = False
        elif a in path_options:
            skip = True
        elif not a.startswith(tuple(o + "=" for o in path_options)):
            out.append(a)
    return " ".join(out)


def cuda_ms(fn: Callable[[], object], n: int) -> float:
    """Median device time of ``fn()`` between two CUDA events, in milliseconds, over ``n``
    calls (each waited for before the next)."""
    import torch

    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A GitHub markdown table of ``rows`` restricted to ``columns``."""

    def fmt(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def raw_dir(name: str) -> Path:
    """A run's folder for its per-run outputs, ``bench/results/raw/NAME`` (ignored by git)."""
    path = RAW / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_results(
    name: str, payload: dict[str, Any], markdown: str, raw: dict[str, Any] | None = None
) -> None:
    """The benchmark's summary, ``bench/results/NAME.json`` and ``.md``; ``raw`` (per-run
    data too large or too noisy to commit) goes to ``bench/results/raw/NAME.json``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (RESULTS / f"{name}.md").write_text(markdown + "\n")
    print(markdown)
    print(f"\nwrote {RESULTS / name}.json and .md")
    if raw is not None:
        RAW.mkdir(parents=True, exist_ok=True)
        (RAW / f"{name}.json").write_text(json.dumps(raw, indent=1))
        print(f"wrote {RAW / name}.json")


def write_rows_and_summary(
    name: str, title: str, rows: list[dict[str, Any]], summary: dict[str, Any]
) -> None:
    """Results of a bench of repeated rounds (each a row, every key a column) and their
    ``summary`` (one row): the command line run, the machine, both tables, as ``name``."""
    command = recorded_command(f"{name}.py", sys.argv[1:], ())
    markdown = "\n\n".join(
        [f"# {title}", f"`{command}`", table(rows, list(rows[0])), table([summary], list(summary))]
    )
    payload = {"command": command, "machine": machine(), "rows": rows, "summary": summary}
    write_results(name, payload, markdown)
