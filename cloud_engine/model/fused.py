"""The reference model's weights rearranged for speed over the paged KV pool.

Per layer: q|k|v concatenated into one projection and gate|up into another, so a layer is
nine kernels: add+RMSNorm, qkv GEMM, q/k norm + RoPE + KV store, paged attention, o GEMM,
add+RMSNorm, gate_up GEMM, SwiGLU, down GEMM (the residual add is folded into the next norm).
Tokens are a flat ragged batch ``[N]``; the per-step attention inputs come in
:class:`AttnInputs`.

The elementwise and attention work goes through an :class:`Ops` object: ``TritonOps`` on CUDA
(``cloud_engine.kernels``), ``TorchOps`` anywhere (the reference for tests). For pipeline
parallelism ``forward`` takes a layer range and a hidden state; for tensor parallelism the
concatenated projections split by heads (qkv, gate_up by rows; o, down by columns) and two
all-reduces per layer go after o and down: nothing here assumes one device holds every head.

Invariant: the weights are the reference model's (concatenation only), so greedy tokens match
the reference up to floating-point rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from cloud_engine.kv_pool import KVPool
from cloud_engine.model.llama import LlamaForCausalLM, rope_inv_freq


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


class Ops(Protocol):
    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def qk_rope_store(
        self, fm: FusedLlama, layer: int, qkv: torch.Tensor, positions: torch.Tensor, a: AttnInputs
    ) -> torch.Tensor: ...

    def attention(
        self, fm: FusedLlama, layer: int, q: torch.Tensor, a: AttnInputs
    ) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class FusedLayer:
    in_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class FusedLlama:
    def __init__(
        self, model: LlamaForCausalLM, pool: KVPool, ops: Ops, consume: bool = False
    ) -> None:
        """``consume=True`` frees the reference model's unfused projections as it goes (the
        reference model is unusable afterwards), so peak memory stays near one model."""
        cfg = model.config
        self.config = cfg
        self.pool = pool
        self.ops = ops
        self.eps = cfg.rms_norm_eps
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layers: list[FusedLayer] = []
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
        self.embed = model.model.embed_tokens.weight.detach()
        self.final_norm = model.model.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        dev = self.embed.device
        inv = rope_inv_freq(cfg).to(dev)
        freqs = torch.arange(cfg.max_position_embeddings, device=dev).float().unsqueeze(1) * inv
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=1).contiguous()  # [P, D] fp32

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (the embedding rows read are negligible)."""
        n = sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for t in (layer.in_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down)
        )
        return n + self.lm_head.numel() * self.lm_head.element_size()

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
        ops = self.ops
        x, residual = (F.embedding(input_ids, self.embed), None) if hidden is None else hidden
        rng = layers if layers is not None else range(len(self.layers))
        n = x.shape[0]
        for i in rng:
            w = self.layers[i]
            h, residual = ops.add_rmsnorm(x, residual, w.in_norm, self.eps)
            qkv = F.linear(h, w.qkv, w.qkv_bias)
            q = ops.qk_rope_store(self, i, qkv, positions, a)
            o = ops.attention(self, i, q, a)
            x = F.linear(o.view(n, self.hq * self.d), w.o)
            h, residual = ops.add_rmsnorm(x, residual, w.post_norm, self.eps)
            x = F.linear(ops.silu_mul(F.linear(h, w.gate_up)), w.down)
        if rng.stop != len(self.layers):
            return x if residual is None else x + residual
        out, _ = ops.add_rmsnorm(x, residual, self.final_norm, self.eps)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)


class TorchOps:
    """Plain-torch ops (any device): the reference for the Triton kernels."""

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        res = x if residual is None else residual.add_(x)
        r32 = res.float()
        y = r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)
        return (y * w.float()).to(x.dtype), res

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


class TritonOps:
    """The CUDA path (also runs under ``TRITON_INTERPRET=1`` for tests)."""

    def __init__(self) -> None:
        from cloud_engine.kernels import activation, attention, norm, rope_store

        self._norm, self._act, self._att, self._rope = norm, activation, attention, rope_store

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm.add_rmsnorm(x, residual, w, eps)

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
