"""The results of ``bench/morning_peak_live.py``: the JSON payload, the markdown table (live
and simulated figures per level and class, requests lost, the goals at the real rate), written
to ``bench/results/`` (``--smoke``: to the ignored raw folder only)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from bench import _peak_live_report as rep
from bench._common import RAW, machine, recorded_command, table, write_results
from bench._peak_live_fleet import Layout
from bench._peak_live_schedule import Level


def write(
    args: argparse.Namespace,
    layout: Layout,
    levels: list[Level],
    done: list[dict[str, Any]],
    wall: float,
) -> int:
    """Write the run's results; 0."""
    peak = done[0]
    to_f = {k: rep.Figures(**v) for k, v in peak["live"].items()}
    sim_f = {k: rep.Figures(**v) for k, v in peak["sim"].items()}
    goals = rep.goals(to_f, sim_f, peak["lost"])
    rows = rep.level_rows(done)
    cross = rep.crossing(done)
    payload = {
        "machine": machine(),
        "command": recorded_command(
            "morning_peak_live.py",
            sys.argv[1:],
            (
                "--models-dir",
                "--home",
                "--redis-server",
                "--tokenizer-dir",
                "--cloud-profile",
                "--edge-profile",
            ),
        ),
        "layout": {
            "edges": layout.edges,
            "edge_threads": layout.edge_threads,
            "edge_slots": layout.edge_slots,
            "edge_variant": layout.edge_variant,
            "workers": layout.workers,
            "cloud_device": layout.cloud_device,
            "cloud_shape": "tiny" if args.smoke else args.cloud_shape,
        },
        "people": args.people,
        "levels_planned": [lv.label for lv in levels],
        "levels": done,
        "requests_lost": sum(lv["lost"] for lv in done),
        "peak_lost": peak["lost"],
        "crossing_level": cross,
        "goals": goals,
        "wall_s": wall,
    }
    cols = [
        "level",
        "class",
        "n",
        "live_mean_ttft",
        "live_p50_ttft",
        "live_p99_ttft",
        "live_mean_e2e",
        "live_p50_e2e",
        "live_p99_e2e",
        "sim_mean_ttft",
        "sim_p99_ttft",
        "sim_mean_e2e",
        "sim_p99_e2e",
        "lost",
    ]
    md = [
        "# The morning peak, live on one host"
        + (" (smoke: tiny models on the CPU)" if args.smoke else ""),
        "",
        f"`{payload['command']}`",
        "",
        f"{args.people} people; gateway in eu-west with {layout.workers} workers; cloud node "
        f"({payload['layout']['cloud_shape']}, {layout.cloud_device}) in us-east; edge nodes "
        f"{layout.edges} ({layout.edge_threads} threads, {layout.edge_slots} slots, "
        f"{layout.edge_variant}); round trips from the fleet file through a proxy. Seconds; "
        "sim = the simulator on the same requests with the nodes' profiles.",
        "",
        table(rows, cols),
        "",
        f"Requests lost: {payload['requests_lost']}. Chat or automation mean e2e first at or over "
        f"1.5 s: {cross or 'at no level run'}. Cloud share live / sim per level: "
        + ", ".join(
            f"{lv['label']} {lv['live_cloud_share']:.2f} / {lv['sim_cloud_share']:.2f}"
            for lv in done
        ),
        "",
        "Goals at the real rate (first level):",
        "",
        table(
            [
                {
                    **g,
                    "value": g["value"]
                    if not isinstance(g["value"], float) or math.isfinite(g["value"])
                    else "nan",
                }
                for g in goals
            ],
            ["goal", "value", "ok"],
        ),
    ]
    if args.smoke:
        (RAW / f"{args.name}.json").write_text(json.dumps(payload, indent=1))
        print("\n".join(md))
        print(f"\nwrote {RAW / args.name}.json")
    else:
        write_results(args.name, payload, "\n".join(md))
    return 0
