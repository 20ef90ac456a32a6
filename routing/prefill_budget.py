"""How many prompt tokens a slot engine prefills between two decode steps.

A loop of the edge engine runs one prefill chunk, then one decode step of every decoding row.
With nobody decoding the chunk is the full ``prefill_chunk``; while rows decode, each chunk
delays all of them, so it is cut to what takes at most ``stall_ratio`` decode steps: a request
then decodes at between one and ``1 + stall_ratio`` step times per token whatever arrives after
it, which is what lets a router predict its end (see ``routing.backlog``). The edge scheduler,
the simulator's edge node and the router's replay all size chunks with this one rule.

A short chunk is dearer per token: each run of the graph streams the weights once (about one
decode step of one row on a CPU), which a full chunk spreads over all its tokens. Costs taken
from whole prompts (a profile's full chunks: the simulator's edge) carry that cost already;
:func:`short_chunk_extra_ms` is what a shorter chunk adds beyond its tokens' share
(``bench/edge_chunk_cost.py``: 16-token chunks cost 1.3-1.5x a 256-token one per token). The
router's rates are fitted on what the node says each prompt took, short chunks included, so
its replay adds nothing.

Chunks beside decoding rows are whole multiples of ``MIN_CHUNK`` (one KV block): a prompt's
chunks then start on block boundaries (as a cached prefix ends on one), so however the load
cuts a prompt, each token is computed in the same place within its chunk's rows, which some
int8 kernels need to give the same logits (``edge_runtime.quantize``: rows in groups of 4).

Invariants: the chunk lies in ``[min(MIN_CHUNK, prefill_chunk), prefill_chunk]``, a multiple
of ``MIN_CHUNK`` when shorter than ``prefill_chunk``; with no
ratio, or no measured step time or prefill rate yet, it is ``prefill_chunk``; the extra cost is
0 for a full chunk and at most ``run_ms``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_CHUNK = 16  # prompt tokens; below this a chunk's fixed cost dominates on a CPU


def chunk_beside_decode(
    prefill_chunk: int,
    stall_ratio: float | None,
    decode_step_ms: float,
    prefill_ms_per_token: float,
) -> int:
    """The chunk to run while rows decode: ``stall_ratio`` decode steps' worth of prompt
    tokens at the measured prefill rate, rounded down to whole blocks of ``MIN_CHUNK``, within
    ``[MIN_CHUNK, prefill_chunk]``."""
    full = max(1, prefill_chunk)
    if stall_ratio is None or decode_step_ms <= 0 or prefill_ms_per_token <= 0:
        return full
    fits = int(stall_ratio * decode_step_ms / prefill_ms_per_token)
    if fits >= full:
        return full
    return max(min(MIN_CHUNK, full), fits // MIN_CHUNK * MIN_CHUNK)


def steps_per_chunk(
    prefill_chunk: int,
    stall_ratio: float | None,
    decode_step_ms: float,
    prefill_ms_per_token: float,
) -> float:
    """Decode steps per chunk beside decoding rows that keep the stall within ``stall_ratio``
    decode steps on average where even one ``MIN_CHUNK`` block takes longer (a block every
    that many steps; a CPU edge's 16-token block can take three of its decode steps): 1 where
    a block fits, with no ratio, or before rates are measured."""
    full = max(1, prefill_chunk)
    if (
        stall_ratio is None
        or stall_ratio <= 0
        or decode_step_ms <= 0
        or prefill_ms_per_token <= 0
        or full <= MIN_CHUNK
    ):
        return 1.0
    return max(1.0, MIN_CHUNK * prefill_ms_per_token / (stall_ratio * decode_step_ms))


@dataclass
class BlockPacer:
    """When a spaced engine runs its next block beside decoding rows: one every ``every``
    decode steps (:func:`steps_per_chunk`) on average, the remainder carried over; the first
    at once. ``since`` counts decode steps since the last block; ``reset`` whenever no prompt
    prefills beside decoding rows. The edge scheduler and the simulator's edge share it."""

    since: float = math.inf

    def due(self, every: float) -> bool:
        """Whether this loop runs its block (else only its decode step); counts the step."""
        due = self.since >= every
        if due:
            self.since = min(self.since, every) - every
        self.since += 1.0
        return due

    def reset(self) -> None:
        self.since = math.inf


def short_chunk_extra_ms(chunk: float, prefill_chunk: int, run_ms: float) -> float:
    """What a chunk of ``chunk`` tokens costs beyond ``chunk`` tokens at a full chunk's
    per-token rate: the share of one run's fixed cost (``run_ms``) the full chunk would have
    spread over the tokens this one lacks."""
    full = max(1, prefill_chunk)
    if chunk >= full or run_ms <= 0:
        return 0.0
    return run_ms * (1.0 - max(0.0, chunk) / full)
