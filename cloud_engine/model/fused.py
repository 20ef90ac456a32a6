"""The fused model: :class:`FusedLlama` over the paged KV pool, its layers (:class:`FusedLayer`:
q|k|v concatenated into one projection, gate|up into another) and a step's attention inputs
(:class:`AttnInputs`), run through an op set (``model.torch_ops``, ``model.triton_ops``) on a
flat ragged batch of tokens; ``forward`` takes a layer range and a hidden state (pipeline
stages), and a tensor-parallel shard's head-split projections are all-reduced after o and down.
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
from cloud_engine.model.torch_ops import TorchOps, add_norm

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
        out, _ = add_norm(self.ops, pending, residual, self.final_norm, self.eps)
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
        out, _ = add_norm(self.ops, pending, residual, self.final_norm, self.eps)
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
