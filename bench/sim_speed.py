"""How fast the fleet simulator runs: a one-hour trace of 30,000 requests (the generated
office morning peak, 08:30-09:30, on the three-region morning-peak fleet) per policy, timed in
CPU seconds of this one process (``time.process_time``: the simulator is single-threaded, and
this machine's cores are shared) and in wall seconds. The target is under 60 s on one core.

    python bench/sim_speed.py --requests 30000 --policy latency least_loaded
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine, recorded_command, table, write_results
from routing.policy_config import PolicyConfig
from routing.sim.fleet import load_fleet
from routing.sim.generator import MorningPeak, generate
from routing.sim.simulator import simulate
from routing.sim.trace import summary, window

FLEET = (
    Path(__file__).resolve().parent.parent
    / "routing"
    / "sim"
    / "fleets"
    / "morning_peak_fleet.yaml"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=30000)
    ap.add_argument("--people", type=int, default=2000)
    ap.add_argument("--policy", nargs="+", default=["latency", "least_loaded", "round_robin"])
    ap.add_argument("--fleet", default=str(FLEET))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t = time.process_time()
    trace = window(generate(MorningPeak(people=args.people), seed=args.seed), 1800.0, 5400.0)
    trace = trace[: args.requests]
    gen_s = time.process_time() - t
    s = summary(trace)
    fleet = load_fleet(args.fleet)
    print(f"{int(s['requests'])} requests over {s['span_s']:.0f} s (generated in {gen_s:.1f} s)")
    rows = []
    for pol in args.policy:
        c0, w0 = time.process_time(), time.perf_counter()
        res = simulate(trace, fleet, PolicyConfig(), policy=pol, seed=args.seed)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        rows.append(
            {
                "policy": pol,
                "requests": int(s["requests"]),
                "events": res.events,
                "cpu_s": round(cpu, 2),
                "wall_s": round(wall, 2),
                "requests_per_cpu_s": round(s["requests"] / cpu),
            }
        )
        print(rows[-1], flush=True)
    cols = ["policy", "requests", "events", "cpu_s", "wall_s", "requests_per_cpu_s"]
    md = "\n".join(
        [
            "# Simulator speed",
            "",
            f"`{recorded_command('sim_speed.py', sys.argv[1:], ('--fleet',))}`",
            "",
            f"One-hour morning-peak trace ({int(s['requests'])} requests, {s['span_s']:.0f} s), "
            f"fleet `{Path(args.fleet).name}` ({len(fleet.expanded())} nodes, "
            f"{sum(g.replicas for g in fleet.gateways)} gateway replicas). CPU seconds of the "
            "one simulator process.",
            "",
            table(rows, cols),
        ]
    )
    write_results("sim_speed", {"machine": machine(), "trace": s, "rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
