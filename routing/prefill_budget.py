"""How many prompt tokens a slot engine prefills between two decode steps.

A loop of the edge engine runs one prefill chunk, then one decode step of every decoding row.
With nobody decoding the chunk is the full ``prefill_chunk``; while rows decode, each chunk
delays all of them, so it is cut to what takes at most ``stall_ratio`` decode steps: a request
then decodes at between one and ``1 + stall_ratio`` step times per token whatever arrives after
it, which is what lets a router predict its end (see ``routing.backlog``). The edge scheduler,
the simulator's edge node and the router's replay all size chunks with this one rule.

Invariants: the result lies in ``[min(MIN_CHUNK, prefill_chunk), prefill_chunk]``; with no
ratio, or no measured step time or prefill rate yet, it is ``prefill_chunk``.
"""

from __future__ import annotations

MIN_CHUNK = 16  # prompt tokens; below this a chunk's fixed cost dominates on a CPU


def chunk_beside_decode(
    prefill_chunk: int,
    stall_ratio: float | None,
    decode_step_ms: float,
    prefill_ms_per_token: float,
) -> int:
    """The chunk to run while rows decode: ``stall_ratio`` decode steps' worth of prompt
    tokens at the measured prefill rate, within ``[MIN_CHUNK, prefill_chunk]``."""
    full = max(1, prefill_chunk)
    if stall_ratio is None or decode_step_ms <= 0 or prefill_ms_per_token <= 0:
        return full
    fits = int(stall_ratio * decode_step_ms / prefill_ms_per_token)
    return max(min(MIN_CHUNK, full), min(full, fits))
