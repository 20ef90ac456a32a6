"""The staleness study: how the NodeState push interval (50 ms / 1 s / 5 s) moves p99 TTFT,
with and without the gateways counting what they sent since a node's last state.

Six edge nodes (this machine's measured CPU edge profile) behind three gateway replicas, no
cloud (``staleness_fleet.yaml``), so where a request lands decides how long it waits; the
first two minutes of the Azure conversation trace, lengths quartered, arrivals stretched
(``--time-scale``) to load the edges; the latency policy with default knobs. "Without" swaps
each router's ledger for one that reports nothing in flight
(``routing.sim.blind_ledger.BlindLedger``).

    python bench/sim_staleness.py --time-scale 2.5 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import TRACES, machine, recorded_command, table, write_results
from routing.policy_config import PolicyConfig
from routing.sim.fleet import load_fleet
from routing.sim.importers import import_azure
from routing.sim.metrics import summarize
from routing.sim.simulator import simulate
from routing.sim.trace import rescale_length, rescale_time, window

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "routing" / "sim" / "fleets" / "staleness_fleet.yaml"
CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-scale", type=float, nargs="+", default=[2.5, 4.0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--fleet", default=str(FLEET))
    args = ap.parse_args(argv)
    fleet = load_fleet(args.fleet)
    base = rescale_length(
        window(import_azure(CONV, regions=["eu-west"]), 0.0, 60.0 * args.minutes),
        0.25,
        0.25,
        max_prompt=1500,
    )
    rows = []
    for ts in args.time_scale:
        trace = rescale_time(base, ts)
        for interval in (0.05, 1.0, 5.0):
            for counted in (True, False):
                res = simulate(
                    trace,
                    fleet,
                    PolicyConfig(),
                    push_interval_s=interval,
                    count_in_flight=counted,
                )
                s = summarize(res)
                rows.append(
                    {
                        "time_scale": ts,
                        "rate_per_s": round(len(trace) / (trace[-1].arrival_s or 1.0), 2),
                        "push_interval_s": interval,
                        "counts_in_flight": counted,
                        "p50_ttft_s": round(s["p50_ttft_s"], 3),
                        "p90_ttft_s": round(s["p90_ttft_s"], 3),
                        "p99_ttft_s": round(s["p99_ttft_s"], 3),
                        "mean_e2e_s": round(s["mean_e2e_s"], 3),
                    }
                )
                print(rows[-1], flush=True)
    cols = list(rows[0])
    md = "\n".join(
        [
            "# Staleness: push interval and counting in-flight dispatches",
            "",
            f"`{recorded_command('sim_staleness.py', sys.argv[1:], ('--fleet',))}`",
            "",
            f"{len(base)} requests (Azure conv, first {args.minutes:g} min, lengths x0.25), "
            f"fleet `{Path(args.fleet).name}` (6 CPU edge nodes, 3 gateway replicas), "
            "latency policy.",
            "",
            table(rows, cols),
        ]
    )
    write_results("sim_staleness", {"machine": machine(), "rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
