"""What the engine core measures of its steps: :class:`CoreCounters` (totals and EWMA rates),
:func:`account_step`, which counts one collected batch into them and into the step-cost fit,
the KV slots left empty (:func:`kv_waste`), and the prompt tokens a step takes beside decode
rows at the measured rates (:func:`prefill_cut`).

A step's time ``dt`` is read-to-read: what it took beyond the previous collection, so a
look-ahead or pipelined step launched before that read is charged once. Each prompt chunk in a
step gets its share of the step (``Sequence.prefill_ms``): what the step took beyond the time
its decode rows alone take (the decode-only steps' average, at most half the step), split by
tokens. Nothing here touches a sequence's tokens or blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cloud_engine.scheduler import ScheduledBatch, Scheduler
from cloud_engine.sequence import Sequence
from routing.ewma import Ewma
from routing.prefill_budget import chunk_beside_decode
from routing.step_cost import StepCostFit


@dataclass(slots=True)
class CoreCounters:
    """Totals since start; rates are EWMAs of per-step measurements."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_prompt_tokens: int = 0  # of which served from the prefix cache
    prefill_tokens: int = 0  # prompt tokens actually computed (recompute included)
    recomputed_tokens: int = 0  # output tokens recomputed after a preemption
    decode_tokens: int = 0  # tokens sampled
    preemptions: int = 0
    ahead_steps: int = 0  # decode steps launched before the previous step's tokens were read
    prefill_tok_s: Ewma = field(default_factory=Ewma)
    decode_ms: Ewma = field(default_factory=Ewma)
    prefill_ms_per_token: Ewma = field(default_factory=Ewma)  # a prompt token's share of a step
    peak_blocks_used: int = 0
    kv_waste_at_peak: float = 0.0  # allocated slots holding no token / allocated slots


def account_step(
    c: CoreCounters,
    fit: StepCostFit,
    batch: ScheduledBatch,
    dt: float,
    at: float,
    scheduler: Scheduler,
) -> None:
    """Count the step ``batch`` that took ``dt`` seconds and was read at ``at``, give each
    prompt chunk in it its share of the step's time, and add the step to ``fit``."""
    c.steps += 1
    prefill = 0
    decoding = False
    chunks: list[tuple[Sequence, int]] = []
    rows = context = 0
    for it in batch.items:
        seq = it.seq
        context += it.start + it.num_new  # the KV it reads: its past and its new tokens
        if not seq.counted:  # first time in a batch: its first admission
            seq.counted = True
            c.prompt_tokens += seq.num_prompt
            c.cached_prompt_tokens += seq.num_cached
        prompt_part = max(0, min(it.num_new, seq.num_prompt - it.start))
        prefill += prompt_part
        if prompt_part:
            chunks.append((seq, prompt_part))
        elif it.num_new == 1 and it.samples:
            decoding = True
            rows += 1
        c.recomputed_tokens += max(0, it.num_new - prompt_part - (1 if it.samples else 0))
    c.prefill_tokens += prefill
    fit.add(rows, prefill, context, 1000.0 * dt, at)
    sampled = sum(1 for it in batch.items if it.samples)
    c.decode_tokens += sampled
    if prefill > 0:
        c.prefill_tok_s.add(prefill / dt)
        rows_ms = min(c.decode_ms.value, 500.0 * dt) if decoding else 0.0
        per_token_ms = (1000.0 * dt - rows_ms) / prefill
        for seq, n in chunks:
            seq.prefill_ms += n * per_token_ms
        c.prefill_ms_per_token.add(per_token_ms)
    elif sampled:
        c.decode_ms.add(dt * 1000.0)
    used = scheduler.blocks.num_used
    if used >= c.peak_blocks_used and used > 0:
        c.peak_blocks_used = used
        c.kv_waste_at_peak = kv_waste(scheduler)


def kv_waste(scheduler: Scheduler) -> float:
    """Share of the slots of in-use blocks that hold no token (now)."""
    blocks = scheduler.blocks
    used = blocks.num_used
    if used == 0:
        return 0.0
    bs = blocks.block_size
    empty = sum(
        len(s.block_table) * bs - s.num_computed for s in scheduler.running if s.block_table
    )
    return empty / (used * bs)


def prefill_cut(
    ratio: float | Literal["off"] | None, c: CoreCounters, fit: StepCostFit, scheduler: Scheduler
) -> int | None:
    """Prompt tokens a step takes while rows decode: ``ratio`` decode steps' worth at the
    measured rates (None or ``"off"``: None, the whole step budget)."""
    if ratio is None or ratio == "off":
        return None
    full = scheduler.config.max_tokens_per_step
    latest = fit.latest
    if latest is None:
        return chunk_beside_decode(full, ratio, c.decode_ms.value, c.prefill_ms_per_token.value)
    # the fitted step: a decode step of the rows running now, the marginal prompt token
    # (a short chunk's share of a step also carries the pass, which would shrink the cut
    # to its floor, and a small cut keeps the share high)
    running = scheduler.running
    decode_ms = latest.step_ms(len(running), 0, sum(s.num_computed for s in running))
    return chunk_beside_decode(full, ratio, decode_ms, latest.ms_per_prompt_token)
