"""Flatten a scheduled batch into the host arrays one forward pass needs.

All sequences' new tokens are concatenated into one ragged batch of ``N`` tokens (the model runs
it as ``[1, N]``); per-sequence ranges are given by ``q_start`` (cumulative, ``S + 1`` entries).

Invariants: for token ``j`` of sequence ``s`` (absolute position ``p``),
``slot_mapping[j] = block_table[p // block_size] * block_size + p % block_size``, and
``seq_lens[s]`` is the sequence's KV length once this step's tokens are written, so a query at
position ``p`` attends to keys ``0..p`` of its own sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cloud_engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepInputs:
    input_ids: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    slot_mapping: np.ndarray  # [N] int64
    q_start: np.ndarray  # [S + 1] int32
    seq_lens: np.ndarray  # [S] int32
    sample_idx: np.ndarray  # [M] int64: row of N whose logits sample, one per sampling item
    sample_items: list[int]  # which items (index into batch.items) sample, in order
    max_q_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def build_step_inputs(
    batch: ScheduledBatch, block_size: int, feed_src: np.ndarray | None = None
) -> StepInputs:
    """``feed_src``: a decode batch whose input ids are not known on the host yet; its
    ``input_ids`` then hold these indices into the fed tokens (``runner.Feed``)."""
    items = batch.items
    s = len(items)
    q_start = np.zeros(s + 1, dtype=np.int32)
    seq_lens = np.empty(s, dtype=np.int32)
    if batch.is_decode_only:  # fast path: one token per sequence, no numpy per item
        ids, pos, slots = [], [], []
        for i, it in enumerate(items):
            p = it.start
            seq = it.seq
            if feed_src is None:
                ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
            seq_lens[i] = p + 1
        q_start[1:] = np.arange(1, s + 1, dtype=np.int32)
        positions = np.asarray(pos, dtype=np.int64)
        return StepInputs(
            np.asarray(ids, dtype=np.int64) if feed_src is None else feed_src,
            positions,
            np.asarray(slots, dtype=np.int64),
            q_start,
            seq_lens,
            np.arange(s, dtype=np.int64),
            list(range(s)),
            1,
        )
    assert feed_src is None, "only a decode batch is fed"
    id_parts, pos_parts, slot_parts = [], [], []
    sample_idx: list[int] = []
    sample_items: list[int] = []
    n = 0
    max_q = 0
    for i, it in enumerate(items):
        seq, a, k = it.seq, it.start, it.num_new
        p = np.arange(a, a + k, dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        id_parts.append(np.asarray(seq.token_ids[a : a + k], dtype=np.int64))
        pos_parts.append(p)
        slot_parts.append(table[p // block_size] * block_size + p % block_size)
        n += k
        q_start[i + 1] = n
        seq_lens[i] = a + k
        max_q = max(max_q, k)
        if it.samples:
            sample_idx.append(n - 1)
            sample_items.append(i)
    return StepInputs(
        np.concatenate(id_parts),
        np.concatenate(pos_parts),
        np.concatenate(slot_parts),
        q_start,
        seq_lens,
        np.asarray(sample_idx, dtype=np.int64),
        sample_items,
        max_q,
    )


def padded_block_tables(batch: ScheduledBatch) -> np.ndarray:
    """``[S, max_blocks]`` block tables (padding entries are 0 and never read)."""
    width = max(len(it.seq.block_table) for it in batch.items)
    out = np.zeros((len(batch.items), width), dtype=np.int64)
    for i, it in enumerate(batch.items):
        t = it.seq.block_table
        out[i, : len(t)] = t
    return out


def pack_aligned(parts: list[np.ndarray]) -> tuple[np.ndarray, list[slice]]:
    """One int32 array holding ``parts`` one after the other, and each part's slice of it.

    Every part starts on a 16-byte boundary: Triton specializes kernels on pointer alignment,
    and unaligned views of one uploaded array would recompile them step after step."""
    sizes = [len(x) for x in parts]
    starts = np.cumsum([0] + [-(-k // 4) * 4 for k in sizes])
    packed = np.zeros(int(starts[-1]), dtype=np.int32)
    where = [slice(int(a), int(a) + k) for a, k in zip(starts[:-1], sizes, strict=True)]
    for x, sl in zip(parts, where, strict=True):
        packed[sl] = x
    return packed, where
