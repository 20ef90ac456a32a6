"""One JSONL trace format for every source (imported traces, generated ones, the simulator's
input), and rescaling in time and in length.

Invariants:
- A trace is a list of :class:`TraceRequest` sorted by ``arrival_s`` (seconds from the start,
  non-negative); :func:`read_trace` sorts stably and :func:`write_trace` writes one JSON object
  a line in that order.
- A request's prompt is described without text: ``prompt_tokens`` tokens, of which the leading
  ones may be shared with other requests, either as ``prefix_group`` + ``prefix_tokens`` (every
  request of the group starts with the same ``prefix_tokens`` tokens) or as ``hash_ids`` of
  ``hash_block_tokens``-token blocks (Mooncake style: equal ids at the same position mean the
  same prefix up to and including that block). Both may be given; ``hash_ids`` win.
- ``output_tokens`` is what the request actually generated (``<= max_tokens`` when set).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from routing.blocks import BLOCK_SIZE


class TraceRequest(BaseModel):
    """One request of a trace (no prompt text)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arrival_s: float = Field(ge=0)
    prompt_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1, description="tokens it actually generated")
    max_tokens: int | None = Field(default=None, ge=1)
    region: str = "local"
    api_key: str = "trace"
    route: str = "chat"
    stream: bool = True
    kind: str = Field(default="", description="request class (chat, code, automation, ...)")
    prefix_group: str | None = None
    prefix_tokens: int = Field(default=0, ge=0)
    hash_ids: list[int] | None = None
    hash_block_tokens: int = Field(default=512, ge=BLOCK_SIZE)

    @model_validator(mode="after")
    def _check(self) -> TraceRequest:
        if self.max_tokens is not None and self.output_tokens > self.max_tokens:
            raise ValueError("output_tokens exceeds max_tokens")
        if self.prefix_tokens > self.prompt_tokens:
            raise ValueError("prefix_tokens exceeds prompt_tokens")
        if self.hash_block_tokens % BLOCK_SIZE:
            raise ValueError(f"hash_block_tokens must be a multiple of {BLOCK_SIZE}")
        return self


def read_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    """Read a JSONL trace (blank lines skipped), sorted by arrival (stable)."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(TraceRequest.model_validate_json(line))
    out.sort(key=lambda r: r.arrival_s)
    return out


def write_trace(path: str | os.PathLike[str], requests: Iterable[TraceRequest]) -> int:
    """Write ``requests`` (sorted by arrival) as JSONL; returns the count."""
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        for r in reqs:
            f.write(json.dumps(r.model_dump(exclude_defaults=True)) + "\n")
    return len(reqs)


def rescale_time(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Arrival times multiplied by ``factor`` (> 1 spreads the trace out: less load)."""
    if factor <= 0:
        raise ValueError("factor must be positive")
    t0 = requests[0].arrival_s if requests else 0.0
    return [r.model_copy(update={"arrival_s": (r.arrival_s - t0) * factor}) for r in requests]


def rescale_length(
    requests: Sequence[TraceRequest],
    prompt_factor: float = 1.0,
    output_factor: float = 1.0,
    *,
    max_prompt: int | None = None,
    max_output: int | None = None,
) -> list[TraceRequest]:
    """Prompt and output lengths scaled (and capped), shared prefixes scaled alike.

    Block structure is kept: ``hash_block_tokens`` scales too (rounded to whole blocks of
    ``BLOCK_SIZE``, at least one), so a shared block stays shared.
    """
    out = []
    for r in requests:
        p = max(1, round(r.prompt_tokens * prompt_factor))
        if max_prompt is not None:
            p = min(p, max_prompt)
        o = max(1, round(r.output_tokens * output_factor))
        if max_output is not None:
            o = min(o, max_output)
        mt = r.max_tokens
        if mt is not None:
            mt = max(o, round(mt * output_factor))
            if max_output is not None:
                mt = max(o, min(mt, max_output))
        upd: dict[str, object] = {"prompt_tokens": p, "output_tokens": o, "max_tokens": mt}
        upd["prefix_tokens"] = min(p, round(r.prefix_tokens * prompt_factor))
        if r.hash_ids is not None:
            bt = max(
                BLOCK_SIZE, BLOCK_SIZE * round(r.hash_block_tokens * prompt_factor / BLOCK_SIZE)
            )
            upd["hash_block_tokens"] = bt
            upd["hash_ids"] = r.hash_ids[: max(1, math.ceil(p / bt))]
        out.append(r.model_copy(update=upd))
    return out


def window(requests: Sequence[TraceRequest], start_s: float, end_s: float) -> list[TraceRequest]:
    """Requests arriving in ``[start_s, end_s)``, re-based to start at 0."""
    sel = [r for r in requests if start_s <= r.arrival_s < end_s]
    return [r.model_copy(update={"arrival_s": r.arrival_s - start_s}) for r in sel]


def summary(requests: Sequence[TraceRequest]) -> dict[str, float]:
    """Counts and sums (for tests and reports)."""
    if not requests:
        return {"requests": 0}
    return {
        "requests": len(requests),
        "span_s": requests[-1].arrival_s - requests[0].arrival_s,
        "prompt_tokens": sum(r.prompt_tokens for r in requests),
        "output_tokens": sum(r.output_tokens for r in requests),
        "rate_per_s": len(requests) / max(1e-9, requests[-1].arrival_s - requests[0].arrival_s),
    }
