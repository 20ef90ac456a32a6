"""Export-friendly replacements for the reference model's layers, for the ``gqa`` graph.

Each module takes the reference layer's own weights (packed or copied, never changed), so the
graph computes exactly what the torch reference computes: RMSNorm as one
SimplifiedLayerNormalization node, the MLP's gate and up as one MatMul, q/k/v as one projection
handed to GroupQueryAttention (which applies RoPE itself when the head size is a multiple of 16).
``prepare_for_export`` unties the head and swaps the modules in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cloud_engine.model.config import ModelConfig
from cloud_engine.model.llama import (
    MLP,
    Attention,
    LlamaForCausalLM,
    RMSNorm,
    apply_rotary,
    rope_inv_freq,
)
from edge_runtime.torch_attention import AttentionKind, GqaBackend
from edge_runtime.torch_ops import rms_norm_op


class ExportRMSNorm(nn.Module):
    """The reference RMSNorm's weight and epsilon, as one SimplifiedLayerNormalization node."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_op(x, self.weight, self.eps)


class PackedMLP(nn.Module):
    """SwiGLU with gate and up packed into one weight (one MatMul, one Split)."""

    def __init__(self, mlp: MLP) -> None:
        super().__init__()
        w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
        self.gate_up = nn.Linear(w.shape[1], w.shape[0], bias=False)
        self.gate_up.weight = nn.Parameter(w.detach().clone())
        self.down_proj = mlp.down_proj
        self.ffn = mlp.gate_proj.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split([self.ffn, self.ffn], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class GqaAttention(nn.Module):
    """The reference attention's weights with q, k, v packed into one projection, handed to
    GroupQueryAttention, which applies RoPE (rotate-half, from the model's own frequencies)
    when the head size allows it (a multiple of 16), else the reference rotation is used."""

    def __init__(self, attn: Attention, cfg: ModelConfig, rope: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.layer = attn.layer
        self.hq, self.hkv, self.d = attn.hq, attn.hkv, attn.d
        weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        w = torch.cat(weights, dim=0)
        bias = cfg.attention_bias
        self.qkv = nn.Linear(w.shape[1], w.shape[0], bias=bias)
        self.qkv.weight = nn.Parameter(w.detach().clone())
        if bias:
            b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            self.qkv.bias = nn.Parameter(b.detach().clone())
        self.o_proj = attn.o_proj
        self.q_norm = ExportRMSNorm(attn.q_norm) if attn.q_norm is not None else None
        self.k_norm = ExportRMSNorm(attn.k_norm) if attn.k_norm is not None else None
        self.fused_rope = self.d % 16 == 0
        self.register_buffer("cos_cache", rope[0], persistent=False)
        self.register_buffer("sin_cache", rope[1], persistent=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: GqaBackend
    ) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        rope = (self.cos_cache, self.sin_cache) if self.fused_rope else None
        if self.q_norm is None and self.fused_rope:
            out = backend.run(self.layer, qkv, None, None, rope)
        else:
            q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], -1)
            q, k = q.view(b, t, self.hq, self.d), k.view(b, t, self.hkv, self.d)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if not self.fused_rope:
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out = backend.run(self.layer, q.reshape(b, t, -1), k.reshape(b, t, -1), v, rope)
        return self.o_proj(out)


def rope_tables(cfg: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[max_positions, D/2]`` cos and sin, computed exactly as the reference Rotary does."""
    inv = rope_inv_freq(cfg)
    freqs = torch.arange(max_positions).float().unsqueeze(-1) * inv
    return freqs.cos(), freqs.sin()


def prepare_for_export(model: LlamaForCausalLM, attention: AttentionKind) -> None:
    """Untie the head; for ``gqa`` swap in the export-friendly modules (same weights)."""
    if model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    if attention != "gqa":
        return
    cfg = model.config
    rope = rope_tables(cfg, cfg.max_position_embeddings)
    body = model.model
    for layer in body.layers:
        layer.self_attn = GqaAttention(layer.self_attn, cfg, rope)
        layer.mlp = PackedMLP(layer.mlp)
        layer.input_layernorm = ExportRMSNorm(layer.input_layernorm)
        layer.post_attention_layernorm = ExportRMSNorm(layer.post_attention_layernorm)
    body.norm = ExportRMSNorm(body.norm)
