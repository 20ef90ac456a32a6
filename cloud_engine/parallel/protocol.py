"""Each step's metadata as packed int64 tensors: a fixed header, then one payload.

The driver flattens a scheduled batch (``cloud_engine.step_inputs``) into :class:`StepMeta`,
packs it into one int64 array and sends it (a broadcast to its stage's TP ranks, a send to the
next stage); every rank unpacks views of the same array, so every rank runs the same step.
No Python object is pickled per step.

Header (``HEADER`` int64): ``cmd, N (tokens), S (sequences), W (block-table width),
M (sampled rows), flags, step id, 0``. Payload, in order: ``input_ids[N], positions[N],
slot_mapping[N], q_start[S+1], seq_lens[S], block_tables[S*W], sample_idx[M]``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

HEADER = 8
FLAG_GREEDY = 1  # every sampled row is greedy: the last stage sends token ids, not logits


class Cmd(enum.IntEnum):
    STEP = 1
    NOOP = 2  # keep-alive while idle (workers' waits have timeouts)
    STOP = 3
    RESET_STATS = 4  # every rank starts its stage statistics afresh (a measured window)


@dataclass(frozen=True, slots=True)
class StepMeta:
    """One forward pass's integers (host arrays; views into one packed buffer once unpacked)."""

    cmd: Cmd
    step: int
    input_ids: np.ndarray  # [N]
    positions: np.ndarray  # [N]
    slot_mapping: np.ndarray  # [N]
    q_start: np.ndarray  # [S + 1]
    seq_lens: np.ndarray  # [S]
    block_tables: np.ndarray  # [S, W]
    sample_idx: np.ndarray  # [M]
    greedy: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.sample_idx.shape[0])

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(header, payload)`` int64 CPU tensors."""
        s, w = self.block_tables.shape
        n, m = self.num_tokens, self.num_samples
        head = np.array(
            [int(self.cmd), n, s, w, m, FLAG_GREEDY if self.greedy else 0, self.step, 0],
            dtype=np.int64,
        )
        payload = np.concatenate(
            [
                self.input_ids,
                self.positions,
                self.slot_mapping,
                self.q_start.astype(np.int64),
                self.seq_lens.astype(np.int64),
                self.block_tables.reshape(-1),
                self.sample_idx,
            ]
        ).astype(np.int64, copy=False)
        return torch.from_numpy(head), torch.from_numpy(payload)


def control(cmd: Cmd, step: int = 0) -> torch.Tensor:
    """The header of a step-less command (NOOP, STOP, RESET_STATS)."""
    return torch.tensor([int(cmd), 0, 0, 0, 0, 0, step, 0], dtype=torch.int64)


def payload_size(head: torch.Tensor) -> int:
    n, s, w, m = (int(x) for x in head[1:5].tolist())
    return 3 * n + (s + 1) + s + s * w + m


def unpack(head: torch.Tensor, payload: torch.Tensor) -> StepMeta:
    h = head.tolist()
    cmd, n, s, w, m, flags, step = (int(x) for x in h[:7])
    p = payload.numpy()
    o = 0

    def take(k: int) -> np.ndarray:
        nonlocal o
        out = p[o : o + k]
        o += k
        return out

    ids, pos, slots = take(n), take(n), take(n)
    q_start, seq_lens = take(s + 1), take(s)
    tables = take(s * w).reshape(s, w)
    sample_idx = take(m)
    return StepMeta(
        Cmd(cmd),
        step,
        ids,
        pos,
        slots,
        q_start,
        seq_lens,
        tables,
        sample_idx,
        bool(flags & FLAG_GREEDY),
    )
