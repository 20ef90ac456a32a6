"""Admission by prefix on a node whose kept KV lives in its slots (``edge_runtime.scheduler``
and the simulator's twin of it, ``routing.sim.edge.EdgeSim``).

Under a queue one slot frees at a time, and the request at the head of the queue would
overwrite the prefix the freed slot keeps, which a request behind it reuses (and was credited
with when the router sent it there). So a waiting request goes first when it reuses at least
``PREFIX_FIRST_MIN_BLOCKS`` more blocks of a free slot than every request ahead of it (longest
prefix match, as SGLang orders its queue).

Invariants:
- Only the first ``PREFIX_FIRST_WINDOW`` waiting requests are looked at.
- A request passed ``limit`` times is a barrier: nothing behind it goes first, so none starves.
- The candidates are read lazily, in queue order, and no further than the choice needs.
"""

from __future__ import annotations

from collections.abc import Iterable

# 64 prompt tokens, ~150 ms of a 2-core CPU edge's prefill: a block or two is not worth the order
PREFIX_FIRST_MIN_BLOCKS = 4
PREFIX_FIRST_WINDOW = 32


def prefix_first(candidates: Iterable[tuple[int, int]], limit: int) -> int:
    """The index of the waiting request to admit next, of ``candidates`` in queue order, each
    ``(blocks it reuses of a free slot, times it has been passed)``: 0 (the head) unless a
    later one, before any barrier, reuses ``PREFIX_FIRST_MIN_BLOCKS`` more than each before
    it; of several such, the last (it reuses the most)."""
    best, ahead_most = 0, -1  # the most blocks any request before the one scanned reuses
    for i, (blocks, passed) in enumerate(candidates):
        if i >= PREFIX_FIRST_WINDOW:
            break
        if i > 0 and blocks >= ahead_most + PREFIX_FIRST_MIN_BLOCKS:
            best = i
        ahead_most = max(ahead_most, blocks)
        if passed >= limit:  # nothing behind it goes first
            break
    return best
