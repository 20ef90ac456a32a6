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

from routing.blocks import BLOCK_SIZE

# prompt tokens, one KV block; below this a chunk's fixed cost dominates on a CPU
MIN_CHUNK = BLOCK_SIZE


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


def short_chunk_extra_ms(chunk: float, prefill_chunk: int, run_ms: float) -> float:
    """What a chunk of ``chunk`` tokens costs beyond ``chunk`` tokens at a full chunk's
    per-token rate: the share of one run's fixed cost (``run_ms``) the full chunk would have
    spread over the tokens this one lacks."""
    full = max(1, prefill_chunk)
    if chunk >= full or run_ms <= 0:
        return 0.0
    return run_ms * (1.0 - max(0.0, chunk) / full)
