"""Grammar masks on the logits' device: the rows of a batch that follow a grammar get their
disallowed tokens at -inf before sampling; rows without one are untouched.

Invariants: the masks are computed on the host (``routing.grammar.fill_masks``: several rows on
llguidance's threads, the GIL released) straight into one int32 staging buffer of ``[S, words]``
mask rows (rows without a grammar all ones) and ``S`` flags (1: the row has a grammar), while
the device runs the step's forward pass (queued before); the buffer goes to the device in one
copy the host does not wait for: on CUDA from pinned staging buffers kept per device and
alternated, each reused only once its last copy has completed (``pin_memory`` per step cost
about a millisecond). There the masks are unpacked with shifts and applied with one
``masked_fill``: the same torch ops on CPU and CUDA. llguidance has no CUDA kernel of its own
(its torch helper is this unpack and fill under ``torch.compile``). A grammar row's tokens
past the mask's width are never allowed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from routing.grammar import GrammarState, fill_masks


class _Staging:
    """Pinned host buffers for one CUDA device, used in turn: a buffer is written again only
    after the copy out of it (two uses ago) has completed."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def take(self, n: int) -> tuple[int, torch.Tensor]:
        self.turn ^= 1
        i = self.turn
        done = self.copied[i]
        if done is not None:
            done.synchronize()
        buf = self.buffers[i]
        if buf is None or buf.numel() < n:
            buf = self.buffers[i] = torch.empty(max(n, 1 << 16), dtype=torch.int32).pin_memory()
        return i, buf[:n]


_staging: dict[torch.device, _Staging] = {}
_lock = threading.Lock()


def apply_grammar_masks(
    logits: torch.Tensor, states: Sequence[GrammarState | None]
) -> torch.Tensor:
    """``logits`` ``[S, V]`` with each grammar row's disallowed tokens at -inf (a new tensor
    when any row has a grammar; ``logits`` itself, unchanged, when none has)."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    live = [s for s in states if s is not None]
    n, v = logits.shape
    words = max(s.words for s in live)
    dev = logits.device
    cuda = dev.type == "cuda"
    with _lock:
        if cuda:
            staging = _staging.setdefault(dev, _Staging())
            turn, buf = staging.take(n * (words + 1))
            host = buf.numpy()
        else:
            host = np.empty(n * (words + 1), dtype=np.int32)
        masks = host[: n * words].reshape(n, words)
        flags = host[n * words :]
        masks[...] = -1  # rows without a grammar allow every token
        flags[...] = 0
        flags[rows] = 1
        fill_masks(live, masks, rows)
        if cuda:
            packed = buf.to(dev, non_blocking=True)
            done = staging.copied[turn] = staging.copied[turn] or torch.cuda.Event()
            done.record()
        else:
            packed = torch.from_numpy(host)
    mask = packed[: n * words].view(n, words)
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    bits = ((mask.unsqueeze(-1) >> shifts) & 1).view(n, words * 32).bool()
    if bits.shape[1] >= v:
        allowed = bits[:, :v]
    else:  # past the mask's width: allowed only in rows without a grammar
        plain = packed[n * words :] == 0
        allowed = torch.cat([bits, plain.unsqueeze(1).expand(n, v - bits.shape[1])], dim=1)
    return logits.masked_fill(~allowed, float("-inf"))


def grammar_states(seqs: Sequence[object]) -> list[GrammarState | None]:
    """Each sequence's grammar state (None where it has none)."""
    return [getattr(s, "grammar", None) for s in seqs]
