"""An engine's step time, fitted by least squares on the steps it ran.

The cloud engine runs one forward pass per step over whatever the step holds (decode rows and
prompt chunks), so what the router needs is the pass itself, not per-request rates inferred
from end-to-end timings: :class:`StepCostFit` keeps the last ``window`` steps' composition and
time and fits :class:`routing.fleet.state.StepCost` on them, which the node publishes in its
NodeState.

Invariants:
- :meth:`StepCostFit.solve` gives a cost only when the window holds ``min_steps`` steps whose
  decode rows and prompt tokens both spread (otherwise the two cannot be told from the pass):
  None until then.
- Every term of the cost is non-negative: a term fitted negative is dropped (fixed at 0) and
  the rest refitted; the context term is dropped while the contexts do not spread; a fit
  whose prompt tokens cost nothing is no fit (None).
- The fit follows the load: it is taken over the steps of the last ``horizon_s`` seconds (at
  least the last ``min_steps``), since what a step costs moves with what else the machine
  runs; where those steps do not spread (a batch decoding at one size for longer than the
  horizon) over the whole ``window``; and ``latest`` keeps the last fit while neither spreads.
- ``add`` is O(1) but for a refit at most every ``refit_every_s`` seconds of the steps'
  clock (``solve``: one small least-squares fit over the window, about 0.2 ms at 512 steps),
  so the cost per step shrinks as steps get shorter (a GPU's 1 ms decode steps pay it once in
  hundreds), in the engine's own thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from routing.fleet.state import StepCost

# columns of the design matrix: the pass (intercept), rows, prompt tokens, context
_PASS, _ROWS, _TOKENS, _CONTEXT = range(4)


@dataclass(slots=True)
class StepCostFit:
    """The last ``window`` steps as ``(rows, prompt tokens, context, ms)`` and their fit."""

    window: int = 512
    horizon_s: float = 10.0
    min_steps: int = 24
    min_spread_rows: float = 0.3  # standard deviations over the window
    min_spread_tokens: float = 4.0
    min_spread_context: float = 64.0
    refit_every_s: float = 0.25
    steps: deque[tuple[float, float, float, float, float]] = field(init=False)  # ..., ms, at
    latest: StepCost | None = None  # the last fit (swapped whole: safe to read from any thread)
    _fitted_at: float = float("-inf")

    def __post_init__(self) -> None:
        self.steps = deque(maxlen=self.window)

    def add(self, rows: int, prompt_tokens: int, context: int, ms: float, at: float) -> None:
        """Record one step that took ``ms`` and ended at ``at`` (seconds, any monotonic clock);
        refit ``latest`` when the last fit is ``refit_every_s`` old."""
        if ms <= 0:
            return
        self.steps.append((float(rows), float(prompt_tokens), float(context), ms, at))
        if at - self._fitted_at >= self.refit_every_s:
            self._fitted_at = at
            self.latest = self.solve() or self.latest

    def solve(self) -> StepCost | None:
        """The fit over the steps of the last ``horizon_s``, or over the whole window where
        those do not spread (a batch decoding at one size for longer than the horizon); None
        where neither does."""
        if len(self.steps) < self.min_steps:
            return None
        data = np.asarray(self.steps, dtype=np.float64)
        recent = int(np.searchsorted(data[:, 4], data[-1, 4] - self.horizon_s))
        return self._fit(data[min(recent, len(data) - self.min_steps) :]) or (
            self._fit(data) if recent > 0 else None
        )

    def _fit(self, data: np.ndarray) -> StepCost | None:
        x, y = data[:, :3], data[:, 3]
        spread = x.std(axis=0)
        if spread[0] < self.min_spread_rows or spread[1] < self.min_spread_tokens:
            return None
        design = np.column_stack([np.ones(len(y)), x])
        free = [_PASS, _ROWS, _TOKENS] + (
            [_CONTEXT] if spread[2] >= self.min_spread_context else []
        )
        coef = np.zeros(4)
        while free:
            sol, *_ = np.linalg.lstsq(design[:, free], y, rcond=None)
            worst = int(np.argmin(sol))
            if sol[worst] >= 0:
                coef[free] = sol
                break
            del free[worst]  # a negative term: fixed at 0, the others refitted
        if coef[_TOKENS] <= 0:  # a prompt token costing nothing: the fit is not usable
            return None
        return StepCost(
            pass_ms=float(coef[_PASS]),
            ms_per_row=float(coef[_ROWS]),
            ms_per_prompt_token=float(coef[_TOKENS]),
            ms_per_context_token=float(coef[_CONTEXT]),
            steps=len(y),
        )
