"""Robust statistics and least-squares fits the latency model learns a node's costs with.

Invariants: every fit answers None until its samples pin the terms down (enough of them, and
spread); older samples fade by ``decay`` per new one, so a fit follows a node that changes.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class RecentMedian:
    """The median of the last ``window`` samples: what a small cost usually is, which a
    one-off (a gateway's first request fetching its tokenizer: seconds) does not move."""

    window: int = 31
    samples: deque[float] = field(default_factory=deque)
    n: int = 0

    def add(self, x: float) -> None:
        self.samples.append(x)
        if len(self.samples) > self.window:
            self.samples.popleft()
        self.n += 1

    @property
    def value(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0


@dataclass(frozen=True, slots=True)
class _Centered:
    """Weighted means, variances and covariances of samples ``(x, z, y)``."""

    mx: float
    mz: float
    my: float
    vx: float
    vz: float
    cxz: float
    cxy: float
    czy: float

    def plane(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` of ``y = a + b x + c z`` by least squares, None where x and z are
        collinear."""
        det = self.vx * self.vz - self.cxz * self.cxz
        if det <= 1e-9 * self.vx * self.vz:
            return None
        b = (self.cxy * self.vz - self.czy * self.cxz) / det
        c = (self.czy * self.vx - self.cxy * self.cxz) / det
        return self.my - b * self.mx - c * self.mz, b, c


@dataclass(slots=True)
class PlaneMoments:
    """The running moments of samples ``(x, z, y)``, each older sample's weight multiplied by
    ``decay`` per new one: what a least-squares fit of ``y`` on ``x`` and ``z`` needs."""

    decay: float = 0.97
    n: int = 0
    m: list[float] = field(default_factory=lambda: [0.0] * 9)  # w, x, z, xx, xz, zz, y, xy, zy

    def add(self, x: float, z: float, y: float) -> None:
        d = self.decay
        terms = (1.0, x, z, x * x, x * z, z * z, y, x * y, z * y)
        self.m = [d * a + t for a, t in zip(self.m, terms, strict=True)]
        self.n += 1

    def centered(self) -> _Centered | None:
        w, sx, sz, sxx, sxz, szz, sy, sxy, szy = self.m
        if w <= 0:
            return None
        mx, mz, my = sx / w, sz / w, sy / w
        return _Centered(
            mx, mz, my, sxx / w - mx * mx, szz / w - mz * mz,
            sxz / w - mx * mz, sxy / w - mx * my, szy / w - mz * my,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """A decode step's cost as :class:`DecodeFit` found it: ``b1_ms`` for one row of no
    context, ``per_row_ms`` for each further row, ``per_context_ms`` for each token of context
    over all rows; ``slope_fitted`` is False where the batch never spread and ``per_row_ms``
    is the assumed slope's."""

    b1_ms: float
    per_row_ms: float
    per_context_ms: float
    slope_fitted: bool


@dataclass(slots=True)
class DecodeFit:
    """Decode ms per token ``y = a + b * (batch - 1) + c * context`` by least squares over
    exponentially forgotten samples, ``context`` being the tokens a step's rows attend to.

    ``solve`` fits the terms whose regressor spread (``min_spread_batch`` rows,
    ``min_spread_context`` tokens, standard deviations) over at least ``min_samples``: both,
    or the batch line (``c = 0``), or the context line over samples of one batch size, which
    says nothing of the slope (the assumed one then normalizes the intercept to batch 1); a
    negative context cost is dropped (``c = 0``); None while neither spread.
    """

    min_samples: int = 6
    min_spread_batch: float = 0.5
    min_spread_context: float = 64.0
    moments: PlaneMoments = field(default_factory=PlaneMoments)

    def add(self, extra_rows: float, context: float, y: float) -> None:
        self.moments.add(extra_rows, context, y)

    def solve(self, assumed_slope: float) -> DecodeCost | None:
        s = self.moments.centered() if self.moments.n >= self.min_samples else None
        if s is None:
            return None
        x_ok, z_ok = s.vx >= self.min_spread_batch**2, s.vz >= self.min_spread_context**2
        plane = s.plane() if x_ok and z_ok else None
        if plane is not None and plane[2] >= 0:
            return DecodeCost(*plane, True)
        if x_ok:
            b = s.cxy / s.vx
            return DecodeCost(s.my - b * s.mx, b, 0.0, True)
        if z_ok:
            c = max(0.0, s.czy / s.vz)
            b1 = (s.my - c * s.mz) / (1.0 + assumed_slope * max(0.0, s.mx))
            return DecodeCost(b1, b1 * assumed_slope, c, False)
        return None


@dataclass(slots=True)
class PrefillFit:
    """A prompt's own time to first token ``y = a + b * uncached + c * cached`` by least
    squares over exponentially forgotten samples: new tokens cost ``b`` each, and each cached
    token they attend to (and the engine walks: block tables, KV gathers) ``c``.

    A fit whose fixed cost lies beyond the cheapest prompt's whole time, either side, is an
    extrapolation of samples that do not pin it, and is not used; nor is a plane that charges a
    cached token more than a new one (attending to a token's KV costs less than computing it).
    ``solve`` answers once the uncached lengths spread over ``min_samples``; the cached
    term joins only once the cached lengths spread too (``c = 0`` until then, and whenever the
    fit would make it negative), so a node that never hits a prefix is fitted as a line.
    """

    min_samples: int = 4
    min_spread: float = 24.0  # tokens (standard deviation), for each regressor
    moments: PlaneMoments = field(default_factory=PlaneMoments)
    min_y: float = math.inf  # the cheapest prompt seen: no fixed cost can exceed it

    def add(self, uncached: float, cached: float, y: float) -> None:
        self.min_y = min(self.min_y, y)
        self.moments.add(uncached, cached, y)

    def solve(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` or None while the samples do not pin the per-token cost down."""
        s = self.moments.centered() if self.moments.n >= self.min_samples else None
        if s is None or s.vx < self.min_spread**2:
            return None
        plane = s.plane() if s.vz >= self.min_spread**2 else None
        if plane is not None and 0 <= plane[2] <= plane[1] and self._pinned(plane[0]):
            return plane
        b = s.cxy / s.vx  # no usable cached term: the line over the uncached lengths
        if not self._pinned(s.my - b * s.mx):
            return None
        return s.my - b * s.mx, b, 0.0

    def fixed_at(self, ms_per_token: float) -> float:
        """The fixed cost that puts a line of slope ``ms_per_token`` through the samples' mean,
        within ``[0, the cheapest prompt's time]``: what the samples say of a prompt's fixed
        cost while their lengths do not spread enough to fit the slope too (a GPU node that
        only gets short prompts: 25 ms measured for 30 tokens at 0.27 ms a token). 0 before
        ``min_samples``."""
        s = self.moments.centered() if self.moments.n >= self.min_samples else None
        if s is None:
            return 0.0
        return min(max(0.0, s.my - ms_per_token * s.mx), self.min_y)

    def _pinned(self, fixed_ms: float) -> bool:
        """A fixed cost within the cheapest prompt's whole time, either side."""
        return -self.min_y <= fixed_ms <= self.min_y
