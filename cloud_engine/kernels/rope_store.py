"""One pass over the fused qkv projection: optional per-head q/k RMSNorm (Qwen3), rotate-half
RoPE on q and k, q written out, k and v written into their KV-pool slots.

Grid: one program per (token, head) for the ``Hq + Hkv`` heads; a kv-head program writes both k
and v. Tokens whose slot is negative (CUDA-graph padding) write no KV.

Invariant: the KV written for a token equals the reference model's k (normed, rotated) and v,
up to the storage dtype (for the 8-bit formats, ``cloud_engine.kv_quant``: ``x / s`` rounded to
int8 or fp8 e4m3, ``s = max|x| / QMAX`` per token and head, QMAX 127 or 448).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cloud_engine.kernels.pdl import launch_kwargs, pdl_enter, use_pdl


@triton.jit
def _rms(x1, x2, w_ptr, half, eps, D: tl.constexpr):
    r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    w1 = tl.load(w_ptr + half).to(tl.float32)
    w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)
    return x1 * r * w1, x2 * r * w2


@triton.jit
def _round_i8(x):
    r = tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(-x + 0.5))
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)


@triton.jit
def quantize_halves(x1, x2, QUANT: tl.constexpr, dt: tl.constexpr):
    """The halves of one head vector as stored (``dt``: the cache's element type) and the
    vector's scale: QUANT 0 stores ``dt`` (scale 1), 1 int8, 2 fp8 e4m3 (``kv_quant``)."""
    if QUANT == 0:
        q1 = x1.to(dt)
        q2 = x2.to(dt)
        s = 1.0
    else:
        if QUANT == 1:
            qmax = 127.0
        else:
            qmax = 448.0
        amax = tl.maximum(tl.max(tl.abs(x1), axis=0), tl.max(tl.abs(x2), axis=0))
        s = tl.maximum(amax, 1e-8) / qmax
        y1 = tl.minimum(tl.maximum(x1 / s, -qmax), qmax)
        y2 = tl.minimum(tl.maximum(x2 / s, -qmax), qmax)
        if QUANT == 1:
            q1 = _round_i8(y1)
            q2 = _round_i8(y2)
        else:
            q1 = y1.to(dt)
            q2 = y2.to(dt)
    return q1, q2, s


@triton.jit
def _store_vec(cache_ptr, scale_ptr, dst, sdst, x1, x2, half, D: tl.constexpr, QUANT: tl.constexpr):
    q1, q2, s = quantize_halves(x1, x2, QUANT, cache_ptr.dtype.element_ty)
    tl.store(cache_ptr + dst + half, q1)
    tl.store(cache_ptr + dst + D // 2 + half, q2)
    if QUANT != 0:
        tl.store(scale_ptr + sdst, s)


@triton.jit
def _qk_rope_store_kernel(
    qkv_ptr,
    stride_qkv,
    pos_ptr,
    cos_sin_ptr,
    qn_ptr,
    kn_ptr,
    eps,
    q_ptr,
    stride_qn,
    stride_qh,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_st,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    QK_NORM: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half = tl.arange(0, D // 2)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * D + half)
    sin = tl.load(cos_sin_ptr + pos * D + D // 2 + half)
    base = qkv_ptr + tok * stride_qkv
    if h < HQ:
        x1 = tl.load(base + h * D + half).to(tl.float32)
        x2 = tl.load(base + h * D + D // 2 + half).to(tl.float32)
        if QK_NORM:
            x1, x2 = _rms(x1, x2, qn_ptr, half, eps, D)
        dst = q_ptr + tok * stride_qn + h * stride_qh
        tl.store(dst + half, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty))
        tl.store(dst + D // 2 + half, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            kh = h - HQ
            k1 = tl.load(base + (HQ + kh) * D + half).to(tl.float32)
            k2 = tl.load(base + (HQ + kh) * D + D // 2 + half).to(tl.float32)
            if QK_NORM:
                k1, k2 = _rms(k1, k2, kn_ptr, half, eps, D)
            r1 = k1 * cos - k2 * sin
            r2 = k2 * cos + k1 * sin
            v1 = tl.load(base + (HQ + HKV + kh) * D + half).to(tl.float32)
            v2 = tl.load(base + (HQ + HKV + kh) * D + D // 2 + half).to(tl.float32)
            blk = slot // BS
            t = slot % BS
            dst = blk * stride_cb + t * stride_ct + kh * stride_ch
            sdst = blk * stride_sb + t * stride_st + kh
            _store_vec(k_cache_ptr, k_scale_ptr, dst, sdst, r1, r2, half, D, QUANT)
            _store_vec(v_cache_ptr, v_scale_ptr, dst, sdst, v1, v2, half, D, QUANT)


def quant_mode(cache: torch.Tensor, scale: torch.Tensor | None) -> int:
    """The kernels' QUANT code of a cache: 0 unscaled, 1 int8, 2 fp8 e4m3."""
    if scale is None:
        return 0
    return 1 if cache.dtype == torch.int8 else 2


def qk_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    num_q_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotated q ``[N, Hq, D]`` from ``qkv`` ``[N, (Hq + 2 Hkv) D]``; k, v go to the cache.

    ``cos_sin`` is ``[max_pos, D]`` float32: cos of the D/2 frequencies, then sin.
    """
    n = qkv.shape[0]
    d = k_cache.shape[-1]
    q = torch.empty((n, num_q_heads, d), dtype=qkv.dtype, device=qkv.device)
    int8 = k_scale is not None  # scaled: int8 or fp8
    if n:
        pdl = use_pdl(qkv)
        _qk_rope_store_kernel[(n, num_q_heads + num_kv_heads)](
            qkv,
            qkv.stride(0),
            positions,
            cos_sin,
            q_norm if q_norm is not None else cos_sin,
            k_norm if k_norm is not None else cos_sin,
            eps,
            q,
            q.stride(0),
            q.stride(1),
            k_cache,
            v_cache,
            k_scale if int8 else cos_sin,
            v_scale if int8 else cos_sin,
            slot_mapping,
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            k_scale.stride(0) if k_scale is not None else 0,
            k_scale.stride(1) if k_scale is not None else 0,
            HQ=num_q_heads,
            HKV=num_kv_heads,
            D=d,
            BS=k_cache.shape[1],
            QK_NORM=q_norm is not None,
            QUANT=quant_mode(k_cache, k_scale),
            PDL=pdl,
            num_warps=1 if d <= 64 else 2,
            **launch_kwargs(pdl),
        )
    return q
