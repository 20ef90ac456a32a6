"""Paged attention in plain torch: the CPU path, and the reference the Triton kernels are
checked against.

K/V of a layer live in the pool as ``[blocks, block_size, kv_heads, D]``; a sequence's keys are
gathered through its block table. Decode rows (one query token) are batched into one padded
gather; prefill chunks (several query tokens, causal within the chunk, full view of the cached
prefix) run one sequence at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cloud_engine.kv_pool import KVPool
from cloud_engine.kv_quant import quantize


@dataclass(slots=True)
class PagedMeta:
    """Per-step tensors (on the pool's device) shared by every layer of one forward pass."""

    slot_mapping: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [S, W] int64
    q_start: list[int]  # [S + 1]
    seq_lens: list[int]  # [S]
    decode_seqs: torch.Tensor  # [Sd] int64: sequences with exactly one query token
    decode_tokens: torch.Tensor  # [Sd] int64: their token rows
    decode_lens: torch.Tensor  # [Sd] int64
    prefill_seqs: list[int]  # sequences with several query tokens


def make_meta(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    q_start: list[int],
    seq_lens: list[int],
) -> PagedMeta:
    dev = slot_mapping.device
    dec = [s for s in range(len(seq_lens)) if q_start[s + 1] - q_start[s] == 1]
    pre = [s for s in range(len(seq_lens)) if q_start[s + 1] - q_start[s] > 1]
    return PagedMeta(
        slot_mapping,
        block_tables,
        q_start,
        seq_lens,
        torch.tensor(dec, dtype=torch.int64, device=dev),
        torch.tensor([q_start[s] for s in dec], dtype=torch.int64, device=dev),
        torch.tensor([seq_lens[s] for s in dec], dtype=torch.int64, device=dev),
        pre,
    )


def store_kv(
    pool: KVPool, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write ``k, v`` ``[N, Hkv, D]`` into the pool at ``slots`` (quantizing for the 8-bit
    formats; fp8 is copied as bytes, which ``index_copy_`` takes on every device)."""
    kc, vc, ks, vs = pool.layer(layer)
    h, d = kc.shape[-2], kc.shape[-1]
    for cache, scales, x in ((kc, ks, k), (vc, vs, v)):
        if scales is None:
            q = x.to(cache.dtype)
        else:
            q, s = quantize(x, cache.dtype)
            scales.view(-1, h).index_copy_(0, slots, s)
        if cache.element_size() == 1:
            cache.view(torch.uint8).view(-1, h, d).index_copy_(0, slots, q.view(torch.uint8))
        else:
            cache.view(-1, h, d).index_copy_(0, slots, q)


def gather_kv(
    pool: KVPool, layer: int, tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the blocks in ``tables`` (``[..., W]``) as ``[..., W * bs, Hkv, D]``."""
    kc, vc, ks, vs = pool.layer(layer)
    k, v = kc[tables], vc[tables]  # [..., W, bs, H, D]
    if ks is not None and vs is not None:  # dequantized in float32 (exact for 8-bit values)
        k = k.float() * ks[tables].unsqueeze(-1)
        v = v.float() * vs[tables].unsqueeze(-1)
    shape = (*tables.shape[:-1], -1, kc.shape[-2], kc.shape[-1])
    return k.reshape(shape).to(dtype), v.reshape(shape).to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q ``[..., T, Hq, D]``, k/v ``[..., L, Hkv, D]``, mask ``[..., T, L]`` (True = attend)
    -> ``[..., T, Hq, D]``, grouped-query heads sharing their kv head."""
    *lead, t, hq, d = q.shape
    hkv = k.shape[-2]
    g = hq // hkv
    qg = q.reshape(*lead, t, hkv, g, d)
    scores = torch.einsum("...thgd,...lhd->...hgtl", qg, k) * (1.0 / math.sqrt(d))
    scores = scores.float().masked_fill(~mask.unsqueeze(-3).unsqueeze(-3), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.einsum("...hgtl,...lhd->...thgd", probs, v)
    return out.reshape(*lead, t, hq, d)


def paged_attention(pool: KVPool, layer: int, q: torch.Tensor, meta: PagedMeta) -> torch.Tensor:
    """Attention of ``q`` ``[N, Hq, D]`` over each sequence's cached keys (already stored)."""
    out = torch.empty_like(q)
    if meta.decode_seqs.numel():
        tables = meta.block_tables[meta.decode_seqs]  # [Sd, W]
        k, v = gather_kv(pool, layer, tables, q.dtype)  # [Sd, L, H, D]
        pos = torch.arange(k.shape[1], device=q.device)
        mask = (pos.unsqueeze(0) < meta.decode_lens.unsqueeze(1)).unsqueeze(1)  # [Sd, 1, L]
        qd = q[meta.decode_tokens].unsqueeze(1)  # [Sd, 1, Hq, D]
        out[meta.decode_tokens] = _attend(qd, k, v, mask).squeeze(1)
    bs = pool.spec.block_size
    for s in meta.prefill_seqs:
        a, b = meta.q_start[s], meta.q_start[s + 1]
        ctx = meta.seq_lens[s]
        nb = -(-ctx // bs)
        k, v = gather_kv(pool, layer, meta.block_tables[s, :nb], q.dtype)
        k, v = k[:ctx], v[:ctx]
        t = b - a
        mask = torch.ones(t, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - t)
        out[a:b] = _attend(q[a:b], k, v, mask)
    return out


class TorchPagedBackend:
    """``AttentionBackend`` for :class:`LlamaForCausalLM` run as one ragged ``[1, N]`` batch."""

    def __init__(self, pool: KVPool, meta: PagedMeta) -> None:
        self.pool = pool
        self.meta = meta

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store_kv(self.pool, layer, k[0], v[0], self.meta.slot_mapping)
        return paged_attention(self.pool, layer, q[0], self.meta).unsqueeze(0)
