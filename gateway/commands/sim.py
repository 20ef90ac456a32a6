"""``edgecloud sim --trace T --fleet F --policy P [P ...]``: replay a trace through the fleet
simulator (``routing.sim``) under each policy and print per-policy and per-node tables.

``--trace`` takes our JSONL format, an Azure CSV or the Mooncake JSONL (by content), or
``morning-peak`` for the generated office peak. Each policy runs on a fresh simulator with the
same seed (nothing learned carries over between policies).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_trace_args(p: argparse.ArgumentParser, fleet: bool = True) -> None:
    p.add_argument(
        "--trace", required=True, help="trace file (JSONL, Azure CSV, Mooncake) or morning-peak"
    )
    if fleet:
        p.add_argument("--fleet", required=True, help="fleet YAML")
    p.add_argument("--policy-file", default=None, help="base policy YAML (default: built-in knobs)")
    p.add_argument("--regions", nargs="*", default=None, help="client regions for imported traces")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times")
    p.add_argument("--prompt-scale", type=float, default=1.0, help="multiply prompt lengths")
    p.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    p.add_argument("--max-prompt", type=int, default=None, help="cap prompt lengths (tokens)")
    p.add_argument("--start", type=float, default=0.0, help="window start (s)")
    p.add_argument("--duration", type=float, default=None, help="window length (s)")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--people", type=int, default=1000, help="morning-peak: people")
    p.add_argument("--seed", type=int, default=0, help="random seed (traces, tie breaks)")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="SLO: TTFT seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="SLO: seconds per output token")
    p.add_argument("--push-interval", type=float, default=None, help="override the fleet's")


def load_trace_args(args: argparse.Namespace) -> list[Any]:
    from routing.sim.importers import import_any
    from routing.sim.trace import rescale_length, rescale_time, window

    if args.trace == "morning-peak":
        from routing.sim.generator import MorningPeak, generate

        trace = generate(MorningPeak(people=args.people), seed=args.seed)
    else:
        kw = {"regions": args.regions, "seed": args.seed} if args.regions else {}
        trace = import_any(args.trace, **kw)
    if args.duration is not None:
        trace = window(trace, args.start, args.start + args.duration)
    if args.limit:
        trace = trace[: args.limit]
    if args.time_scale != 1.0:
        trace = rescale_time(trace, args.time_scale)
    if args.prompt_scale != 1.0 or args.output_scale != 1.0 or args.max_prompt:
        trace = rescale_length(
            trace, args.prompt_scale, args.output_scale, max_prompt=args.max_prompt
        )
    return trace


def base_config(args: argparse.Namespace) -> Any:
    from routing.policy_config import PolicyConfig, load_config

    return load_config(args.policy_file) if args.policy_file else PolicyConfig()


def register(sub: Any) -> None:
    p = sub.add_parser("sim", help="simulate a trace on a fleet under routing policies")
    add_trace_args(p)
    p.add_argument("--policy", nargs="+", default=["latency"], help="policies to compare")
    p.add_argument("--json", default=None, help="also write the summaries here")
    p.add_argument(
        "--no-in-flight", action="store_true", help="ignore dispatches since the last NodeState"
    )
    p.add_argument(
        "--warm-prompts",
        type=int,
        nargs="+",
        default=[],
        metavar="TOKENS",
        help="nodes start reporting the rates they would after serving prompts of these "
        "lengths alone (default: they start cold, reporting nothing until they step)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import numpy as np

    from routing.sim.bounds import alone
    from routing.sim.fleet import load_fleet
    from routing.sim.metrics import Slo, node_table, policy_table, summarize
    from routing.sim.simulator import simulate
    from routing.sim.trace import summary

    trace = load_trace_args(args)
    fleet = load_fleet(args.fleet)
    cfg = base_config(args)
    slo = Slo(args.slo_ttft, args.slo_tpot)
    s = summary(trace)
    print(
        f"trace: {int(s['requests'])} requests over {s.get('span_s', 0):.0f} s; "
        f"fleet {fleet.name}: {len(fleet.expanded())} nodes"
    )
    out: dict[str, dict[str, float]] = {}
    results = {}
    for pol in args.policy:
        res = simulate(
            trace,
            fleet,
            cfg,
            policy=pol,
            seed=args.seed,
            push_interval_s=args.push_interval,
            count_in_flight=not args.no_in_flight,
            warm_prompts=args.warm_prompts,
        )
        out[pol] = summarize(res, slo)
        out[pol]["wall_s"] = res.wall_s
        results[pol] = res
        print(f"  {pol}: {res.events} events in {res.wall_s:.1f} s", flush=True)
    print()
    print(f"latency in seconds; SLO: TTFT <= {slo.ttft_s} s and <= {slo.tpot_s} s/token")
    print(policy_table(out))
    bound = alone(trace, fleet)
    floor = {
        "mean_e2e_s": float(np.nanmean(bound.e2e_s)),
        "p99_e2e_s": float(np.nanpercentile(bound.e2e_s, 99)),
        "p99_ttft_s": float(np.nanpercentile(bound.ttft_s, 99)),
    }
    print(
        "no policy beats (each request alone on its fastest node, shared prefixes cached): "
        + ", ".join(f"{k} {v:.3f}" for k, v in floor.items())
    )
    for pol, res in results.items():
        print(f"\n{pol}: per node")
        print(node_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**out, "alone": floor}, f, indent=2)
    return 0
