"""Fused residual add + RMSNorm: ``residual += x; out = rmsnorm(residual) * w`` in one pass.

Invariant: the residual stream is updated in place (one read and one write per element), and
the sum and the statistics are computed in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cloud_engine.kernels.pdl import launch_kwargs, pdl_enter, use_pdl


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    H,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * stride_r + offs, x.to(res_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / H
    y = x * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) * weight, x + residual)`` for ``x`` ``[N, H]``; the residual is
    updated in place (with no residual, ``x`` itself becomes the residual stream)."""
    n, h = x.shape
    out = torch.empty_like(x)
    res = x if residual is None else residual
    if n:
        pdl = use_pdl(x)
        _add_rmsnorm_kernel[(n,)](
            x,
            res,
            weight,
            out,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            h,
            eps,
            HAS_RES=residual is not None,
            BLOCK=triton.next_power_of_2(h),
            PDL=pdl,
            num_warps=4 if h <= 4096 else 8,
            **launch_kwargs(pdl),
        )
    return out, res
