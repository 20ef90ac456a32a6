"""SwiGLU activation: ``silu(gate) * up`` from the fused ``[N, 2F]`` gate|up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cloud_engine.kernels.pdl import launch_kwargs, pdl_enter, use_pdl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    n, f2 = gate_up.shape
    f = f2 // 2
    out = torch.empty((n, f), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if n:
        pdl = use_pdl(gate_up)
        _silu_mul_kernel[(n, triton.cdiv(f, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), f, BLOCK=block, PDL=pdl,
            num_warps=4, **launch_kwargs(pdl),
        )  # fmt: skip
    return out
