"""Decode attention with the q/k norm, RoPE and KV store folded in: one kernel per layer for a
decode-only batch (one new token per sequence), plus a small merge kernel when the keys are
split, where the general path runs ``rope_store``, ``attention`` and its combine kernel.

Grid ``(S, Hkv, SPLITS)``; program ``(s, h, split)`` covers positions ``[lo, hi)`` of sequence
``s`` for kv head ``h`` and the ``G`` query heads sharing it (padded to ``G_PAD >= 16`` rows of
one matrix product). Keys already cached (positions below ``ctx - 1``) do not depend on this
step's qkv projection, so the first tile of them is loaded before the PDL wait. The new token's
k (normed, rotated) and v come from the projection in registers, rounded to the cache dtype;
the split holding position ``ctx - 1`` adds them to its softmax and stores them into the
token's slot (unless the slot is negative: CUDA-graph padding). Every split norms and rotates
its q rows itself.

With several splits, each writes its normalized partial output and log-sum-exp (a split with no
keys writes zeros and ``-inf``), and ``attention.combine_splits`` (grid ``(S, Hq)``), the
general path's merge, combines them in its *early* form: it lets the next kernel launch before
its own PDL wait, so the output projection still loads its weights while attention runs, as it
would without a merge kernel in between. Merging in a separate kernel beats merging in the last
split to finish: the atomic counter and release/acquire fences that needs cost more than a
kernel boundary (bench/decode_kernels.py on the H200, Qwen3-0.6B-shape layer at 564 tokens:
20.26 us in the committed run before, 18.45 us after).

Head vectors are handled as their two RoPE halves ``[D/2]``: scores are ``q1·k1 + q2·k2`` and
outputs are stored half by half, so nothing is concatenated.

An 8-bit cache (int8, fp8 e4m3 with a scale per token and head; ``cloud_engine.kv_quant``) is
read as stored and converted exactly to q's dtype; each key's scale multiplies its scores, each
value's its probabilities. The new token is quantized as ``rope_store`` does and attended as
read back, so a step gives what ``rope_store`` + ``attention`` give.

Invariants: a query sees keys ``0..ctx-1`` of its own sequence, as in
``attention._paged_attention_kernel`` with ``q_len = 1``; the KV written equals what
``rope_store`` writes; every split stores its partial, so the merge reads no stale data.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cloud_engine.kernels.attention import combine_splits, decode_splits
from cloud_engine.kernels.pdl import launch_kwargs, pdl_enter, use_pdl
from cloud_engine.kernels.rope_store import quant_mode, quantize_halves

MAX_SEQS = 8  # larger batches run rope_store + attention: at 64 sequences (no splits) they are
# faster on an H200, at 1..8 this kernel is (bench/profile_decode.py)
BLOCK_N = 64  # keys per inner iteration
MAX_SPLITS = 16  # splits of one sequence's keys (small batches)


def supports(num_seqs: int, head_dim: int) -> bool:
    """Small batches (any cache: bf16/fp16/fp32, or int8/fp8 with scales) with power-of-two
    head dims of 32 and up (halves feed 16-wide matrix products)."""
    pow2 = head_dim & (head_dim - 1) == 0
    return num_seqs <= MAX_SEQS and head_dim >= 32 and pow2


@triton.jit
def _norm_rope(x1, x2, w1, w2, cos, sin, eps, D: tl.constexpr, NORM: tl.constexpr):
    """Rotate-half RoPE of the halves of the last axis (float32), RMS-normed first (weight
    halves ``w1``, ``w2``) if NORM."""
    if NORM:
        ss = tl.sum(x1 * x1, axis=-1, keep_dims=True) + tl.sum(x2 * x2, axis=-1, keep_dims=True)
        r = tl.rsqrt(ss / D + eps)
        x1 = x1 * r * w1
        x2 = x2 * r * w2
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _kv_tile(
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, row, start, end, kvh, half,
    stride_tr, stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """Halves of keys and values at positions ``start + [0, BLOCK_N)`` below ``end``, as
    stored, and their scales (an unscaled cache: ones, unread)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    ok = offs_n < end
    blk = tl.load(tables_ptr + row * stride_tr + offs_n // BS, mask=ok, other=0).to(tl.int64)
    p = (blk * stride_cb + (offs_n % BS) * stride_ct + kvh * stride_ch)[:, None] + half[None, :]
    k1 = tl.load(k_cache_ptr + p, mask=ok[:, None], other=0.0)
    k2 = tl.load(k_cache_ptr + p + D // 2, mask=ok[:, None], other=0.0)
    v1 = tl.load(v_cache_ptr + p, mask=ok[:, None], other=0.0)
    v2 = tl.load(v_cache_ptr + p + D // 2, mask=ok[:, None], other=0.0)
    if QUANT != 0:
        so = blk * stride_sb + (offs_n % BS) * stride_st + kvh
        ks = tl.load(k_scale_ptr + so, mask=ok, other=0.0)
        vs = tl.load(v_scale_ptr + so, mask=ok, other=0.0)
    else:
        ks = ok.to(tl.float32)
        vs = ks
    return k1, k2, v1, v2, ks, vs, ok


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # float32 models: exact products, not tf32
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _decode_attention_kernel(
    qkv_ptr, stride_qkv, pos_ptr, cos_sin_ptr, qn_ptr, kn_ptr, eps,
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, tables_ptr, seq_rows_ptr,
    seq_lens_ptr, o_ptr, stride_on, stride_oh, part_o_ptr, part_lse_ptr, qk_scale,
    stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_tr,
    G: tl.constexpr, G_PAD: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    QK_NORM: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)  # decode: token s is sequence s
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    half = tl.arange(0, D // 2)
    # Before the wait: step inputs, norm weights and cached keys, nothing the qkv projection
    # writes.
    ctx = tl.load(seq_lens_ptr + tok)
    row = tl.load(seq_rows_ptr + tok).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(ctx, lo + chunk)
    cached_end = tl.minimum(hi, ctx - 1)  # this split's cached keys: [lo, cached_end)
    k1, k2, v1, v2, ks, vs, n_ok = _kv_tile(
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, row, lo, cached_end,
        kvh, half, stride_tr, stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
        BS, BLOCK_N, D, QUANT,
    )  # fmt: skip
    cos = tl.load(cos_sin_ptr + pos * D + half)
    sin = tl.load(cos_sin_ptr + pos * D + D // 2 + half)
    qw1, qw2, kw1, kw2 = cos, cos, cos, cos  # unread without QK_NORM
    if QK_NORM:
        qw1 = tl.load(qn_ptr + half).to(tl.float32)
        qw2 = tl.load(qn_ptr + D // 2 + half).to(tl.float32)
        kw1 = tl.load(kn_ptr + half).to(tl.float32)
        kw2 = tl.load(kn_ptr + D // 2 + half).to(tl.float32)
    pdl_enter(PDL)

    dt = qkv_ptr.dtype.element_ty
    base = qkv_ptr + tok * stride_qkv
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    head = kvh * G + g
    qp = base + head[:, None] * D + half[None, :]
    q1 = tl.load(qp, mask=g_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(qp + D // 2, mask=g_ok[:, None], other=0.0).to(tl.float32)
    q1, q2 = _norm_rope(q1, q2, qw1, qw2, cos, sin, eps, D, QK_NORM)
    q1, q2 = q1.to(dt), q2.to(dt)  # q as rope_store writes it
    kb = base + (HQ + kvh) * D
    kn1 = tl.load(kb + half).to(tl.float32)
    kn2 = tl.load(kb + D // 2 + half).to(tl.float32)
    kn1, kn2 = _norm_rope(kn1, kn2, kw1, kw2, cos, sin, eps, D, QK_NORM)
    if QUANT == 0:  # an unscaled cache stores k as rope_store writes q: in the model's dtype
        kn1, kn2 = kn1.to(dt), kn2.to(dt)
    vb = base + (HQ + HKV + kvh) * D
    vn1 = tl.load(vb + half).to(tl.float32)
    vn2 = tl.load(vb + D // 2 + half).to(tl.float32)
    # the new token's k and v as stored (rope_store's rounding), and their scales
    kc1, kc2, ks_new = quantize_halves(kn1, kn2, QUANT, k_cache_ptr.dtype.element_ty)
    vc1, vc2, vs_new = quantize_halves(vn1, vn2, QUANT, v_cache_ptr.dtype.element_ty)

    owner = (lo <= ctx - 1) & (ctx - 1 < hi)  # this split holds the new token's position
    keep = (half < D // 2) & owner & (slot >= 0)
    dst = (slot // BS) * stride_cb + (slot % BS) * stride_ct + kvh * stride_ch + half
    tl.store(k_cache_ptr + dst, kc1, mask=keep)
    tl.store(k_cache_ptr + dst + D // 2, kc2, mask=keep)
    tl.store(v_cache_ptr + dst, vc1, mask=keep)
    tl.store(v_cache_ptr + dst + D // 2, vc2, mask=keep)
    if QUANT != 0:
        sdst = (slot // BS) * stride_sb + (slot % BS) * stride_st + kvh
        tl.store(k_scale_ptr + sdst, ks_new, mask=owner & (slot >= 0))
        tl.store(v_scale_ptr + sdst, vs_new, mask=owner & (slot >= 0))

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc1 = tl.zeros([G_PAD, D // 2], dtype=tl.float32)
    acc2 = tl.zeros([G_PAD, D // 2], dtype=tl.float32)
    for start in range(lo, cached_end, BLOCK_N):
        # 8-bit keys and values convert exactly to q's dtype; their scales multiply the
        # scores' and the probabilities' columns (as in attention._paged_attention_kernel)
        sc = _dot(q1, tl.trans(k1.to(dt)), IEEE) + _dot(q2, tl.trans(k2.to(dt)), IEEE)
        if QUANT != 0:
            sc = sc * ks[None, :]
        sc = tl.where(n_ok[None, :], sc * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(sc - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT != 0:
            p = p * vs[None, :]
        acc1 = acc1 * alpha[:, None] + _dot(p.to(dt), v1.to(dt), IEEE)
        acc2 = acc2 * alpha[:, None] + _dot(p.to(dt), v2.to(dt), IEEE)
        m_i = m_new
        k1, k2, v1, v2, ks, vs, n_ok = _kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, row,
            start + BLOCK_N, cached_end, kvh, half, stride_tr, stride_cb, stride_ct, stride_ch,
            stride_sb, stride_st, BS, BLOCK_N, D, QUANT,
        )  # fmt: skip
    # the new token's key, in the owner split only
    kr1 = kc1.to(dt).to(tl.float32)
    kr2 = kc2.to(dt).to(tl.float32)
    s_new = tl.sum(q1.to(tl.float32) * kr1[None, :], axis=1)
    s_new += tl.sum(q2.to(tl.float32) * kr2[None, :], axis=1)
    s_new = tl.where(owner, s_new * ks_new * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p_new = tl.math.exp2(s_new - m_safe)
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + p_new
    # as the tile path rounds p (times the value's scale) for its product
    p_new = (p_new * vs_new).to(dt).to(tl.float32)[:, None]
    acc1 = acc1 * alpha[:, None] + p_new * vc1.to(dt).to(tl.float32)[None, :]
    acc2 = acc2 * alpha[:, None] + p_new * vc2.to(dt).to(tl.float32)[None, :]
    m_i = m_new

    inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLITS == 1:
        out = o_ptr + tok * stride_on + head[:, None] * stride_oh + half[None, :]
        tl.store(out, (acc1 * inv).to(o_ptr.dtype.element_ty), mask=g_ok[:, None])
        tl.store(out + D // 2, (acc2 * inv).to(o_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        part = (tok * HQ + head) * SPLITS + split
        out = part_o_ptr + part[:, None] * D + half[None, :]
        tl.store(out, acc1 * inv, mask=g_ok[:, None])
        tl.store(out + D // 2, acc2 * inv, mask=g_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=g_ok)


def decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    num_q_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    tables: torch.Tensor,
    seq_rows: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """Attention output ``[S, Hq, D]`` of one new token per sequence, from ``qkv``
    ``[S, (Hq + 2 Hkv) D]``; the tokens' k and v go into the cache (``k_cache``
    ``[blocks, bs, Hkv, D]``; an 8-bit one with its scales ``[blocks, bs, Hkv]``)."""
    s = qkv.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    group = num_q_heads // hkv
    out = torch.empty((s, num_q_heads, d), dtype=qkv.dtype, device=qkv.device)
    if s == 0:
        return out
    splits = decode_splits(s * hkv, MAX_SPLITS)
    part_o = part_lse = out
    if splits > 1:
        part_o = torch.empty((s, num_q_heads, splits, d), dtype=torch.float32, device=qkv.device)
        part_lse = torch.empty((s, num_q_heads, splits), dtype=torch.float32, device=qkv.device)
    pdl = use_pdl(qkv)
    _decode_attention_kernel[(s, hkv, splits)](
        qkv, qkv.stride(0), positions, cos_sin,
        q_norm if q_norm is not None else cos_sin, k_norm if k_norm is not None else cos_sin, eps,
        k_cache, v_cache, k_scale if k_scale is not None else k_cache,
        v_scale if v_scale is not None else v_cache, slot_mapping, tables, seq_rows, seq_lens,
        out, out.stride(0), out.stride(1), part_o, part_lse,
        (1.0 / math.sqrt(d)) * 1.4426950408889634,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0) if k_scale is not None else 0,
        k_scale.stride(1) if k_scale is not None else 0, tables.stride(0),
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), HQ=num_q_heads, HKV=hkv, D=d,
        BS=k_cache.shape[1], BLOCK_N=BLOCK_N, SPLITS=splits, QK_NORM=q_norm is not None,
        IEEE=qkv.dtype == torch.float32, QUANT=quant_mode(k_cache, k_scale), PDL=pdl, num_warps=4, **launch_kwargs(pdl),
    )  # fmt: skip
    if splits > 1:
        combine_splits(part_o, part_lse, out, s, early=True, num_warps=1)
    return out
