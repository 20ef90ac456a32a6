"""Node profiles: what one node's engine costs per step, measured on a live node
(``edgecloud profile --node URL``) or written by hand for hardware not at hand.

The simulator's step cost is::

    step_ms = overhead_ms
            + prefill(s + c) - prefill(s)             # a chunk of c prompt tokens after s cached
            + decode(rows, mean context of the rows)  # when any row decodes

``prefill(n)`` is the cumulative time to prefill ``n`` tokens from nothing (piecewise linear
through the measured points, extrapolated with the last segment's slope), so attention's growth
with position and prefix hits (start at ``s`` > 0) come out of one curve. ``decode`` is bilinear
in (batch rows, context) over the measured grid, clamped at its edges in context and
extrapolated linearly in rows.

Invariants: every point list is sorted and strictly positive; costs are finite and
non-negative; a profile round-trips through JSON unchanged.
"""

from __future__ import annotations

import bisect
import json
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PrefillPoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(gt=0)
    ms: float = Field(gt=0, description="time to prefill this many tokens from an empty cache")


class DecodePoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    batch: int = Field(gt=0)
    context: int = Field(gt=0)
    ms_per_step: float = Field(gt=0)


class NodeProfile(BaseModel):
    """One node kind's measured costs and limits."""

    model_config = ConfigDict(extra="forbid")

    name: str
    kind: Literal["edge", "cloud"]
    device: str = ""
    model: str = ""
    source: str = Field(default="measured", description="measured | estimated | synthetic")
    notes: str = ""
    slots: int = Field(gt=0, description="edge slots, or the cloud's max running sequences")
    chunk_tokens: int = Field(default=256, gt=0, description="edge prefill chunk")
    prefill_stall_ratio: float | None = Field(
        default=1.0,
        ge=0,
        description="a chunk beside decoding rows takes at most this many decode steps "
        "(routing.prefill_budget), on the edge and on a CPU cloud node; null: full chunks",
    )
    max_tokens_per_step: int = Field(default=1024, gt=0, description="cloud step token budget")
    kv_blocks: int = Field(default=0, ge=0, description="cloud KV pool (16-token blocks); 0: edge")
    max_context: int = Field(default=8192, gt=0)
    overhead_ms: float = Field(default=0.0, ge=0, description="per engine step")
    request_overhead_ms: float = Field(
        default=0.0, ge=0, description="per request at the node (HTTP, tokenizing)"
    )
    prefill: list[PrefillPoint] = Field(min_length=1)
    decode: list[DecodePoint] = Field(min_length=1)
    prefix_hit_speedup: float | None = Field(
        default=None, description="measured TTFT(cold) / TTFT(warm) for the profile's probe"
    )
    watts_idle: float | None = Field(default=None, ge=0, description="idle watts (null: unknown)")
    watts_load: float | None = Field(default=None, ge=0, description="watts when fully busy")
    measured_at: str = ""

    @model_validator(mode="after")
    def _sorted(self) -> NodeProfile:
        self.prefill = sorted(self.prefill, key=lambda p: p.tokens)
        self.decode = sorted(self.decode, key=lambda p: (p.context, p.batch))
        return self

    def cost_model(self) -> ProfileCost:
        return ProfileCost(self)

    @property
    def identity(self) -> tuple[str, str, str]:
        """What it measured: (kind, model, device); two providers of one model differ."""
        return (self.kind, self.model, self.device)


def profile_name(kind: str, model: str, device: str) -> str:
    """A profile's default name, e.g. ``edge-smollm2-135m-instruct-openvino-cpu``."""
    parts = (kind, model, device or "unknown-device")
    return "-".join(re.sub(r"[^a-z0-9.]+", "-", p.lower()).strip("-") for p in parts)


def load_profile(path: str | os.PathLike[str]) -> NodeProfile:
    return NodeProfile.model_validate_json(Path(path).read_text())


def save_profile(profile: NodeProfile, path: str | os.PathLike[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(profile.model_dump(), indent=2) + "\n")


class ProfileCost:
    """Fast evaluation of a measured profile's step costs (plain floats and lists; no pydantic on the hot path)."""

    def __init__(self, p: NodeProfile) -> None:
        self.overhead_ms = p.overhead_ms
        self._pt = [0] + [q.tokens for q in p.prefill]
        self._pm = [0.0] + [q.ms for q in p.prefill]
        # make the cumulative curve non-decreasing
        for i in range(1, len(self._pm)):
            self._pm[i] = max(self._pm[i], self._pm[i - 1])
        ctxs = sorted({q.context for q in p.decode})
        self._ctx = ctxs
        self._grid: list[tuple[list[int], list[float]]] = []
        for c in ctxs:
            pts = sorted((q.batch, q.ms_per_step) for q in p.decode if q.context == c)
            self._grid.append(([b for b, _ in pts], [m for _, m in pts]))
        self._cache: dict[tuple[int, int], float] = {}

    def prefill_ms(self, n: float) -> float:
        """Cumulative time to prefill ``n`` tokens from an empty cache."""
        if n <= 0:
            return 0.0
        pt, pm = self._pt, self._pm
        i = bisect.bisect_right(pt, n)
        if i >= len(pt):
            i = len(pt) - 1
        a, b = i - 1, i
        slope = (pm[b] - pm[a]) / max(1e-9, pt[b] - pt[a])
        return pm[a] + slope * (n - pt[a])

    def chunk_ms(self, start: float, tokens: float) -> float:
        """A chunk of ``tokens`` prompt tokens at positions ``start ..``."""
        return max(0.0, self.prefill_ms(start + tokens) - self.prefill_ms(start))

    @staticmethod
    def _rows(bs: list[int], ms: list[float], rows: int) -> float:
        if len(bs) == 1:
            return ms[0] * rows / bs[0] if rows > bs[0] else ms[0]
        i = bisect.bisect_left(bs, rows)
        if i < len(bs) and bs[i] == rows:
            return ms[i]
        if i == 0:
            return ms[0]
        if i >= len(bs):
            i = len(bs) - 1
        a, b = i - 1, i
        return ms[a] + (ms[b] - ms[a]) * (rows - bs[a]) / (bs[b] - bs[a])

    def decode_ms(self, rows: int, context: float) -> float:
        """One decode step of ``rows`` sequences at mean context ``context``."""
        if rows <= 0:
            return 0.0
        key = (rows, int(context) >> 6)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        ctx = self._ctx
        c = float(key[1] << 6)
        if c <= ctx[0] or len(ctx) == 1:
            v = self._rows(*self._grid[0], rows)
        elif c >= ctx[-1]:
            v = self._rows(*self._grid[-1], rows)
        else:
            i = bisect.bisect_right(ctx, c)
            a, b = i - 1, i
            va, vb = self._rows(*self._grid[a], rows), self._rows(*self._grid[b], rows)
            v = va + (vb - va) * (c - ctx[a]) / (ctx[b] - ctx[a])
        v = max(v, 1e-3)
        if len(self._cache) < 1 << 16:
            self._cache[key] = v
        return v
