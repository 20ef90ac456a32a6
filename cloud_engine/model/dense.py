"""The dense-KV reference: a preallocated contiguous cache and a plain generate loop.

This is the correctness reference the ONNX export, the paged engine and the parallel engines
are compared against: same weights, simplest possible cache, one sequence at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.model.sampling import make_generator, sample
from routing.engine import FinishReason, SamplingParams


class DenseKVCache:
    """Per layer a ``[B, Hkv, max_len, D]`` k and v buffer; ``length`` tokens are valid.

    Invariant: after ``attend`` on every layer for a chunk of T tokens, ``advance(T)`` is called
    once, so all layers agree on ``length``.
    """

    def __init__(self, model: LlamaForCausalLM, batch: int, max_len: int) -> None:
        cfg = model.config
        p = next(model.parameters())
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [
            torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_hidden_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.num_hidden_layers)
        ]
        self.length = 0
        self.max_len = max_len
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[1]
        start, end = self.length, self.length + t
        if end > self.max_len:
            raise ValueError(f"KV cache full ({end} > {self.max_len})")
        self.k[layer][:, :, start:end] = k.transpose(1, 2)
        self.v[layer][:, :, start:end] = v.transpose(1, 2)
        keys = self.k[layer][:, :, :end].repeat_interleave(self.groups, dim=1)
        vals = self.v[layer][:, :, :end].repeat_interleave(self.groups, dim=1)
        qh = q.transpose(1, 2)  # [B, Hq, T, D]
        # query i (absolute position start+i) sees keys 0..start+i
        mask = torch.ones(t, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=mask)
        return out.transpose(1, 2)

    def advance(self, t: int) -> None:
        self.length += t


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_token_ids: list[int] = field(default_factory=list)


@torch.inference_mode()
def stream_tokens(
    model: LlamaForCausalLM,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    max_context: int | None = None,
) -> Iterator[tuple[int, FinishReason | None]]:
    """Yield ``(token_id, finish_reason)``; the last pair has a finish reason.

    Stops on ``params.stop_token_ids`` (unless ``ignore_eos``; never sampled before
    ``min_tokens``), ``max_tokens``, or the context.
    Stop strings are the caller's (see ``gateway.node.textstream``).
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    ctx = max_context or model.config.max_position_embeddings
    if len(prompt_ids) >= ctx:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit context {ctx}")
    device = next(model.parameters()).device
    budget = min(params.max_tokens, ctx - len(prompt_ids))
    cache = DenseKVCache(model, 1, len(prompt_ids) + budget)
    gen = make_generator(params, device)
    ids = torch.tensor([list(prompt_ids)], device=device)
    pos = torch.arange(len(prompt_ids), device=device).unsqueeze(0)
    stops = set() if params.ignore_eos else set(params.stop_token_ids)
    for n in range(budget):
        logits = model(ids, pos, cache)[0, -1]
        cache.advance(ids.shape[1])
        banned = [t for t in params.banned_stops(n) if 0 <= t < logits.shape[-1]]
        if banned:
            logits = logits.clone()
            logits[banned] = float("-inf")
        tok = sample(logits, params, gen)
        if tok in stops:
            yield tok, FinishReason.STOP
            return
        if n + 1 == budget:
            yield tok, FinishReason.LENGTH
            return
        yield tok, None
        ids = torch.tensor([[tok]], device=device)
        pos = torch.tensor([[cache.length]], device=device)


def generate(
    model: LlamaForCausalLM,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    max_context: int | None = None,
) -> GenerationResult:
    """Run :func:`stream_tokens` to the end; the stop token itself is not in ``token_ids``."""
    out: list[int] = []
    t0 = time.perf_counter()
    t_first = t0
    reason = FinishReason.LENGTH
    for i, (tok, fin) in enumerate(stream_tokens(model, prompt_ids, params, max_context)):
        if i == 0:
            t_first = time.perf_counter()
        if fin is FinishReason.STOP:
            reason = fin
            break
        out.append(tok)
        if fin is not None:
            reason = fin
    t1 = time.perf_counter()
    return GenerationResult(
        out, reason, len(prompt_ids), prefill_s=t_first - t0, decode_s=t1 - t_first
    )
