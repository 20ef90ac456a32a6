"""The fused model's op set on CUDA: :class:`TritonOps`, the ``cloud_engine.kernels`` kernels
(cuBLAS for large products) where one applies and :class:`TorchOps`' composition where none
does. Every op keeps :class:`TorchOps`' contract (same results up to floating-point rounding,
the same ``(pending, residual)`` stream), so the two op sets are interchangeable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cloud_engine.model.torch_ops import TorchOps

if TYPE_CHECKING:
    from cloud_engine.model.fused import AttnInputs, FusedLlama
    from cloud_engine.parallel.moe import SparseMoE


class TritonOps(TorchOps):
    """The CUDA path (also runs under ``TRITON_INTERPRET=1`` for tests): each op where a kernel
    applies, :class:`TorchOps`' composition of the others where none does.

    Batches of at most ``gemv_rows`` tokens (and the logits of as many rows) take the skinny
    GEMV kernels with the norms, the residual adds, the SwiGLU and the greedy argmax folded in;
    larger ones take cuBLAS between the element-wise kernels (``gemv_rows=0``: always).
    Decode-only batches take the fused decode attention (q/k norm, RoPE, KV store and
    attention in one kernel, the merge of its key splits in a second) where it applies, unless
    ``decode_attention=False``."""

    def __init__(
        self, gemv_rows: int | None = None, decode_attention: bool = True, moe_pairs: bool = True
    ) -> None:
        from cloud_engine.kernels import (
            activation,
            attention,
            embedding,
            gemv,
            moe_decode,
            norm,
            rope_store,
        )
        from cloud_engine.kernels import decode_attention as dec

        self._norm, self._act, self._att, self._rope = norm, activation, attention, rope_store
        self._gemv, self._dec, self._embedding, self._moe = gemv, dec, embedding, moe_decode
        self.gemv_rows = gemv.MAX_ROWS if gemv_rows is None else gemv_rows
        self.decode_attention = decode_attention
        self.moe_pairs = moe_pairs

    def _skinny(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.gemv_rows and self._gemv.supports(x.shape[0], x.shape[1])

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm.add_rmsnorm(x, residual, w, eps)

    def norm_linear(
        self,
        pending: torch.Tensor | None,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        w: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if pending is not None or not self._skinny(residual):
            return super().norm_linear(pending, residual, norm, eps, w, bias)
        return self._gemv.linear(residual, w, bias, norm, eps), residual

    def norm_swiglu(
        self,
        pending: torch.Tensor | None,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        gate_up: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if pending is not None or not self._skinny(residual):
            return super().norm_swiglu(pending, residual, norm, eps, gate_up)
        return self._gemv.silu_linear(residual, gate_up, norm, eps), residual

    def linear_residual(
        self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor | None:
        if not self._skinny(x) or not residual.is_contiguous():
            return super().linear_residual(x, w, residual)
        self._gemv.linear_residual(x, w, residual)
        return None

    def moe_block(
        self,
        pending: torch.Tensor | None,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        moe: SparseMoE,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """A few tokens without a shared expert take the pair kernels (``kernels.moe_decode``),
        the residual added in place (with ``reduce``, into a zeroed partial sum that is then
        reduced); the rest the grouped kernel through ``moe``."""
        n, hid = residual.shape
        inter = moe.w_gate_up.shape[1] // 2
        fits = self._moe.supports(n, hid, inter) and residual.is_contiguous()
        if not (self.moe_pairs and fits and moe.shared is None):
            return super().moe_block(pending, residual, norm, eps, moe, reduce)
        if pending is not None:
            residual.add_(pending)
        dst = residual if reduce is None else torch.zeros_like(residual)
        self._moe.moe_residual(
            residual, norm, eps, moe.router, moe.w_gate_up, moe.w_down, moe.cfg.top_k,
            moe.cfg.norm_topk, moe.e0, dst,
        )  # fmt: skip
        return None if reduce is None else reduce(dst)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self._skinny(x) or x.stride(1) != 1:
            return super().linear(x, w)
        return self._gemv.linear(x, w)

    def linear_argmax(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        ids: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._skinny(x) or x.stride(1) != 1:
            return super().linear_argmax(x, w, ids, logits)
        return self._gemv.linear_argmax(x, w, ids, out=logits)

    def norm_linear_argmax(
        self,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        w: torch.Tensor,
        ids: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._skinny(residual) or residual.stride(1) != 1:
            return super().norm_linear_argmax(residual, norm, eps, w, ids, logits)
        return self._gemv.linear_argmax(residual, w, ids, norm=norm, eps=eps, out=logits)

    def embed_fed(
        self, ids: torch.Tensor, src: torch.Tensor, fed: torch.Tensor, table: torch.Tensor
    ) -> torch.Tensor:
        if not table.is_cuda:
            return super().embed_fed(ids, src, fed, table)
        return self._embedding.embed_fed(ids, src, fed, table)

    def rope_attention(
        self, fm: FusedLlama, layer: int, qkv: torch.Tensor, positions: torch.Tensor, a: AttnInputs
    ) -> torch.Tensor:
        kc, vc, ks, vs = fm.pool.layer(layer)
        decode_only = qkv.shape[0] == a.seq_lens.shape[0]  # every sequence has >= 1 token
        fits = self._dec.supports(qkv.shape[0], fm.d)
        if not (self.decode_attention and decode_only and fits):
            return super().rope_attention(fm, layer, qkv, positions, a)
        w = fm.layers[layer]
        return self._dec.decode_attention(
            qkv, positions, fm.cos_sin, w.q_norm, w.k_norm, fm.eps, fm.hq, kc, vc, ks, vs,
            a.slot_mapping, a.tables, a.seq_rows, a.seq_lens,
        )  # fmt: skip

    def qk_rope_store(
        self, fm: FusedLlama, layer: int, qkv: torch.Tensor, positions: torch.Tensor, a: AttnInputs
    ) -> torch.Tensor:
        w = fm.layers[layer]
        kc, vc, ks, vs = fm.pool.layer(layer)
        return self._rope.qk_rope_store(
            qkv, positions, fm.cos_sin, w.q_norm, w.k_norm, fm.eps, fm.hq, fm.hkv,
            kc, vc, ks, vs, a.slot_mapping,
        )  # fmt: skip

    def attention(self, fm: FusedLlama, layer: int, q: torch.Tensor, a: AttnInputs) -> torch.Tensor:
        kc, vc, ks, vs = fm.pool.layer(layer)
        return self._att.paged_attention(
            q, kc, vc, ks, vs, a.tables, a.seq_rows, a.seq_lens, a.q_start,
            a.tile_seq, a.tile_q0, a.tile_shape,  # type: ignore[arg-type]
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act.silu_mul(gate_up)
