"""Paged attention over the KV pool for a ragged batch: decodes and prefill chunks alike.

Each program handles one *tile* (a sequence and ``BLOCK_Q`` of its query tokens) for one kv
head, with the ``G`` query heads that share that kv head packed into the rows of one matrix
(``rows = BLOCK_Q * G_PAD``), so a decode tile reads each key once for all its query heads.
It walks the sequence's keys ``BLOCK_N`` at a time through the block table, with an online
softmax in float32.

An 8-bit cache (int8, fp8 e4m3; ``cloud_engine.kv_quant``) is read as stored, converted exactly
to q's dtype for the products: each key's scale multiplies its column of scores, each value's
scale its column of probabilities before the product with the values (what the product of the
dequantized tiles gives, with one multiply per key instead of one per element).

Invariants: a query at absolute position ``p`` (``seq_len - q_len + t``) sees exactly keys
``0..p`` of its own sequence; keys are read only below the tile's causal limit, and masked
loads return 0, so stale or padding slots never reach the output; a tile whose sequence has no
key (CUDA-graph padding) writes zeros, not NaN. The loop bound is read from ``seq_lens`` on the
device, so the launch is the same for every step of a captured decode graph.

Small decode batches split each sequence's keys over ``SPLITS`` programs (chosen from the grid
size alone, so a graph's launch stays fixed), each writing a partial output and its log-sum-exp;
``_combine_kernel`` merges them. Without that, a batch of one runs on only ``Hkv`` programs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cloud_engine.kernels.pdl import launch_kwargs, pdl_enter, pdl_enter_early, use_pdl
from cloud_engine.kernels.tiling import TileShape


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    o_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    tables_ptr,
    seq_rows_ptr,
    seq_lens_ptr,
    q_start_ptr,
    tile_seq_ptr,
    tile_q0_ptr,
    part_o_ptr,
    part_lse_ptr,
    qk_scale,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_st,
    stride_tr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
    SCALED: tl.constexpr,
    IEEE: tl.constexpr,
    SPLITS: tl.constexpr,
    HQ: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    s = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    qs = tl.load(q_start_ptr + s)
    q_len = tl.load(q_start_ptr + s + 1) - qs
    ctx = tl.load(seq_lens_ptr + s)
    row = tl.load(seq_rows_ptr + s).to(tl.int64)

    M: tl.constexpr = BLOCK_Q * G_PAD
    offs_m = tl.arange(0, M)
    t = q0 + offs_m // G_PAD
    g = offs_m % G_PAD
    valid = (t < q_len) & (g < G)
    head = kvh * G + g
    qpos = ctx - q_len + t
    offs_d = tl.arange(0, D)
    tok = (qs + t).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )

    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, D], dtype=tl.float32)
    kv_end = tl.minimum(ctx, ctx - q_len + q0 + BLOCK_Q)  # 1 + the tile's last query position
    chunk = tl.cdiv(tl.cdiv(kv_end, SPLITS), BLOCK_N) * BLOCK_N  # keys of one split
    lo = split * chunk
    hi = tl.minimum(kv_end, lo + chunk)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        blk = tl.load(tables_ptr + row * stride_tr + offs_n // BS, mask=n_ok, other=0).to(tl.int64)
        slot_off = blk * stride_cb + (offs_n % BS) * stride_ct + kvh * stride_ch
        k = tl.load(
            k_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0
        )
        v = tl.load(
            v_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0
        )
        k = k.to(q.dtype)  # exact from int8 and fp8 e4m3; a no-op for an unscaled cache
        v = v.to(q.dtype)
        if IEEE:  # float32 models: exact products, not tf32
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        if SCALED:  # a key's scale multiplies its scores; a value's, its probabilities
            s_off = blk * stride_sb + (offs_n % BS) * stride_st + kvh
            ks = tl.load(k_scale_ptr + s_off, mask=n_ok, other=0.0)
            vs = tl.load(v_scale_ptr + s_off, mask=n_ok, other=0.0)
            scores = scores * ks[None, :]
        scores = scores * qk_scale  # log2 domain
        ok = (offs_n[None, :] <= qpos[:, None]) & n_ok[None, :]
        scores = tl.where(ok, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pw = p
        if SCALED:
            pw = p * vs[None, :]
        if IEEE:
            pv = tl.dot(pw.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(pw.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLITS == 1:
        tl.store(
            o_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=valid[:, None],
        )
    else:  # partial result of this split, merged by _combine_kernel
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        part = (tok * HQ + head) * SPLITS + split
        tl.store(part_o_ptr + part[:, None] * D + offs_d[None, :], out, mask=valid[:, None])
        tl.store(part_lse_ptr + part, lse, mask=valid)


@triton.jit
def _combine_kernel(
    part_o_ptr, part_lse_ptr, o_ptr, stride_on, stride_oh, HQ: tl.constexpr,
    SPLITS: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    if EARLY:  # reads nothing before its wait: the next kernel may launch first
        pdl_enter_early(PDL)
    else:
        pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    base = (tok * HQ + h) * SPLITS
    lse = tl.load(part_lse_ptr + base + sp)
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # empty splits: exp2(-inf) = 0
    o = tl.load(part_o_ptr + (base + sp)[:, None] * D + offs_d[None, :])
    o = tl.where(w[:, None] > 0.0, o, 0.0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(o_ptr + tok * stride_on + h * stride_oh + offs_d, res.to(o_ptr.dtype.element_ty))


def decode_splits(programs: int, max_splits: int = 16, target: int = 264) -> int:
    """How many KV splits per decode tile keep about ``target`` programs in flight (two per
    multiprocessor of an H100/H200): 1 from 33 kv-head tiles up."""
    s = 1
    while s < max_splits and programs * s < target:
        s *= 2
    return s


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    tables: torch.Tensor,
    seq_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    q_start: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_q0: torch.Tensor,
    shape: TileShape,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[N, Hq, D]`` over the pool (``k_cache`` ``[blocks, bs, Hkv, D]``)
    for the sequences described by the int32 tensors (see the module docstring)."""
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    n_tiles = tile_seq.shape[0]
    if n_tiles == 0:
        return out
    scaled = k_scale is not None  # int8 or fp8 with a scale per token and head
    splits = decode_splits(n_tiles * hkv) if shape.block_q == 1 else 1
    part_o = part_lse = out
    if splits > 1:  # decode of a small batch: split every sequence's keys (flash-decoding)
        part_o = torch.empty((n_tiles, hq, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n_tiles, hq, splits), dtype=torch.float32, device=q.device)
    pdl = use_pdl(q)
    _paged_attention_kernel[(n_tiles, hkv, splits)](
        q,
        out,
        k_cache,
        v_cache,
        k_scale if scaled else q,
        v_scale if scaled else q,
        tables,
        seq_rows,
        seq_lens,
        q_start,
        tile_seq,
        tile_q0,
        part_o,
        part_lse,
        (1.0 / math.sqrt(d)) * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scale.stride(0) if k_scale is not None else 0,
        k_scale.stride(1) if k_scale is not None else 0,
        tables.stride(0),
        G=hq // hkv,
        G_PAD=shape.g_pad,
        BLOCK_Q=shape.block_q,
        BLOCK_N=shape.block_n,
        BS=k_cache.shape[1],
        D=d,
        SCALED=scaled,
        IEEE=q.dtype == torch.float32,
        SPLITS=splits,
        HQ=hq,
        PDL=pdl,
        num_warps=4,
        num_stages=2,
        **launch_kwargs(pdl),
    )
    if splits > 1:
        combine_splits(part_o, part_lse, out, n_tiles)
    return out


def combine_splits(
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    rows: int,
    early: bool = False,
    num_warps: int = 2,
) -> None:
    """``out[:rows]`` ``[rows, Hq, D]`` from the splits' partial outputs ``part_o``
    ``[rows, Hq, SPLITS, D]`` (float32, normalized per split) and log-sum-exps ``part_lse``
    (base 2, ``-inf`` for a split without keys). ``early``: the next kernel may launch before
    this one's wait (:func:`cloud_engine.kernels.pdl.pdl_enter_early`)."""
    hq, splits, d = part_o.shape[1], part_o.shape[2], part_o.shape[3]
    pdl = use_pdl(out)
    _combine_kernel[(rows, hq)](
        part_o, part_lse, out, out.stride(0), out.stride(1), HQ=hq, SPLITS=splits, D=d,
        PDL=pdl, EARLY=early, num_warps=num_warps, **launch_kwargs(pdl),
    )  # fmt: skip
