"""Log-probabilities in numpy from the logits ONNX Runtime returns (the raw logits: before
temperature, top-k/top-p and stop-token bans), for the edge engine's rows that ask.

Invariant: a token's ``logprob`` and its entry in ``top`` are the same number (one
log-softmax), so a greedy token's logprob equals the first of its top entries exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from routing.engine import TokenLogprob


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float32 of ``[..., vocab]`` logits."""
    x = logits.astype(np.float32, copy=False)
    m = x.max(axis=-1, keepdims=True)
    shifted = x - m
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _top(lp: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    if k <= 0:
        return ()
    k = min(k, lp.size)
    part = np.argpartition(lp, lp.size - k)[lp.size - k :]
    part = part[np.argsort(-lp[part], kind="stable")]
    return tuple((int(i), float(lp[i])) for i in part)


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """``token``'s log-probability under one ``[vocab]`` logits row, with the top ``k``."""
    lp = log_softmax(logits)
    return TokenLogprob(int(token), float(lp[token]), _top(lp, k))


def next_token_logprobs(logits: np.ndarray, targets: Sequence[int], k: int) -> list[TokenLogprob]:
    """Row ``j`` of ``[T, vocab]`` logits scores ``targets[j]`` (the token after position
    ``j``); ``len(targets) <= T``."""
    lp = log_softmax(logits[: len(targets)])
    return [TokenLogprob(int(t), float(lp[j, t]), _top(lp[j], k)) for j, t in enumerate(targets)]
