"""The latency policy with and without counting the delay a request's prefill adds to the
answers decoding on a node (``interference_weight``), and with and without replaying the
requests expected after it (``latency.future_arrivals``), in the simulator on three fleets:

- ``staleness_fleet.yaml``: six CPU edge nodes, three gateway replicas, no cloud;
- ``morning_peak_fleet.yaml``: edges in three offices and H200 replicas across the ocean;
- ``embedded_fleet.yaml``: this machine's embedded default with both tiers (one edge, one CPU
  cloud node: ``serve --cloud-device cpu``).

Each runs the first ``--minutes`` of the Azure conversation trace, lengths quartered,
arrivals stretched by ``--time-scale`` (the same trace for every variant: the ratio is the
result). The simulator treats nodes as separate machines; on the embedded default the two
tiers share one CPU, which it does not model (see ``bench/prediction_error.py`` for live).

    python bench/sim_interference.py
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

FLEETS = Path(__file__).resolve().parent.parent / "routing" / "sim" / "fleets"
CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"
# fleet file -> the region its clients are in
FLEET_REGIONS = {
    "staleness_fleet.yaml": "eu-west",
    "morning_peak_fleet.yaml": "eu-west",
    "embedded_fleet.yaml": "local",
}
NO_ARRIVALS = {"future_arrivals": False}
VARIANTS = {
    "each for itself": {"latency": NO_ARRIVALS},
    "interference_weight 1": {"interference_weight": 1.0, "latency": NO_ARRIVALS},
    # the node kept at its recent mean population, newcomers with the mean work, in full
    "future_arrivals": {
        "latency": {
            "arrival_population": "recent_mean",
            "arrival_work": "mean",
            "arrival_weight": 1.0,
        }
    },
    # held at what it has in hand, median newcomers, half their weight: the default since
    # 2026-12-04
    "held arrivals (default)": {},
    "both": {"interference_weight": 1.0},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=0.67)
    ap.add_argument("--time-scale", type=float, default=2.5)
    args = ap.parse_args(argv)
    base = rescale_length(
        window(import_azure(CONV), 0.0, 60.0 * args.minutes), 0.25, 0.25, max_prompt=1500
    )
    base = rescale_time(base, args.time_scale)
    rows = []
    for fleet_name, region in FLEET_REGIONS.items():
        fleet = load_fleet(FLEETS / fleet_name)
        trace = [r.model_copy(update={"region": region}) for r in base]
        ref: dict[str, float] = {}
        for variant, knobs in VARIANTS.items():
            s = summarize(simulate(trace, fleet, PolicyConfig.model_validate(knobs)))
            if not ref:
                ref = s
            rows.append(
                {
                    "fleet": fleet_name.removesuffix(".yaml"),
                    "variant": variant,
                    "mean_e2e_s": round(s["mean_e2e_s"], 3),
                    "p99_e2e_s": round(s["p99_e2e_s"], 3),
                    "p99_ttft_s": round(s["p99_ttft_s"], 3),
                    "mean_vs_first": round(s["mean_e2e_s"] / ref["mean_e2e_s"], 3),
                    "p99_vs_first": round(s["p99_e2e_s"] / ref["p99_e2e_s"], 3),
                    "cloud_share": round(s["cloud_share"], 3),
                }
            )
            print(rows[-1], flush=True)
    md = "\n".join(
        [
            "# Interference-aware routing and expected arrivals (simulated)",
            "",
            f"`{recorded_command('sim_interference.py', sys.argv[1:], ())}`",
            "",
            f"{len(base)} requests (Azure conv, first {args.minutes:g} min, lengths x0.25, "
            f"arrivals x{args.time_scale:g}), latency policy; `_vs_first` against "
            "`each for itself` (no arrivals, no weight) on the same fleet.",
            "",
            table(rows, list(rows[0])),
        ]
    )
    write_results("sim_interference", {"machine": machine(), "rows": rows}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
