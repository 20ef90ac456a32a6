"""A decode step's routed experts for a few tokens: four launches, the residual added in place.

At decode a MoE layer's cost is the bytes of the ``k`` experts each token picks; the grouped
kernel (:mod:`cloud_engine.kernels.moe`) spends a sort, two searchsorted and row blocks padded
to 16 on that, which dominates below a handful of tokens. Here every (token, slot) *pair* is a
GEMV of its own expert, nothing is sorted, and the norm and the residual add are folded in:

1. router logits ``rmsnorm(residual) * norm @ router^T`` (the skinny GEMV, norm fused);
2. ``_topk_softmax_kernel``: per token, ``softmax`` in float32 and the top-k (first index
   among equal probabilities), one program per token;
3. ``_pair_gate_up_kernel``: per pair, ``silu(h @ Wg[e]^T) * (h @ Wu[e]^T)`` with ``h``
   recomputed from the residual row (as the GEMV kernels do), written to ``act [T*k, I]``;
4. ``_pair_down_kernel``: per token and block of output columns, the sum over its ``k`` slots
   of ``w * (act @ Wd[e]^T)`` in float32 (``w`` renormalised over the ``k`` when
   ``norm_topk``), rounded once and added into the residual in place.

Tokens that pick the same expert read it twice (L2 catches some), which is why the grouped
kernel takes over past :data:`MAX_TOKENS`. Expert ids outside ``[e0, e0 + E)`` (another rank's
experts) contribute zero. Rounding follows the grouped path: products rounded to the
activation dtype where the unfused ops store them, sums and the SwiGLU in float32.

Invariants: every output element is written by one program (deterministic, race-free in place);
each kernel waits (PDL) before it reads anything an earlier kernel writes, and reads only
weights before that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cloud_engine.kernels import gemv
from cloud_engine.kernels.gemv import _input_row, _rounded_dot
from cloud_engine.kernels.pdl import launch_kwargs, pdl_enter, use_pdl

MAX_TOKENS = 8  # tokens a step sends here; more go to the grouped kernel (bench/moe_kernel.py:
# replayed from graphs on an H200, 8 tokens take 157 us a layer here, 170 grouped; 1 token 32 vs 68)


def supports(tokens: int, hidden: int, inter: int, limit: int = MAX_TOKENS) -> bool:
    """Whether a step of ``tokens`` rows of these widths goes to the pair kernels (at most
    ``limit`` tokens; they take up to the router GEMV's ``gemv.KERNEL_ROWS``)."""
    fits = gemv.supports(tokens, hidden) and triton.next_power_of_2(inter) <= gemv.MAX_K
    return 0 < tokens <= limit and fits


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, probs_ptr, idx_ptr, E, stride_l,
    TOP_K: tl.constexpr, EP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    pdl_enter(PDL)
    offs = tl.arange(0, EP)
    ok = offs < E
    x = tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(ok, p / tl.sum(p, axis=0), -1.0)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        i = tl.min(tl.where(p == best, offs, EP), axis=0)
        tl.store(probs_ptr + t * TOP_K + j, best)
        tl.store(idx_ptr + t * TOP_K + j, i)
        p = tl.where(offs == i, -1.0, p)


@triton.jit
def _pair_gate_up_kernel(
    x_ptr, norm_ptr, w_ptr, idx_ptr, act_ptr, H, INTER, E, e0,
    stride_x, stride_we, stride_wn, stride_a, eps,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < INTER
    k_ok = offs_k < H
    norm_w = tl.load(norm_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    e = tl.load(idx_ptr + p) - e0
    if (e < 0) | (e >= E):  # another rank's expert: the down kernel skips it too
        return
    x = _input_row(x_ptr, norm_w, p // TOP_K, stride_x, offs_k, k_ok, H, eps, True)
    w_off = e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    w_off += offs_k[None, :]
    mask = n_ok[:, None] & k_ok[None, :]
    wg = tl.load(w_ptr + w_off, mask=mask, other=0.0)
    wu = tl.load(w_ptr + INTER * stride_wn + w_off, mask=mask, other=0.0)
    g = _rounded_dot(wg, x, act_ptr.dtype.element_ty)
    u = _rounded_dot(wu, x, act_ptr.dtype.element_ty)
    y = g * tl.sigmoid(g) * u
    tl.store(act_ptr + p * stride_a + offs_n, y.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _pair_down_kernel(
    act_ptr, w_ptr, idx_ptr, rw_ptr, res_ptr, H, INTER, E, e0,
    stride_a, stride_we, stride_wn, stride_r,
    TOP_K: tl.constexpr, KP: tl.constexpr, NORM_TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < H
    k_ok = offs_k < INTER
    pdl_enter(PDL)
    ks = tl.arange(0, KP)
    denom = 1.0
    if NORM_TOPK:
        denom = tl.sum(tl.load(rw_ptr + t * TOP_K + ks, mask=ks < TOP_K, other=0.0), axis=0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K):
        e = tl.load(idx_ptr + t * TOP_K + j) - e0
        mine = (e >= 0) & (e < E)
        e = tl.where(mine, e, 0)
        a = tl.load(act_ptr + (t * TOP_K + j) * stride_a + offs_k, mask=k_ok & mine, other=0.0)
        w_off = e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        w = tl.load(
            w_ptr + w_off + offs_k[None, :], mask=(n_ok[:, None] & k_ok[None, :]) & mine, other=0.0
        )
        rw = tl.load(rw_ptr + t * TOP_K + j) / denom
        acc += _rounded_dot(w, a.to(tl.float32), res_ptr.dtype.element_ty) * rw
    dst = res_ptr + t * stride_r + offs_n
    res = tl.load(dst, mask=n_ok, other=0.0).to(tl.float32)
    y = res + acc.to(res_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dst, y.to(res_ptr.dtype.element_ty), mask=n_ok)


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probabilities float32 [T, k], expert ids int32 [T, k])`` of ``softmax(logits)``."""
    t, e = logits.shape
    probs = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    pdl = use_pdl(logits)
    _topk_softmax_kernel[(t,)](
        logits, probs, idx, e, logits.stride(0), TOP_K=top_k, EP=triton.next_power_of_2(e),
        PDL=pdl, num_warps=1, **launch_kwargs(pdl),
    )  # fmt: skip
    return probs, idx


def moe_residual(
    residual: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    norm_topk: bool,
    e0: int = 0,
    dst: torch.Tensor | None = None,
) -> None:
    """``dst += experts(rmsnorm(residual) * norm)`` in place (``dst`` the residual itself
    unless given: a zeroed buffer takes a rank's partial sum), for ``residual [T, H]``
    (``T <= gemv.KERNEL_ROWS``); stacked weights ``w_gate_up [E, 2I, H]``, ``w_down [E, H, I]``."""
    dst = residual if dst is None else dst
    assert dst.shape == residual.shape and dst.stride(1) == 1
    t, hid = residual.shape
    num_e, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    assert supports(t, hid, inter, gemv.KERNEL_ROWS) and residual.stride(1) == 1
    assert (
        w_down.shape == (num_e, hid, inter) and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1
    )
    logits = gemv.linear(residual, router, None, norm, eps)
    probs, idx = topk_softmax(logits, top_k)
    act = torch.empty((t * top_k, inter), dtype=residual.dtype, device=residual.device)
    pdl = use_pdl(residual)
    bn = gemv.block_n(inter, hid, gate_up=True)
    _pair_gate_up_kernel[(t * top_k, triton.cdiv(inter, bn))](
        residual, norm, w_gate_up, idx, act, hid, inter, num_e, e0,
        residual.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0), eps,
        TOP_K=top_k, BLOCK_N=bn, BLOCK_K=triton.next_power_of_2(hid), PDL=pdl,
        num_warps=gemv.NUM_WARPS, **launch_kwargs(pdl),
    )  # fmt: skip
    bn = gemv.block_n(hid, inter)
    _pair_down_kernel[(t, triton.cdiv(hid, bn))](
        act, w_down, idx, probs, dst, hid, inter, num_e, e0,
        act.stride(0), w_down.stride(0), w_down.stride(1), dst.stride(0),
        TOP_K=top_k, KP=triton.next_power_of_2(top_k), NORM_TOPK=norm_topk, BLOCK_N=bn,
        BLOCK_K=triton.next_power_of_2(inter), PDL=pdl, num_warps=gemv.NUM_WARPS,
        **launch_kwargs(pdl),
    )  # fmt: skip
