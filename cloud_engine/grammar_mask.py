"""Grammar masks on the logits' device: the rows of a batch that follow a grammar get their
disallowed tokens at -inf before sampling; rows without one are untouched.

Invariants: the masks are computed on the host (``routing.grammar.GrammarState.fill``, a few
microseconds a row; several rows on llguidance's threads, ``fill_masks``) into one int32
``[R, words]`` buffer, while the device runs the step's forward pass (queued before), copied to the device without the host
waiting (``cloud_engine.sampler.to_device``: pinned memory on CUDA), unpacked there with shifts
and applied with one ``masked_fill``: the same torch ops on CPU and CUDA. llguidance has no
CUDA kernel of its own (its torch helper is this unpack and fill under ``torch.compile``).
A token past the mask's width is never allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cloud_engine.sampler import to_device
from routing.grammar import GrammarState, fill_masks


def apply_grammar_masks(
    logits: torch.Tensor, states: Sequence[GrammarState | None]
) -> torch.Tensor:
    """``logits`` ``[S, V]`` with each grammar row's disallowed tokens at -inf (a new tensor
    when any row has a grammar; ``logits`` itself, unchanged, when none has)."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    live = [s for s in states if s is not None]
    words = max(s.words for s in live)
    host = np.zeros((len(rows), words), dtype=np.int32)
    fill_masks(live, host)
    dev = logits.device
    mask = to_device(torch.from_numpy(host), dev)
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    bits = ((mask.unsqueeze(-1) >> shifts) & 1).view(len(rows), words * 32).bool()
    v = logits.shape[-1]
    if bits.shape[1] >= v:
        allowed = bits[:, :v]
    else:  # tokens past the mask's width: never allowed
        pad = torch.zeros(len(rows), v - bits.shape[1], dtype=torch.bool, device=dev)
        allowed = torch.cat([bits, pad], dim=1)
    idx = to_device(torch.tensor(rows, dtype=torch.int64), dev)
    out = logits.clone()
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


def grammar_states(seqs: Sequence[object]) -> list[GrammarState | None]:
    """Each sequence's grammar state (None where it has none)."""
    return [getattr(s, "grammar", None) for s in seqs]
