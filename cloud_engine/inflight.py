"""Batches launched and not yet collected: :class:`Launch`, what is kept of one when it is read
(:func:`live`), and the look-ahead decode step planned before the current one is read
(:func:`plan_ahead`).

Overlap (``EngineConfig.overlap``): when every running sequence sampled in the step just
launched and nobody waits, the core launches the next decode step *before* reading this one's
tokens, its input ids fed on the device from the tokens not yet read (:class:`runner.Feed`), so
the host's commit and planning hide behind the device's work. The look-ahead step is exactly
the batch the scheduler would plan (every running sequence, one token, same order), minus the
sequences that end by length; a sequence that turns out to stop on a stop token (or is aborted)
still runs in it, and its result is dropped (:func:`live`). A look-ahead batch with a grammar
row is launched pending (``runner.Launched.pending``): its forward pass is enqueued, its masks
and sampling only at the start of the next step, once this step's tokens are committed to the
grammar states, so the masks are computed while the device runs that forward pass. It never
preempts: if the pool cannot hold every next token, the core falls back to a planned step.
Blocks and rows a dropped sequence released are safe to reuse at once: every later write to
them is enqueued after the look-ahead step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cloud_engine.block_manager import BlockManager
from cloud_engine.runner import Launched
from cloud_engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from cloud_engine.sequence import SeqStatus
from routing.engine import TokenLogprob


@dataclass(slots=True)
class Launch:
    batch: ScheduledBatch
    launched: Launched
    t0: float  # perf_counter just before the launch


Lps = list[TokenLogprob | None] | None


def live(
    batch: ScheduledBatch, sampled: list[int], lps: Lps = None
) -> tuple[ScheduledBatch, list[int], Lps]:
    """The items of ``batch`` whose sequence still runs, and their sampled tokens and
    logprobs (a look-ahead step may carry sequences that stopped or were aborted after it was
    launched)."""
    if all(it.seq.status is SeqStatus.RUNNING for it in batch.items):
        return batch, sampled, lps
    items: list[ScheduledSeq] = []
    tokens: list[int] = []
    kept: list[TokenLogprob | None] = []
    k = 0
    for it in batch.items:
        if it.samples:
            k += 1
        if it.seq.status is SeqStatus.RUNNING:
            items.append(it)
            if it.samples:
                tokens.append(sampled[k - 1])
                kept.append(lps[k - 1] if lps is not None else None)
    return ScheduledBatch(items), tokens, (kept if lps is not None else None)


def plan_ahead(
    cur: Launch, scheduler: Scheduler, blocks: BlockManager
) -> tuple[ScheduledBatch, np.ndarray] | None:
    """The decode step after ``cur``, planned before ``cur``'s tokens are read, with the
    index of each item's input token among ``cur``'s sampled tokens; None where it would not
    be what the scheduler plans. The blocks its tokens need are allocated here."""
    if scheduler.num_waiting:
        return None
    items: list[ScheduledSeq] = []
    src: list[int] = []
    grow: list[int] = []  # blocks each item's next token needs
    live_seqs = k = 0
    bs = blocks.block_size
    for it in cur.batch.items:
        if not it.samples:
            continue
        k += 1
        seq = it.seq
        if seq.status is not SeqStatus.RUNNING:
            continue
        live_seqs += 1
        if seq.num_output + 1 >= seq.max_output:
            continue  # cur's token is its last
        start = it.start + it.num_new
        items.append(ScheduledSeq(seq, 1, start, True))
        src.append(k - 1)
        grow.append(max(0, -(-(start + 1) // bs) - len(seq.block_table)))
    if not items or live_seqs != scheduler.num_running:
        return None
    if sum(grow) > blocks.num_available:
        return None
    for ahead, n in zip(items, grow, strict=True):
        if n:
            ahead.seq.block_table.extend(blocks.allocate(n))
    return ScheduledBatch(items), np.asarray(src, dtype=np.int64)
