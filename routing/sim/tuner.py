"""Search the routing policy's knobs on the simulator with Optuna (TPE, seeded).

The search space is the ``latency`` policy's knobs (what it minimizes, how much it weighs the
delay its prefill adds to others, what it assumes of output lengths before
it has measured them); with ``policies`` naming others,
the policy itself is searched too, with ``threshold.prompt_tokens`` and
``edge_first_max_load`` when those are in. Trial 0 is always the base config, so the best is
never worse than where the search started.

Invariants:
- Deterministic for a seed (sampler and simulator seeded; one process, sequential trials).
- Every trial builds a fresh ``PolicyConfig`` from the base with ``model_validate`` (so an
  invalid point can never be written), and a fresh simulator: nothing learned carries over.
- ``policy_yaml`` writes only what differs from the defaults; ``routing.policy_config`` loads
  it back to the same config.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from routing.policy_config import PolicyConfig, parse_config
from routing.sim.fleet import FleetSpec
from routing.sim.metrics import Slo, objective_value, summarize
from routing.sim.result import SimResult
from routing.sim.simulator import simulate
from routing.sim.trace import TraceRequest

OBJECTIVES = ("mean_e2e", "p99_ttft", "goodput")


def _set(d: dict[str, Any], path: str, value: Any) -> None:
    keys = path.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    d[keys[-1]] = value


def suggest(
    trial: Any, base: PolicyConfig, policies: Sequence[str]
) -> tuple[PolicyConfig, dict[str, Any]]:
    """One point of the search space, as a config and its flat parameters."""
    data = base.model_dump(mode="json")
    params: dict[str, Any] = {}

    def put(path: str, value: Any) -> None:
        _set(data, path, value)
        params[path] = value

    policy = (
        trial.suggest_categorical("policy", list(policies)) if len(policies) > 1 else policies[0]
    )
    put("policy", policy)
    if policy == "latency":
        put("objective", trial.suggest_categorical("objective", ["auto", "e2e", "ttft"]))
        put(
            "interference_weight",
            trial.suggest_float("interference_weight", 0.0, 4.0),
        )
        put(
            "expected_output.default_tokens",
            trial.suggest_float("expected_output.default_tokens", 8.0, 512.0, log=True),
        )
        put("expected_output.alpha", trial.suggest_float("expected_output.alpha", 0.05, 0.8))
    elif policy == "threshold":
        put(
            "threshold.prompt_tokens",
            trial.suggest_int("threshold.prompt_tokens", 16, 4096, log=True),
        )
    elif policy == "edge_first":
        put("edge_first_max_load", trial.suggest_float("edge_first_max_load", 0.1, 3.0))
    return PolicyConfig.model_validate(data), params


def policy_yaml(cfg: PolicyConfig) -> str:
    """The YAML a gateway loads (``--policy-file``), with only the non-default knobs."""
    data = cfg.model_dump(mode="json", exclude_defaults=True)
    text = yaml.safe_dump(data, sort_keys=True)
    assert parse_config(text) == cfg
    return text


@dataclass
class TrialRecord:
    number: int
    value: float
    params: dict[str, Any]
    summary: dict[str, float]


@dataclass
class TuneResult:
    objective: str
    best: PolicyConfig
    best_value: float
    default_value: float
    trials: list[TrialRecord]
    baselines: dict[str, dict[str, float]]
    baseline_results: dict[str, SimResult] = field(repr=False, default_factory=dict)
    tuned_result: SimResult | None = field(repr=False, default=None)
    tuned_summary: dict[str, float] = field(default_factory=dict)


def tune(
    trace: Sequence[TraceRequest],
    fleet: FleetSpec,
    base: PolicyConfig,
    *,
    objective: str = "mean_e2e",
    budget: int = 50,
    seed: int = 0,
    slo: Slo = Slo(),
    policies: Sequence[str] = ("latency",),
    baselines: Sequence[str] = (),
    progress: Callable[[int, float, float], None] | None = None,
) -> TuneResult:
    """Run the baselines, then ``budget`` trials; returns the best config and every record."""
    import optuna

    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def run(cfg: PolicyConfig) -> tuple[float, dict[str, float], SimResult]:
        res = simulate(trace, fleet, cfg, seed=seed)
        s = summarize(res, slo)
        return objective_value(s, objective), s, res

    base_results: dict[str, SimResult] = {}
    base_summaries: dict[str, dict[str, float]] = {}
    for name in baselines:
        _, s, res = run(base.model_copy(update={"policy": name}))
        base_summaries[name], base_results[name] = s, res

    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, budget // 4)))
    study = optuna.create_study(direction="minimize", sampler=sampler)
    start: dict[str, Any] = {"policy": policies[0]} if len(policies) > 1 else {}
    b = base if base.policy in policies else base.model_copy(update={"policy": policies[0]})
    if b.policy == "latency":
        start.update(
            {
                "objective": b.objective,
                "interference_weight": min(4.0, b.interference_weight),
                "expected_output.default_tokens": b.expected_output.default_tokens,
                "expected_output.alpha": b.expected_output.alpha,
            }
        )
    study.enqueue_trial(start)
    records: list[TrialRecord] = []
    results: dict[int, SimResult] = {}
    configs: dict[int, PolicyConfig] = {}
    best = [math.inf]

    def objective_fn(trial: Any) -> float:
        cfg, params = suggest(trial, b, policies)
        value, s, res = run(cfg)
        records.append(TrialRecord(trial.number, value, params, s))
        configs[trial.number] = cfg
        if value < best[0]:
            best[0] = value
            results.clear()
            results[trial.number] = res
        if progress is not None:
            progress(trial.number, value, best[0])
        return value

    study.optimize(objective_fn, n_trials=budget)
    bt = study.best_trial.number
    tuned = configs[bt]
    return TuneResult(
        objective=objective,
        best=tuned,
        best_value=study.best_value,
        default_value=records[0].value,
        trials=records,
        baselines=base_summaries,
        baseline_results=base_results,
        tuned_result=results.get(bt),
        tuned_summary=copy.deepcopy(next(r.summary for r in records if r.number == bt)),
    )
