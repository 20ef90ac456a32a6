"""The reference model's weights rearranged for speed over the paged KV pool.

Per layer: q|k|v concatenated into one projection and gate|up into another, so a layer is
norm + qkv projection, q/k norm + RoPE + KV store, paged attention, o projection, norm + gate_up
projection + SwiGLU, down projection. Tokens are a flat ragged batch ``[N]``; the per-step
attention inputs come in :class:`AttnInputs`.

The residual stream is carried as ``(pending, residual)``: a projection's output either stays
*pending* (returned, and added by the next norm: one add+RMSNorm kernel, the path for large
batches) or is added into ``residual`` in place by the projection's own kernel (small batches,
``cloud_engine.kernels.gemv``), leaving nothing pending. Each op takes and keeps this contract,
so the two paths mix freely.

The work goes through an op set: ``TorchOps`` anywhere (the reference for tests, and the base
that states each op's contract), ``TritonOps`` on CUDA (``cloud_engine.kernels``, cuBLAS for
large products, the torch ops where no kernel applies). For pipeline
parallelism ``forward`` takes a layer range and a hidden state; for tensor parallelism the
concatenated projections split by heads (qkv, gate_up by rows; o, down by columns) and two
all-reduces per layer go after o and down: nothing here assumes one device holds every head.

Invariant: the weights are the reference model's (concatenation only), so greedy tokens match
the reference up to floating-point rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cloud_engine.kv_pool import KVPool
from cloud_engine.model.llama import LlamaForCausalLM, rope_inv_freq

if TYPE_CHECKING:
    from cloud_engine.parallel.model import ShardedLayer, ShardedLlama
    from cloud_engine.parallel.moe import SparseMoE


@dataclass(slots=True)
class AttnInputs:
    """Per-step int32 tensors on the device (see ``cloud_engine.kernels.attention``)."""

    slot_mapping: torch.Tensor  # [N]
    tables: torch.Tensor  # [R, W] block table rows
    seq_rows: torch.Tensor  # [S] row of each sequence in ``tables``
    seq_lens: torch.Tensor  # [S] KV length after this step
    q_start: torch.Tensor  # [S + 1]
    tile_seq: torch.Tensor  # [P]
    tile_q0: torch.Tensor  # [P]
    tile_shape: object  # kernels.attention.TileShape (decode or prefill tiling)
    torch_meta: object | None = None  # attention_torch.PagedMeta, for TorchOps


@dataclass(slots=True)
class FusedLayer:
    in_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # None in a mixture-of-experts layer
    down: torch.Tensor | None
    moe: SparseMoE | None = None  # the routed experts (and shared expert) of a MoE layer

    @classmethod
    def of_shard(cls, b: ShardedLayer) -> FusedLayer:
        return cls(
            b.ln1, b.w_qkv, b.b_qkv, b.q_norm, b.k_norm, b.w_o, b.ln2,
            None if b.moe else b.w_gate_up, None if b.moe else b.w_down, b.moe,
        )  # fmt: skip


class FusedLlama:
    def __init__(
        self,
        model: LlamaForCausalLM | ShardedLlama,
        pool: KVPool,
        ops: TorchOps,
        consume: bool = False,
    ) -> None:
        """From the reference model, or from a whole model loaded by the parallel package
        (``ShardedLlama`` at tp=1, pp=1: the families with mixture-of-experts layers).
        ``consume=True`` frees the reference model's unfused projections as it goes (the
        reference model is unusable afterwards), so peak memory stays near one model."""
        cfg = model.config
        self.config = cfg
        self.pool = pool
        self.ops = ops
        self.eps = cfg.rms_norm_eps
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layers: list[FusedLayer] = []
        if not isinstance(model, LlamaForCausalLM):
            self._from_shard(model)
            return
        with torch.no_grad():
            for layer in model.model.layers:
                at, mlp = layer.self_attn, layer.mlp
                bias = None
                if at.q_proj.bias is not None:
                    bias = torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias])
                self.layers.append(
                    FusedLayer(
                        in_norm=layer.input_layernorm.weight.detach(),
                        qkv=torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]),
                        qkv_bias=bias,
                        q_norm=at.q_norm.weight.detach() if at.q_norm is not None else None,
                        k_norm=at.k_norm.weight.detach() if at.k_norm is not None else None,
                        o=at.o_proj.weight.detach(),
                        post_norm=layer.post_attention_layernorm.weight.detach(),
                        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                        down=mlp.down_proj.weight.detach(),
                    )
                )
                if consume:
                    for lin in (at.q_proj, at.k_proj, at.v_proj, mlp.gate_proj, mlp.up_proj):
                        lin.weight = torch.nn.Parameter(torch.empty(0, device=lin.weight.device))
        self._finish(
            model.model.embed_tokens.weight.detach(),
            model.model.norm.weight.detach(),
            model.lm_head.weight.detach(),
        )

    def _from_shard(self, model: ShardedLlama) -> None:
        """The shard's tensors as they are (already concatenated, nothing copied): its query
        and KV heads, its stage's layers (indexed as in its KV pool), its vocabulary rows of
        the embedding (first stage) and head (last stage). With tp > 1 :attr:`reduce` is set:
        every projection whose output is a partial sum (o, down, the experts) is all-reduced
        before it joins the residual stream."""
        self.hq, self.hkv = model.heads.nq, model.heads.nkv
        self.layers = [FusedLayer.of_shard(b) for b in model.blocks]
        if model.rank.config.tp > 1:
            self.reduce = model.rank.all_reduce
            self.v0 = model.v0
        self._finish(model.embed, model.norm, model.head)

    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # the TP all-reduce, in place

    def _finish(
        self, embed: torch.Tensor | None, final_norm: torch.Tensor | None, head: torch.Tensor | None
    ) -> None:
        """Every stage holds the RoPE table; only the first the embedding, the last the final
        norm and head (None elsewhere)."""
        self.embed, self.final_norm, self.lm_head = embed, final_norm, head  # type: ignore[assignment]
        cfg, dev = self.config, self.pool.device
        inv = rope_inv_freq(cfg).to(dev)
        freqs = torch.arange(cfg.max_position_embeddings, device=dev).float().unsqueeze(1) * inv
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=1).contiguous()  # [P, D] fp32

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (the embedding rows read are negligible;
        of a MoE layer, its router only: which experts a step reads depends on the tokens)."""
        n = sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for t in (layer.in_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down)
            + ((layer.moe.router,) if layer.moe is not None else ())
            if t is not None
        )
        head = self.lm_head
        return n + (head.numel() * head.element_size() if head is not None else 0)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        a: AttnInputs,
        layers: range | None = None,
        hidden: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[N, hidden]`` (after the last layer of ``layers``; a
        pipeline stage that stops earlier gets the raw residual stream)."""
        rng = layers if layers is not None else range(len(self.layers))
        pending, residual = self._layers(input_ids, positions, a, rng, hidden)
        if rng.stop != len(self.layers):
            return residual if pending is None else pending + residual
        out, _ = _add_norm(self.ops, pending, residual, self.final_norm, self.eps)
        return out

    def forward_argmax(
        self,
        positions: torch.Tensor,
        a: AttnInputs,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits_argmax(forward(...), ids)`` from the embeddings ``hidden``, the logits
        written into ``logits`` when given, with the final norm folded into the head's product
        where no residual add is pending (one kernel less per decode step at small batches)."""
        rng = range(len(self.layers))
        pending, residual = self._layers(None, positions, a, rng, hidden)
        if pending is None:
            return self.ops.norm_linear_argmax(
                residual, self.final_norm, self.eps, self.lm_head, ids, logits
            )
        out, _ = _add_norm(self.ops, pending, residual, self.final_norm, self.eps)
        return self.ops.linear_argmax(out, self.lm_head, ids, logits)

    def _layers(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        a: AttnInputs,
        rng: range,
        hidden: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None] | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The residual stream ``(pending, residual)`` after the layers of ``rng``."""
        ops, eps = self.ops, self.eps
        if hidden is None:
            assert input_ids is not None
            hidden = self.embed_ids(input_ids)
        pending, residual = _stream(hidden)
        n = residual.shape[0]
        red = self.reduce
        for i in rng:
            w = self.layers[i]
            qkv, residual = ops.norm_linear(pending, residual, w.in_norm, eps, w.qkv, w.qkv_bias)
            o = ops.rope_attention(self, i, qkv, positions, a).view(n, self.hq * self.d)
            if red is None:
                pending = ops.linear_residual(o, w.o, residual)
            else:  # a partial sum: reduced before it joins the stream
                pending = red(ops.linear(o, w.o))
            if w.moe is not None:
                pending = ops.moe_block(pending, residual, w.post_norm, eps, w.moe, red)
                continue
            assert w.gate_up is not None and w.down is not None
            act, residual = ops.norm_swiglu(pending, residual, w.post_norm, eps, w.gate_up)
            if red is None:
                pending = ops.linear_residual(act, w.down, residual)
            else:
                pending = red(ops.linear(act, w.down))
        return pending, residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.lm_head)

    def logits_argmax(
        self, hidden: torch.Tensor, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, greedy token ids)``, the ids written into ``ids`` when given."""
        return self.ops.linear_argmax(hidden, self.lm_head, ids)

    def embed_fed(self, ids: torch.Tensor, src: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ``where(src >= 0, fed[src], ids)``: a decode step's inputs, some
        of them tokens still on the device (see :meth:`TorchOps.embed_fed`)."""
        return self.ops.embed_fed(ids, src, fed, self.embed)

    v0 = 0  # the first vocabulary row this rank's embedding and head hold (tp > 1)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ``ids``; with tp > 1 each rank embeds the ids in its vocabulary
        rows (zeros for the others) and the all-reduce completes them."""
        if self.reduce is None:
            return F.embedding(ids, self.embed)
        rows = self.embed.shape[0]
        local = ids.long() - self.v0
        mine = (local >= 0) & (local < rows)
        x = F.embedding(local.clamp(0, rows - 1), self.embed) * mine.unsqueeze(1).to(
            self.embed.dtype
        )
        return self.reduce(x)


def _stream(
    hidden: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None],
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(pending, residual)`` from the embeddings or a pipeline stage's ``(x, residual)``."""
    if isinstance(hidden, torch.Tensor):
        return None, hidden
    x, residual = hidden
    return (None, x) if residual is None else (x, residual)


def _add_norm(
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
        h, residual = _add_norm(self, pending, residual, norm, eps)
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
        h, residual = _add_norm(self, pending, residual, norm, eps)
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
        h, residual = _add_norm(self, pending, residual, norm, eps)
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
