"""Policy files against the defaults over successive windows of one trace, in the simulator.

Six busy CPU edges and no cloud (``staleness_fleet.yaml``) under the Azure conversation trace
(all streams) scaled as ``tests/test_sim_tuner.py`` scales it (lengths x0.25, prompts at most
1,500 tokens, arrivals x2.5), cut into ``--windows`` successive windows of ``--window-s``
seconds. Per policy: the mean end-to-end time over the windows and in how many windows it beat
the defaults (the peer, same run, same requests). ``docs/tuning.md`` quotes it.

    python bench/policy_windows.py [--windows 12] [--window-s 40]

Writes bench/results/policy_windows.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
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

FLEET = (
    Path(__file__).resolve().parent.parent / "routing" / "sim" / "fleets" / "staleness_fleet.yaml"
)
CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"
POLICIES = {  # policy-file settings; the first is the peer
    "the defaults": {},
    "objective: ttft": {"objective": "ttft"},
    "objective: e2e": {"objective": "e2e"},
    "interference_weight: 1": {"interference_weight": 1.0},
    "interference_weight: 4": {"interference_weight": 4.0},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--window-s", type=float, default=40.0)
    args = ap.parse_args(argv)
    trace = import_azure(CONV, regions=["eu-west"])
    fleet = load_fleet(FLEET)
    means: dict[str, list[float]] = {name: [] for name in POLICIES}
    for w in range(args.windows):
        part = window(trace, w * args.window_s, (w + 1) * args.window_s)
        part = rescale_time(rescale_length(part, 0.25, 0.25, max_prompt=1500), 2.5)
        for name, knobs in POLICIES.items():
            s = summarize(simulate(part, fleet, PolicyConfig.model_validate(knobs)))
            means[name].append(s["mean_e2e_s"])
        print(f"window {w}: " + ", ".join(f"{n} {v[-1]:.3f}" for n, v in means.items()), flush=True)
    peer = means["the defaults"]
    rows = [
        {
            "policy": name,
            "mean_e2e_s": round(statistics.fmean(v), 3),
            "sd_over_windows_s": round(statistics.stdev(v), 3) if len(v) > 1 else 0.0,
            "better_than_defaults": sum(a < b for a, b in zip(v, peer, strict=True)),
            "tied": sum(a == b for a, b in zip(v, peer, strict=True)),
        }
        for name, v in means.items()
    ]
    command = recorded_command("policy_windows.py", sys.argv[1:] if argv is None else argv, ())
    md = "\n\n".join(
        [
            "# Policy files against the defaults over successive windows (simulated)",
            f"`{command}`: staleness_fleet.yaml, Azure conv (eu-west), {args.windows} windows "
            f"of {args.window_s:g} s, each scaled as tests/test_sim_tuner.py scales its one.",
            table(rows, list(rows[0])),
        ]
    )
    write_results("policy_windows", {"machine": machine(), "rows": rows}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
