"""The fused model's op set in plain torch (any device): :class:`TorchOps`, the reference for
the Triton kernels and the base that states each op's contract, and :func:`add_norm`. The
residual stream is ``(pending, residual)``: a projection's output either stays pending
(returned, and added by the next norm) or is added into ``residual`` in place by the
projection's own kernel, leaving nothing pending (None); every op takes and keeps this
contract, so the two paths mix freely. Composite ops are built from the element ops through
``self``, so a subclass that replaces an element op changes them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from cloud_engine.model.fused import AttnInputs, FusedLlama
    from cloud_engine.parallel.moe import SparseMoE


def add_norm(
    ops: TorchOps, pending: torch.Tensor | None, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(residual + pending) * w, residual)``, adding ``pending`` in place."""
    if pending is None:
        return ops.add_rmsnorm(residual, None, w, eps)
    return ops.add_rmsnorm(pending, residual, w, eps)


class TorchOps:
    """Plain-torch ops (any device): the reference for the Triton kernels. Composite ops
    (``norm_linear``, ``norm_swiglu``, ``rope_attention``) are built from the element ops
    through ``self``, so a subclass that replaces an element op changes them too."""

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(residual + x) * w, residual + x)``, the residual updated in place; with
        ``residual`` None, ``x`` is the residual stream."""
        res = x if residual is None else residual.add_(x)
        r32 = res.float()
        y = r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)
        return (y * w.float()).to(x.dtype), res

    def norm_linear(
        self,
        pending: torch.Tensor | None,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        w: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h @ w.T + bias, residual)`` for ``h = rmsnorm(residual + pending) * norm``."""
        h, residual = add_norm(self, pending, residual, norm, eps)
        return F.linear(h, w, bias), residual

    def norm_swiglu(
        self,
        pending: torch.Tensor | None,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        gate_up: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(silu(h @ Wg.T) * (h @ Wu.T), residual)``, ``h`` as in :meth:`norm_linear`."""
        h, residual = add_norm(self, pending, residual, norm, eps)
        return self.silu_mul(F.linear(h, gate_up)), residual

    def linear_residual(
        self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor | None:
        """``x @ w.T``: returned (pending), or added into ``residual`` in place (None)."""
        return F.linear(x, w)

    def moe_block(
        self,
        pending: torch.Tensor | None,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        moe: SparseMoE,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """A MoE layer's feed-forward ``moe(h)``, ``h`` as in :meth:`norm_linear`: returned
        (pending), or added into ``residual`` in place (None); with ``reduce`` (this rank's
        experts give a partial sum) always returned, reduced."""
        h, residual = add_norm(self, pending, residual, norm, eps)
        out = moe(h)
        return out if reduce is None else reduce(out)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def linear_argmax(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        ids: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x @ w.T, argmax of each row)`` (the logits and their greedy tokens, int64, written
        into ``logits`` and ``ids`` when given)."""
        logits = F.linear(x, w) if logits is None else torch.mm(x, w.t(), out=logits)
        if ids is None:
            return logits, torch.argmax(logits, dim=-1)
        return logits, torch.argmax(logits, dim=-1, out=ids)

    def norm_linear_argmax(
        self,
        residual: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        w: torch.Tensor,
        ids: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`linear_argmax` of ``rmsnorm(residual) * norm`` (``residual`` unchanged)."""
        h, _ = self.add_rmsnorm(residual, None, norm, eps)
        return self.linear_argmax(h, w, ids, logits)

    def embed_fed(
        self, ids: torch.Tensor, src: torch.Tensor, fed: torch.Tensor, table: torch.Tensor
    ) -> torch.Tensor:
        """``table[where(src >= 0, fed[src], ids)]``: row ``i`` embeds the fed token
        ``fed[src[i]]`` where ``src[i] >= 0``, else ``ids[i]``."""
        tok = torch.where(src >= 0, fed[src.clamp(min=0).long()], ids.long())
        return F.embedding(tok, table)

    def rope_attention(
        self, fm: FusedLlama, layer: int, qkv: torch.Tensor, positions: torch.Tensor, a: AttnInputs
    ) -> torch.Tensor:
        """:meth:`qk_rope_store` then :meth:`attention`: the attention output ``[N, Hq, D]``."""
        return self.attention(fm, layer, self.qk_rope_store(fm, layer, qkv, positions, a), a)

    def qk_rope_store(
        self, fm: FusedLlama, layer: int, qkv: torch.Tensor, positions: torch.Tensor, a: AttnInputs
    ) -> torch.Tensor:
        from cloud_engine.attention_torch import store_kv

        n, d = qkv.shape[0], fm.d
        q, k, v = qkv.split([fm.hq * d, fm.hkv * d, fm.hkv * d], dim=1)
        q, k, v = q.reshape(n, fm.hq, d), k.reshape(n, fm.hkv, d), v.reshape(n, fm.hkv, d)
        w = fm.layers[layer]

        def norm(x: torch.Tensor, wt: torch.Tensor | None) -> torch.Tensor:
            x = x.float()
            if wt is None:
                return x
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + fm.eps) * wt.float()

        cs = fm.cos_sin[positions.long()]
        cos, sin = cs[:, None, : d // 2], cs[:, None, d // 2 :]

        def rope(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x[..., : d // 2], x[..., d // 2 :]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

        qr = rope(norm(q, w.q_norm)).to(qkv.dtype)
        kr = rope(norm(k, w.k_norm)).to(qkv.dtype)
        keep = a.slot_mapping >= 0
        store_kv(fm.pool, layer, kr[keep], v[keep], a.slot_mapping[keep].long())
        return qr

    def attention(self, fm: FusedLlama, layer: int, q: torch.Tensor, a: AttnInputs) -> torch.Tensor:
        from cloud_engine.attention_torch import paged_attention

        return paged_attention(fm.pool, layer, q, a.torch_meta)  # type: ignore[arg-type]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        g, u = gate_up.chunk(2, dim=-1)
        return (F.silu(g.float()) * u.float()).to(gate_up.dtype)
