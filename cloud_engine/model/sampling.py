"""Token sampling in torch: greedy, temperature, top-k, top-p, with a per-request seed.

Invariant: with ``temperature == 0`` (or ``top_k == 1``) the result is ``argmax`` of the logits,
so greedy output is a deterministic function of the logits alone.
"""

from __future__ import annotations

import torch

from routing.engine import SamplingParams


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(params.seed))
    return g


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    """One token id from a ``[vocab]`` logits row."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits.float(), params.temperature, params.top_k, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Softmax of ``logits / temperature`` restricted to the top-k and the top-p nucleus."""
    logits = logits / max(temperature, 1e-5)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) > top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return torch.softmax(logits, -1)
