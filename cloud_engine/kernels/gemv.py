"""Skinny matrix products for small decode batches: ``x @ W^T`` for ``M <= MAX_ROWS`` rows of
``x``, with the neighbouring element-wise work of a layer folded in.

At batch 1..8 a decode step's products only stream weights: each weight is used ``M`` times,
so time is bytes over bandwidth plus fixed costs per kernel. Each program owns ``BLOCK_N`` rows
of ``W`` across all of ``K`` (``BLOCK_K = next_power_of_2(K)``), loads that tile into registers
*before* waiting for the previous kernel (PDL, see :mod:`cloud_engine.kernels.pdl`), then for
each row of ``x`` reduces it against the tile and writes one of three epilogues:

- plain: ``out = x @ W^T (+ bias)``;
- residual: ``res = res + x @ W^T``, in place (the residual add that would otherwise open the
  next RMSNorm);
- SwiGLU: ``W`` is the fused gate|up ``[2F, K]``; ``out = silu(x @ Wg^T) * (x @ Wu^T)``;
- argmax (the logits): plain, plus each program's maximum of every row and its first column,
  packed into one int64 that orders like ``(value, -column)`` and merged into a per-row
  scratch with one atomic max per program; ``_argmax_finalize`` unpacks the token ids and
  resets the scratch (greedy sampling without a pass over the logits or their partials).

With ``norm`` the input row is first RMS-normalized and scaled (the layer's input or
post-attention norm), recomputed by every program from the row in L2.

Rounding follows the unfused ops (``torch_ops.TorchOps``): the normed input, each product and the
gate and up values are rounded to the activation dtype where those ops materialize them;
sums, statistics and the SwiGLU are float32.

Invariants: every output element is written by exactly one program (no split-K; the argmax's
atomic max is order-independent), so results are deterministic and the in-place residual
update is race-free; between launches every entry of a device's argmax scratch holds the
empty value (the finalize kernel resets what it reads; launches on one device share the
scratch, so they must run in one stream order, as an engine's steps do); before its PDL wait a
program reads only ``W``, which no kernel writes. Measured on an H200 (bench/profile_decode.py):
at one row these beat cuBLAS plus the separate element-wise kernels by far; at four rows and up
the CUDA-core reductions make them slower than cuBLAS, hence ``MAX_ROWS``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cloud_engine.kernels.pdl import launch_kwargs, pdl_enter, use_pdl

MAX_ROWS = 2  # rows the ops send here by default; more go to cuBLAS (CUDA-core FMAs grow
# with the rows: at 4 rows and up they cost more than cuBLAS's tensor-core products save)
KERNEL_ROWS = 8  # rows the kernels take at all (the row loop is unrolled)
MAX_K = 16384  # the whole reduction sits in one register tile
TILE = 8192  # elements of W per program (gate and up together for SwiGLU)
MIN_PROGRAMS = 256  # about two programs per multiprocessor of an H100/H200
NUM_WARPS = 8
EMPTY = -(2**63)  # the argmax scratch's value before any program's maximum
_EMPTY = tl.constexpr(EMPTY)
_scratch: dict[int, torch.Tensor] = {}  # per device: packed row maxima, KERNEL_ROWS entries


def supports(m: int, k: int) -> bool:
    """Whether the kernels take ``m`` rows with reduction length ``k``."""
    return 0 < m <= KERNEL_ROWS and triton.next_power_of_2(k) <= MAX_K


def block_n(n: int, k: int, gate_up: bool = False) -> int:
    """Rows of ``W`` per program: the largest power of two whose tile fits ``TILE`` that still
    gives ``MIN_PROGRAMS`` programs (or 1)."""
    per_row = triton.next_power_of_2(k) * (2 if gate_up else 1)
    bn = max(1, TILE // per_row)
    while bn > 1 and triton.cdiv(n, bn) < MIN_PROGRAMS:
        bn //= 2
    return bn


@triton.jit
def _input_row(x_ptr, norm_w, m, stride_x, offs_k, k_ok, K, eps, NORM: tl.constexpr):
    """Row ``m`` of x in float32 (zeros where ``k_ok`` is false); with ``NORM``, RMS-normalized,
    scaled by ``norm_w`` and rounded to x's dtype (as the unfused norm writes it)."""
    x = tl.load(x_ptr + m * stride_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        x = (x * r * norm_w).to(x_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _rounded_dot(w, x, dtype: tl.constexpr):
    """``W_tile @ x`` in float32, rounded to ``dtype`` (the product as the unfused op stores it)."""
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(dtype).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_o,
    eps,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    ARGMAX: tl.constexpr,
    best_ptr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    M_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = offs_k < K
    w_mask = n_ok[:, None] & k_ok[None, :]
    w_off = offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    w = tl.load(w_ptr + w_off, mask=w_mask, other=0.0)
    if SILU:  # up rows follow the N gate rows
        w_up = tl.load(w_ptr + N * stride_w + w_off, mask=w_mask, other=0.0)
    pdl_enter(PDL)
    norm_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    if NORM:
        norm_w = tl.load(norm_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    for m in tl.static_range(M_PAD):  # unrolled; rows from M on are masked off
        row_ok = m < M
        x = _input_row(x_ptr, norm_w, m, stride_x, offs_k, k_ok & row_ok, K, eps, NORM)
        dst = out_ptr + m * stride_o + offs_n
        st_ok = n_ok & row_ok
        if SILU:
            g = _rounded_dot(w, x, out_ptr.dtype.element_ty)
            u = _rounded_dot(w_up, x, out_ptr.dtype.element_ty)
            y = g * tl.sigmoid(g) * u
        elif RESIDUAL:
            res = tl.load(dst, mask=st_ok, other=0.0).to(tl.float32)
            y = res + _rounded_dot(w, x, out_ptr.dtype.element_ty)
        else:
            y = tl.sum(w.to(tl.float32) * x[None, :], axis=1) + bias
        tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=st_ok)
        if ARGMAX:
            _block_argmax(y, out_ptr, offs_n, n_ok, row_ok, best_ptr + m)


@triton.jit
def _block_argmax(y, out_ptr, offs_n, n_ok, row_ok, best_ptr):
    """This program's largest stored value of a row and its first column, merged into the
    row's packed maximum at ``best_ptr``: the value's bits mapped to an int32 that orders like
    the float (-0.0 counted as +0.0) in the high half, ``2**32 - 1 - column`` in the low half,
    so the largest value wins and, among equal values, the first column."""
    yr = tl.where(n_ok, y.to(out_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
    v, i = tl.max(yr, axis=0, return_indices=True, return_indices_tie_break_left=True)
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    col = tl.min(offs_n, axis=0) + i
    packed = (key.to(tl.int64) << 32) | (4294967295 - col.to(tl.int64))
    tl.atomic_max(best_ptr, packed, mask=row_ok, sem="relaxed")


@triton.jit
def _argmax_finalize(best_ptr, ids_ptr, M, M_PAD: tl.constexpr, PDL: tl.constexpr):
    """Token ids of the ``M`` rows from their packed maxima, and the scratch reset."""
    pdl_enter(PDL)
    offs = tl.arange(0, M_PAD)
    ok = offs < M
    packed = tl.load(best_ptr + offs, mask=ok, other=0)
    tl.store(ids_ptr + offs, 4294967295 - (packed & 4294967295), mask=ok)
    tl.store(best_ptr + offs, tl.full([M_PAD], _EMPTY, tl.int64), mask=ok)


def _argmax_scratch(device: torch.device) -> torch.Tensor:
    """The device's argmax scratch, made (outside any graph capture) on first use."""
    key = device.index if device.type == "cuda" else -1
    t = _scratch.get(key)
    if t is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        assert not capturing, "warm linear_argmax up before capturing a graph"
        t = _scratch[key] = torch.full((KERNEL_ROWS,), EMPTY, dtype=torch.int64, device=device)
    return t


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    n: int,
    *,
    bias: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: bool = False,
    silu: bool = False,
    argmax: torch.Tensor | None = None,
    bn: int | None = None,
    num_warps: int | None = None,
) -> None:
    m, k = x.shape
    assert supports(m, k) and w.shape[1] == k and w.stride(1) == 1 and x.stride(1) == 1
    bn = bn or block_n(n, k, silu)
    pdl = use_pdl(x)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, w, bias if bias is not None else w, norm if norm is not None else w, out,
        m, n, k, x.stride(0), w.stride(0), out.stride(0), eps,
        NORM=norm is not None, HAS_BIAS=bias is not None, RESIDUAL=residual, SILU=silu,
        ARGMAX=argmax is not None, best_ptr=argmax if argmax is not None else out, BLOCK_N=bn, BLOCK_K=triton.next_power_of_2(k), M_PAD=triton.next_power_of_2(m), PDL=pdl,
        num_warps=num_warps or NUM_WARPS,
        **launch_kwargs(pdl),
    )  # fmt: skip


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    **tuning: int,
) -> torch.Tensor:
    """``x @ w.T + bias`` ``[M, N]``; with ``norm``, of ``rmsnorm(x) * norm`` instead of x."""
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x, w, out, w.shape[0], bias=bias, norm=norm, eps=eps, **tuning)
    return out


def linear_argmax(
    x: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    out: torch.Tensor | None = None,
    **tuning: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ w.T, ids)``: the product (the logits, written into ``out`` when given) and, per
    row, the first column holding its maximum as int64 (``torch.argmax`` of the stored values;
    NaN rows are not handled), written into ``ids`` when given; with ``norm``, of
    ``rmsnorm(x) * norm`` instead of x."""
    m, n = x.shape[0], w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1
    best = _argmax_scratch(x.device)
    _launch(x, w, out, n, norm=norm, eps=eps, argmax=best, **tuning)
    if ids is None:
        ids = torch.empty(m, dtype=torch.int64, device=x.device)
    assert ids.shape == (m,) and ids.dtype == torch.int64 and ids.is_contiguous()
    pdl = use_pdl(x)
    _argmax_finalize[(1,)](
        best, ids, m, M_PAD=triton.next_power_of_2(m), PDL=pdl, num_warps=1,
        **launch_kwargs(pdl),
    )  # fmt: skip
    return out, ids


def linear_residual(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, **tuning: int
) -> None:
    """``residual += x @ w.T`` in place (``residual`` ``[M, N]``, rows contiguous)."""
    assert residual.shape == (x.shape[0], w.shape[0]) and residual.stride(1) == 1
    _launch(x, w, residual, w.shape[0], residual=True, **tuning)


def silu_linear(
    x: torch.Tensor, gate_up: torch.Tensor, norm: torch.Tensor, eps: float, **tuning: int
) -> torch.Tensor:
    """``silu(h @ Wg.T) * (h @ Wu.T)`` ``[M, F]`` for ``h = rmsnorm(x) * norm`` and the fused
    ``gate_up = [Wg; Wu]`` ``[2F, K]``."""
    f = gate_up.shape[0] // 2
    out = torch.empty((x.shape[0], f), dtype=x.dtype, device=x.device)
    _launch(x, gate_up, out, f, norm=norm, eps=eps, silu=True, **tuning)
    return out
