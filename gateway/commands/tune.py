"""``edgecloud tune --trace T --fleet F --objective mean_e2e|p99_ttft|goodput --budget N``:
search the routing policy's knobs on the simulator (``routing.sim.tuner``, Optuna), write the
best policy YAML (what ``--policy-file`` loads and a running gateway hot-reloads) and a
report (markdown and PNG plots) comparing it with every baseline policy."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    from gateway.commands.sim import add_trace_args

    p = sub.add_parser("tune", help="tune the routing policy on a trace with the simulator")
    add_trace_args(p)
    p.add_argument(
        "--objective",
        choices=["mean_e2e", "p99_ttft", "goodput"],
        default="mean_e2e",
        help="what the search optimizes",
    )
    p.add_argument("--budget", type=int, default=50, help="trials")
    p.add_argument("--policies", nargs="+", default=["latency"], help="policies to search over")
    p.add_argument("--out", default="tuned_policy.yaml", help="the best policy YAML")
    p.add_argument("--report", default="tune_report", help="folder for report.md and plots")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from gateway.commands.sim import base_config, load_trace_args
    from routing.policy_config import POLICY_NAMES
    from routing.sim.fleet import load_fleet
    from routing.sim.metrics import Slo
    from routing.sim.report import write_report
    from routing.sim.trace import summary
    from routing.sim.tuner import policy_yaml, tune

    trace = load_trace_args(args)
    fleet = load_fleet(args.fleet)
    s = summary(trace)
    print(f"trace: {int(s['requests'])} requests over {s.get('span_s', 0):.0f} s")
    bar = tqdm(total=args.budget, desc=f"tuning {args.objective}", unit="trial")

    def progress(n: int, value: float, best: float) -> None:
        bar.set_postfix(value=f"{value:.4f}", best=f"{best:.4f}")
        bar.update(1)

    result = tune(
        trace,
        fleet,
        base_config(args),
        objective=args.objective,
        budget=args.budget,
        seed=args.seed,
        slo=Slo(args.slo_ttft, args.slo_tpot),
        policies=args.policies,
        baselines=POLICY_NAMES,
        progress=progress,
    )
    bar.close()
    Path(args.out).write_text(policy_yaml(result.best))
    report = write_report(
        result,
        Path(args.report),
        f"Tuning on {args.trace} ({fleet.name} fleet)",
        f"{int(s['requests'])} requests; fleet `{args.fleet}`; seed {args.seed}.",
    )
    print(f"default {result.default_value:.4f} -> tuned {result.best_value:.4f}")
    print(f"wrote {args.out} and {report}")
    return 0
