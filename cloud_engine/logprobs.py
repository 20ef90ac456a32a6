"""Log-probabilities in torch for the rows of a batched step that ask (the raw logits: before
temperature, top-k/top-p and stop-token bans), computed on the logits' device.

Invariant: a token's ``logprob`` and its entry in ``top`` come from one log-softmax, so a
greedy token's logprob equals its top entry exactly. Rows that do not ask cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from routing.engine import TokenLogprob

if TYPE_CHECKING:
    from cloud_engine.scheduler import ScheduledBatch


def _rows(lp: torch.Tensor, targets: torch.Tensor, ks: Sequence[int]) -> list[TokenLogprob]:
    """One entry per row of ``lp`` ``[R, V]`` (log-softmaxed): its target's and top ``ks[r]``."""
    chosen = lp.gather(1, targets.view(-1, 1)).view(-1).tolist()
    kmax = min(max(ks, default=0), lp.shape[-1])
    if kmax > 0:
        vals, idx = lp.topk(kmax, dim=-1)
        top_v, top_i = vals.tolist(), idx.tolist()
    ids = targets.tolist()
    out = []
    for r, k in enumerate(ks):
        top = tuple(zip(top_i[r][:k], top_v[r][:k], strict=True)) if k > 0 else ()
        out.append(TokenLogprob(int(ids[r]), float(chosen[r]), top))
    return out


def sampled_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, wants: Sequence[int | None]
) -> list[TokenLogprob | None] | None:
    """Per sampled row of ``logits`` ``[M, V]``: the log-probability of ``tokens[i]`` and its
    top ``wants[i]``, or None where ``wants[i]`` is None; None when no row asks."""
    rows = [i for i, k in enumerate(wants) if k is not None]
    if not rows:
        return None
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
    got = _rows(lp, tokens.index_select(0, idx), [int(wants[i] or 0) for i in rows])
    out: list[TokenLogprob | None] = [None] * len(wants)
    for i, entry in zip(rows, got, strict=True):
        out[i] = entry
    return out


def collect_prompt_logprobs(
    batch: ScheduledBatch,
    q_start: Sequence[int],
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Append to each asking sequence's ``prompt_logprobs`` the entries its prompt chunk in
    ``batch`` gives: the logits at position ``p`` score prompt token ``p + 1``. ``hidden``:
    ``[N, H]``, the step's final hidden states (before the LM head) in batch order. Entries a
    sequence already has (recomputed after a preemption) are not computed again."""
    for i, it in enumerate(batch.items):
        seq = it.seq
        got = seq.prompt_logprobs
        k = seq.sampling.prompt_logprobs
        if got is None or k is None or len(got) >= seq.num_prompt:
            continue
        first = max(it.start, len(got) - 1)  # position whose logits score token len(got)
        last = min(it.start + it.num_new, seq.num_prompt - 1)  # exclusive
        if first >= last:
            continue
        a = int(q_start[i]) + first - it.start
        rows = hidden[a : a + last - first]
        lp = torch.log_softmax(lm_head(rows).float(), dim=-1)
        targets = torch.tensor(seq.token_ids[first + 1 : last + 1], device=lp.device)
        got.extend(_rows(lp, targets, [k] * (last - first)))
