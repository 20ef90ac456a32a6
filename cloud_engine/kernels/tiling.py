"""How the paged-attention kernel cuts a ragged batch into tiles (pure numpy: no Triton).

A tile is one sequence and ``block_q`` of its query tokens, times the ``g_pad`` query heads that
share one kv head: ``block_q * g_pad`` rows of one matrix product (at least 16, the smallest
tensor-core tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True, slots=True)
class TileShape:
    block_q: int  # query tokens per tile
    g_pad: int  # query heads per kv head, padded to a power of two
    block_n: int = 64  # keys per inner iteration


def tile_shape(group: int, max_q_len: int) -> TileShape:
    """Decode steps: one token per tile, heads padded to 16 rows. Prefill: 64 rows per tile."""
    g_pad = next_power_of_2(group)
    if max_q_len == 1:
        return TileShape(1, max(16, g_pad))
    return TileShape(max(1, 64 // g_pad), g_pad)


def make_tiles(q_start: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tile_seq, tile_q0)``: every sequence's query tokens cut into ``block_q`` tiles."""
    q_len = np.diff(q_start.astype(np.int64))
    n_tiles = -(-q_len // block_q)
    tile_seq = np.repeat(np.arange(len(q_len), dtype=np.int32), n_tiles)
    first = np.cumsum(n_tiles) - n_tiles
    local = np.arange(int(n_tiles.sum())) - np.repeat(first, n_tiles)
    return tile_seq, (local * block_q).astype(np.int32)
