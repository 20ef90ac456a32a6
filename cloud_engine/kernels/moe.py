"""Grouped mixture-of-experts feed-forward: all experts in two Triton launches, no host sync.

``moe_forward(h, router, w_gate_up, w_down, top_k, norm_topk)`` is a layer's routed experts:

* routing on the device: router logits, ``softmax`` in float32, top-k; the renormalisation
  (Qwen3 ``norm_topk_prob``, Mixtral always) is done on the loaded weights in the down kernel
  (``route`` is the same routing as ``SparseMoE``'s eager path, for references);
* the (token, slot) pairs sorted by expert with three device ops (a stable ``sort``, two
  ``searchsorted`` for each expert's run); each kernel program finds its row block (experts'
  runs cut into ``BLOCK_M`` blocks, a cumsum over the experts in-kernel), and the grid's block
  count is a bound known on the host (``cdiv(pairs, BLOCK_M) + min(experts, pairs)``), so
  nothing waits for the GPU and the launches are capturable in a CUDA graph; blocks past the
  last expert's exit at once;
* ``_gate_up_kernel``: one launch for every expert's ``gate_up`` GEMM with SwiGLU fused
  (``silu(gate) * up``), rows gathered from the tokens, written in sorted order;
* ``_down_kernel``: one launch for every expert's ``down`` GEMM, each row scaled by its routing
  weight and scattered to its (token, slot) row; the combine is a sum over the slots.

A block reads only its own expert's weights, so at decode (a few tokens) only the routed
experts' bytes are read. Weights are the stacked layouts ``SparseMoE`` holds: ``w_gate_up``
``[E, 2I, H]`` (gate rows first, then up) and ``w_down`` ``[E, H, I]``. Expert ids outside
``[e0, e0 + E)`` (other ranks' experts) contribute zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def route(
    h: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in h's dtype, expert ids [T, k])`` as the models define routing."""
    probs = torch.softmax(F.linear(h, router).float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(h.dtype), idx


@triton.jit
def _block(b, seg_start_ptr, seg_end_ptr, E, EP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block ``b``'s ``(expert, first sorted row, end of the expert's rows)``; experts'
    runs are cut into ``BLOCK_M`` blocks in expert order; past the last block, expert >= E."""
    offs = tl.arange(0, EP)
    em = offs < E
    s = tl.load(seg_start_ptr + offs, mask=em, other=0).to(tl.int32)
    t = tl.load(seg_end_ptr + offs, mask=em, other=0).to(tl.int32)
    nblk = (t - s + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(nblk, 0)
    e = tl.sum((cum <= b).to(tl.int32), 0)
    sel = offs == e
    first = tl.sum(tl.where(sel, cum - nblk, 0), 0)
    r0 = tl.sum(tl.where(sel, s, 0), 0) + (b - first) * BLOCK_M
    r1 = tl.sum(tl.where(sel, t, 0), 0)
    return e, r0, r1


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 models: exact products, not tf32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]
    act_ptr,  # [P, I] in sorted order
    pairs_ptr,  # [P] pair ids (token * k + slot) sorted by expert
    seg_start_ptr,  # [E] first sorted row of each expert
    seg_end_ptr,  # [E] end of each expert's sorted rows
    H,
    INTER,
    E,
    stride_xt,
    stride_we,
    stride_wn,
    stride_at,
    TOP_K: tl.constexpr,
    EP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    e, r0, r1 = _block(b, seg_start_ptr, seg_end_ptr, E, EP, BLOCK_M)
    if e >= E:
        return
    rows = r0 + tl.arange(0, BLOCK_M)
    rmask = rows < r1
    pair = tl.load(pairs_ptr + rows, mask=rmask, other=0)
    tok = (pair // TOP_K).to(tl.int64)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    wbase = w_ptr + e.to(tl.int64) * stride_we
    g_ptrs = wbase + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kmask = (k0 + offs_k) < H
        x = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        wu = tl.load(u_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc_g = _dot(x, wg, acc_g, IEEE)
        acc_u = _dot(x, wu, acc_u, IEEE)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_at + offs_n[None, :]
    tl.store(a_ptrs, y.to(act_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(
    act_ptr,  # [P, I] in sorted order
    w_ptr,  # [E, H, I]
    out_ptr,  # [P, H] by pair id
    rw_ptr,  # [P] routing probability by pair id (float32)
    pairs_ptr,
    seg_start_ptr,
    seg_end_ptr,
    H,
    INTER,
    E,
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    TOP_K: tl.constexpr,
    KP: tl.constexpr,
    NORM: tl.constexpr,
    EP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    pn = tl.program_id(1)
    e, r0, r1 = _block(b, seg_start_ptr, seg_end_ptr, E, EP, BLOCK_M)
    if e >= E:
        return
    rows = r0 + tl.arange(0, BLOCK_M)
    rmask = rows < r1
    pair = tl.load(pairs_ptr + rows, mask=rmask, other=0)
    rw = tl.load(rw_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
    if NORM:  # renormalise over the token's top-k
        tok = pair // TOP_K
        ks = tl.arange(0, KP)
        kk = tl.load(
            rw_ptr + tok[:, None] * TOP_K + ks[None, :],
            mask=rmask[:, None] & (ks[None, :] < TOP_K),
            other=0.0,
        ).to(tl.float32)
        rw = rw / tl.maximum(tl.sum(kk, 1), 1e-30)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_at + offs_k[None, :]
    w_ptrs = (
        w_ptr
        + e.to(tl.int64) * stride_we
        + offs_n[None, :].to(tl.int64) * stride_wn
        + offs_k[:, None]
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kmask = (k0 + offs_k) < INTER
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = _dot(a, w, acc, IEEE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * rw[:, None]
    o_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def _config(pairs: int) -> dict[str, int]:
    """Tiles by the number of (token, expert) pairs: decode reads weights (small M, narrow N to
    spread the few experts' bytes over the SMs), prefill is a grouped GEMM."""
    if pairs <= 256:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if pairs <= 2048:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


_ARANGE: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def segments(
    idx: torch.Tensor, num_experts: int, e0: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pair ids sorted by expert, each local expert's first and end sorted row)``: three
    device ops (a sort, two searchsorted); ids outside ``[e0, e0 + E)`` fall in no segment."""
    key = (idx.device, e0, num_experts)
    bounds = _ARANGE.get(key)
    if bounds is None:
        bounds = _ARANGE[key] = torch.arange(e0, e0 + num_experts, device=idx.device)
    ids, order = torch.sort(idx.reshape(-1), stable=True)
    start = torch.searchsorted(ids, bounds)
    end = torch.searchsorted(ids, bounds, right=True)
    return order, start, end


def experts_forward(
    h: torch.Tensor,
    probs: torch.Tensor,
    idx: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    e0: int = 0,
    norm_topk: bool = False,
    complete: bool = False,
) -> torch.Tensor:
    """Sum over the top-k slots of ``w * down(silu(gate(x)) * up(x))`` for ``h [T, H]``;
    ``w`` is ``probs`` (float32 [T, k]), renormalised over the k when ``norm_topk``.
    ``complete``: the weights hold every expert the router picks from (``e0 == 0``, all ``E``)."""
    t, hid = h.shape
    top_k = idx.shape[1]
    num_e, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    assert w_down.shape == (num_e, hid, inter)
    assert w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1
    h = h.contiguous()
    p = t * top_k
    cfg = _config(p)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    pairs, seg_start, seg_end = segments(idx, num_e, e0)
    nb = triton.cdiv(p, bm) + min(num_e, p)  # a bound on the row blocks, known on the host
    ep = triton.next_power_of_2(num_e)
    act = torch.empty(p, inter, dtype=h.dtype, device=h.device)
    # every pair gets a row when this rank holds all experts; else other ranks' stay zero
    out = (torch.empty if complete else torch.zeros)(p, hid, dtype=h.dtype, device=h.device)
    rw = probs.reshape(-1)
    kw = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    ieee = h.dtype == torch.float32
    _gate_up_kernel[(nb, triton.cdiv(inter, bn))](
        h, w_gate_up, act, pairs, seg_start, seg_end, hid, inter, num_e,
        h.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        TOP_K=top_k, EP=ep, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, **kw,
    )  # fmt: skip
    _down_kernel[(nb, triton.cdiv(hid, bn))](
        act, w_down, out, rw, pairs, seg_start, seg_end, hid, inter, num_e,
        act.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0),
        TOP_K=top_k, KP=triton.next_power_of_2(top_k), NORM=norm_topk, EP=ep,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, **kw,
    )  # fmt: skip
    return out.view(t, top_k, hid).sum(dim=1)


def moe_forward(
    h: torch.Tensor,
    router: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    norm_topk: bool,
    e0: int = 0,
) -> torch.Tensor:
    """A layer's routed experts for ``h [T, H]`` (no shared expert): routing (softmax in
    float32, top-k; the renormalisation is done in the down kernel) and the two launches."""
    probs = torch.softmax(F.linear(h, router), dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, top_k, dim=-1)
    complete = e0 == 0 and w_gate_up.shape[0] == router.shape[0]
    return experts_forward(h, w, idx, w_gate_up, w_down, e0, norm_topk, complete)
