"""The step cost an engine fits on its own steps, and the replay of steps with a fixed pass:
hand-computed cases."""

from __future__ import annotations

import random

import pytest

from routing.fleet.state import StepCost
from routing.step_cost import StepCostFit


def fed(
    fit: StepCostFit,
    cost: StepCost,
    n: int,
    seed: int = 0,
    rows: tuple[int, ...] = (0, 1, 2, 3),
    at: float = 0.0,
) -> StepCostFit:
    """``n`` steps of random composition from ``at`` s, 10 ms apart, each costing what
    ``cost`` says."""
    rng = random.Random(seed)
    for i in range(n):
        r = rng.choice(rows)
        tokens = rng.choice([0, 16, 16, 300]) if r else rng.choice([20, 100, 700])
        context = rng.randrange(50, 3000)
        fit.add(r, tokens, context, cost.step_ms(r, tokens, context), at + 0.01 * i)
    return fit


TRUE = StepCost(pass_ms=45.0, ms_per_row=4.0, ms_per_prompt_token=3.0,
                ms_per_context_token=0.03, steps=0)  # fmt: skip


def test_the_fit_gives_back_the_cost_of_the_steps():
    fit = fed(StepCostFit(), TRUE, 600)
    got = fit.latest
    assert got is not None and got.steps == 512  # the window
    assert (got.pass_ms, got.ms_per_row) == (pytest.approx(45.0), pytest.approx(4.0))
    assert got.ms_per_prompt_token == pytest.approx(3.0)
    assert got.ms_per_context_token == pytest.approx(0.03)


def test_no_fit_before_enough_steps_or_while_the_rows_do_not_spread():
    assert fed(StepCostFit(), TRUE, 23).solve() is None  # min_steps 24
    # every step one row: a row cannot be told from the pass
    assert fed(StepCostFit(), TRUE, 200, rows=(1,)).solve() is None
    assert fed(StepCostFit(), TRUE, 200, rows=(1, 2)).solve() is not None


def test_the_fit_follows_the_load_over_its_horizon():
    # 400 steps at one cost, then 40 at a slower one 30 s later: only the recent ones count
    slow = TRUE.model_copy(update={"pass_ms": 10.0, "ms_per_row": 40.0})
    fit = fed(fed(StepCostFit(horizon_s=20.0), TRUE, 400), slow, 40, seed=1, at=30.0)
    got = fit.solve()
    assert got is not None and got.steps == 40
    assert (got.pass_ms, got.ms_per_row) == (pytest.approx(10.0), pytest.approx(40.0))
    # fewer recent steps than min_steps: the last min_steps, older ones among them
    assert fed(fed(StepCostFit(), TRUE, 400), slow, 10, at=30.0).solve().steps == 24


def test_a_term_fitted_negative_is_dropped_and_the_rest_refitted():
    # steps that get cheaper with context (noise, another process): no negative cost
    fit = StepCostFit()
    rng = random.Random(1)
    for _ in range(300):
        r, tokens, context = rng.choice([0, 1, 2]), rng.choice([16, 200]), rng.randrange(0, 3000)
        fit.add(r, tokens, context, 30.0 + 5.0 * r + 2.0 * tokens - 0.002 * context, 0.0)
    got = fit.solve()
    assert got is not None and got.ms_per_context_token == 0.0
    assert got.ms_per_prompt_token == pytest.approx(2.0, rel=0.05)


def test_a_batch_decoding_at_one_size_keeps_the_fit():
    # mixed steps, then 40 s of decode steps at 12 rows only: the recent ones cannot tell a row
    # from the pass, so the whole window answers (and the last fit stays)
    fit = fed(StepCostFit(horizon_s=10.0), TRUE, 200)
    for i in range(100):
        fit.add(12, 0, 14_400, TRUE.step_ms(12, 0, 14_400), 1.0 + 0.4 * i)
    got = fit.solve()
    assert got is not None and got.steps == 300
    assert got.ms_per_row == pytest.approx(4.0) and fit.latest is not None
    assert fit.latest.step_ms(12, 0, 14_400) == pytest.approx(TRUE.step_ms(12, 0, 14_400))
