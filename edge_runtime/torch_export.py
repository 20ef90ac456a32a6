"""The torch side of the export: attention backends written for ONNX, and the decoder wrapper.

This is the only module of ``edge_runtime`` that imports torch; it runs only inside the export
step. The weights and the layer math are the reference model's (``cloud_engine.model``); only the
attention backend differs, so the graph computes exactly what the torch reference computes.

Two attention flavours, one graph layout (``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.N.key|value`` in; ``logits``, ``present.N.key|value`` out; k/v ``[B, Hkv, S, D]``):

- ``gqa``: ONNX Runtime's ``com.microsoft.GroupQueryAttention``. Row ``b`` holds
  ``sum(attention_mask[b])`` valid positions (right padded); the new keys and values are written
  at the row's own offset. When ``present`` is bound to the same memory as ``past``, the cache is
  updated in place: no reallocation and no copy of the cache per token. (After the export,
  ``graph_passes.implicit_gqa_positions`` lets the node take its positions from the mask;
  ``position_ids`` stays an input of the graph, unread.)
- ``concat``: standard ONNX only (portable to execution providers without contrib ops):
  ``present = concat(past, new)`` and ``attention_mask`` covers past plus new positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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

AttentionKind = Literal["gqa", "concat"]


# --- custom ops: torch semantics, fake shapes, ONNX translations --------------------------------


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@torch.library.custom_op("edgecloud_export::gqa", mutates_args=())
def gqa_op(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    do_rotary: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """com.microsoft.GroupQueryAttention semantics (right-padded rows, in-place write).

    ``query`` is ``[B, T, Hq*D]``, or packed ``[B, T, (Hq + 2*Hkv)*D]`` when key and value are
    None; past ``[B, Hkv, P, D]``; mask ``[B, L]``. Row b holds ``len_b = sum(mask[b])``
    positions after this call; its new tokens go to ``len_b - T .. len_b - 1``. With
    ``do_rotary`` q and k are rotated (rotate-half) by ``position_ids`` through the
    ``[max_pos, D/2]`` caches. Returns output ``[B, T, Hq*D]`` and presents
    ``[B, Hkv, max(P, L), D]``.
    """
    b, t, _ = query.shape
    d = past_k.shape[-1]
    if key is None or value is None:
        q_size, kv_size = num_heads * d, kv_num_heads * d
        query, key, value = query.split([q_size, kv_size, kv_size], dim=-1)
    cap = max(past_k.shape[2], attention_mask.shape[1])
    present_k = query.new_zeros(b, kv_num_heads, cap, d)
    present_v = query.new_zeros(b, kv_num_heads, cap, d)
    present_k[:, :, : past_k.shape[2]] = past_k
    present_v[:, :, : past_v.shape[2]] = past_v
    out = query.new_zeros(b, t, num_heads * d)
    groups = num_heads // kv_num_heads
    lens = attention_mask.sum(dim=1).tolist()
    for row in range(b):
        n = int(lens[row])
        start = n - t
        q = query[row].view(t, num_heads, d)
        k = key[row].view(t, kv_num_heads, d)
        if do_rotary:
            assert cos_cache is not None and sin_cache is not None
            pos = position_ids[row] if position_ids is not None else torch.arange(start, n)
            cos = torch.cat((cos_cache[pos], cos_cache[pos]), -1)[:, None]
            sin = torch.cat((sin_cache[pos], sin_cache[pos]), -1)[:, None]
            q, k = _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)
        present_k[row, :, start:n] = k.transpose(0, 1)
        present_v[row, :, start:n] = value[row].view(t, kv_num_heads, d).transpose(0, 1)
        keys = present_k[row, :, :n].repeat_interleave(groups, dim=0)  # [Hq, n, D]
        vals = present_v[row, :, :n].repeat_interleave(groups, dim=0)
        scores = q.transpose(0, 1) @ keys.transpose(1, 2) * scale
        causal = torch.arange(n)[None, :] <= torch.arange(start, n)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[row] = (scores.softmax(-1) @ vals).transpose(0, 1).reshape(t, num_heads * d)
    return out, present_k, present_v


@gqa_op.register_fake
def _gqa_fake(query, key, value, past_k, past_v, attention_mask, *_rest):  # type: ignore[no-untyped-def]
    num_heads, kv_num_heads = _rest[3], _rest[4]
    b, t, _ = query.shape
    cap = torch.sym_max(past_k.shape[2], attention_mask.shape[1])
    d = past_k.shape[-1]
    return (
        query.new_empty(b, t, num_heads * d),
        query.new_empty(b, kv_num_heads, cap, d),
        query.new_empty(b, kv_num_heads, cap, d),
    )


@torch.library.custom_op("edgecloud_export::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference RMSNorm (computed in float32), exported as SimplifiedLayerNormalization."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps):  # type: ignore[no-untyped-def]
    return torch.empty_like(x)


def _gqa_schema():  # type: ignore[no-untyped-def]
    """A local (unregistered) schema of com.microsoft.GroupQueryAttention for the tracer."""
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    opt = OpSchema.FormalParameterOption.Optional
    attr = OpSchema.Attribute
    return OpSchema(
        "GroupQueryAttention",
        "com.microsoft",
        1,
        inputs=[
            param("query", "T"),
            param("key", "T", param_option=opt),
            param("value", "T", param_option=opt),
            param("past_key", "T", param_option=opt),
            param("past_value", "T", param_option=opt),
            param("seqlens_k", "M"),
            param("total_sequence_length", "M"),
            param("cos_cache", "T", param_option=opt),
            param("sin_cache", "T", param_option=opt),
            param("position_ids", "P", param_option=opt),
        ],
        outputs=[param("output", "T"), param("present_key", "T"), param("present_value", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)"], ""),
            ("M", ["tensor(int32)"], ""),
            ("P", ["tensor(int64)"], ""),
        ],
        attributes=[
            attr("num_heads", OpSchema.AttrType.INT, ""),
            attr("kv_num_heads", OpSchema.AttrType.INT, ""),
            attr("scale", OpSchema.AttrType.FLOAT, ""),
            attr("do_rotary", OpSchema.AttrType.INT, ""),
        ],
    )


def _gqa_onnx(  # type: ignore[no-untyped-def]
    query,
    key,
    value,
    past_k,
    past_v,
    attention_mask,
    position_ids,
    cos_cache,
    sin_cache,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    do_rotary: bool,
):
    """seqlens_k and total_sequence_length are derived from the mask in-graph."""
    from onnxscript import opset18 as op
    from onnxscript.values import Op, Opset

    gqa = Op(Opset("com.microsoft", 1), "GroupQueryAttention", _gqa_schema())
    axis = op.Constant(value_ints=[1])
    seqlens = op.Cast(op.Sub(op.ReduceSum(attention_mask, axis, keepdims=0), 1), to=6)
    total = op.Cast(op.Squeeze(op.Shape(attention_mask, start=1, end=2)), to=6)
    return gqa(
        query,
        key,
        value,
        past_k,
        past_v,
        seqlens,
        total,
        cos_cache,
        sin_cache,
        position_ids,
        num_heads=num_heads,
        kv_num_heads=kv_num_heads,
        scale=scale,
        do_rotary=int(do_rotary),
    )


def _rms_norm_onnx(x, weight, eps: float):  # type: ignore[no-untyped-def]
    from onnxscript import opset18 as op
    from onnxscript.values import Op, Opset

    schema = _simplified_ln_schema()
    sln = Op(Opset("", 1), "SimplifiedLayerNormalization", schema)
    del op
    return sln(x, weight, axis=-1, epsilon=eps, stash_type=1)


def _simplified_ln_schema():  # type: ignore[no-untyped-def]
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    attr = OpSchema.Attribute
    return OpSchema(
        "SimplifiedLayerNormalization",
        "",
        1,
        inputs=[param("X", "T"), param("scale", "T")],
        outputs=[param("Y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
        attributes=[
            attr("axis", OpSchema.AttrType.INT, ""),
            attr("epsilon", OpSchema.AttrType.FLOAT, ""),
            attr("stash_type", OpSchema.AttrType.INT, ""),
        ],
    )


# --- attention backends and export-friendly modules ---------------------------------------------


class GqaBackend:
    """Holds the graph's past tensors, mask and positions; collects the presents."""

    def __init__(
        self,
        cfg: ModelConfig,
        past: list[torch.Tensor],
        mask: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> None:
        self.cfg, self.past, self.mask, self.position_ids = cfg, past, mask, position_ids
        self.presents: list[torch.Tensor] = []
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The reference-model entry point: q, k already rotated (``[B, T, H, D]``)."""
        b, t, hq, d = q.shape
        out = self.run(layer, q.reshape(b, t, hq * d), k.reshape(b, t, -1), v.reshape(b, t, -1))
        return out.view(b, t, hq, d)

    def run(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        out, pk, pv = gqa_op(
            query,
            key,
            value,
            self.past[2 * layer],
            self.past[2 * layer + 1],
            self.mask,
            self.position_ids if rope is not None else None,
            rope[0] if rope is not None else None,
            rope[1] if rope is not None else None,
            self.cfg.num_attention_heads,
            self.cfg.num_key_value_heads,
            self.scale,
            rope is not None,
        )
        self.presents += [pk, pv]
        return out


class ConcatBackend:
    """Standard ops only: ``present = concat(past, new)``; the mask spans past plus new.

    Query i of a chunk of T sits at index ``L - T + i`` of the concatenation (L = mask length)
    and sees key j iff ``j <= L - T + i`` and ``mask[b, j] == 1``.
    """

    def __init__(self, cfg: ModelConfig, past: list[torch.Tensor], mask: torch.Tensor) -> None:
        self.cfg, self.past = cfg, past
        self.presents: list[torch.Tensor] = []
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.mask = mask
        self._bias: torch.Tensor | None = None

    def _additive_bias(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        if self._bias is None:
            total = self.mask.shape[1]
            keys = torch.arange(total, device=self.mask.device)
            queries = torch.arange(t, device=self.mask.device) + (total - t)
            visible = (keys[None, :] <= queries[:, None])[None] & (self.mask[:, None, :] > 0)
            neg = torch.full((), torch.finfo(dtype).min, dtype=dtype)
            bias = torch.where(visible, torch.zeros((), dtype=dtype), neg)
            self._bias = bias[:, None, None]  # [B, 1, 1, T, L]
        return self._bias

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, hq, d = q.shape
        hkv = self.cfg.num_key_value_heads
        keys = torch.cat([self.past[2 * layer], k.transpose(1, 2)], dim=2)  # [B, Hkv, L, D]
        vals = torch.cat([self.past[2 * layer + 1], v.transpose(1, 2)], dim=2)
        self.presents += [keys, vals]
        qg = q.transpose(1, 2).reshape(b, hkv, self.groups, t, d)  # [B, Hkv, G, T, D]
        scores = qg @ keys.unsqueeze(2).transpose(-1, -2) * (1.0 / math.sqrt(d))
        probs = (scores + self._additive_bias(t, q.dtype)).softmax(-1)
        out = probs @ vals.unsqueeze(2)  # [B, Hkv, G, T, D]
        return out.reshape(b, hq, t, d).transpose(1, 2)


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


# --- the wrapper module and the export call ------------------------------------------------------


class DecoderForExport(nn.Module):
    """``(input_ids, attention_mask, position_ids, past) -> (logits, *presents)``.

    ``past`` is the flat list ``[k0, v0, k1, v1, ...]``, each ``[B, Hkv, P, D]``.
    """

    def __init__(self, model: LlamaForCausalLM, attention: AttentionKind) -> None:
        super().__init__()
        self.model = model
        self.attention = attention

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        cfg = self.model.config
        backend: GqaBackend | ConcatBackend
        if self.attention == "gqa":
            backend = GqaBackend(cfg, past, attention_mask, position_ids)
        else:
            backend = ConcatBackend(cfg, past, attention_mask)
        hidden = self.model.hidden_states(input_ids, position_ids, backend)
        logits = self.model.lm_head(hidden)
        return (logits, *backend.presents)


@dataclass(frozen=True)
class TorchExportResult:
    onnx_path: Path
    input_names: list[str]
    output_names: list[str]


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def export_decoder(
    model_folder: Path, onnx_path: Path, attention: AttentionKind = "gqa"
) -> TorchExportResult:
    """Export the model in ``model_folder`` (fp32, untied head) to ``onnx_path`` (+ ``.data``).

    Example sizes are above 1 everywhere (batch 2, new 3, past 5) so that no axis is
    specialized; every axis of every input is dynamic except heads and head_dim.
    """
    from cloud_engine.model.loader import load_model

    torch.manual_seed(0)
    model = load_model(model_folder, dtype=torch.float32)
    prepare_for_export(model, attention)
    cfg = model.config
    wrapper = DecoderForExport(model, attention).eval()

    batch, new, past_len = 2, 3, 5
    ids = torch.randint(0, cfg.vocab_size, (batch, new), dtype=torch.int64)
    mask = torch.ones(batch, past_len + new, dtype=torch.int64)
    pos = torch.arange(past_len, past_len + new, dtype=torch.int64).expand(batch, new).contiguous()
    past = [
        torch.randn(batch, cfg.num_key_value_heads, past_len, cfg.head_dim)
        for _ in range(2 * cfg.num_hidden_layers)
    ]
    dyn = torch.export.Dim.DYNAMIC
    dynamic_shapes: dict[str, Any] = {
        "input_ids": {0: dyn, 1: dyn},
        "attention_mask": {0: dyn, 1: dyn},
        "position_ids": {0: dyn, 1: dyn},
        "past": [{0: dyn, 2: dyn} for _ in past],
    }
    inputs, outputs = io_names(cfg.num_hidden_layers)
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode(False), torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            (ids, mask, pos, past),
            dynamo=True,
            opset_version=18,
            dynamic_shapes=dynamic_shapes,
            input_names=inputs,
            output_names=outputs,
            custom_translation_table={
                torch.ops.edgecloud_export.gqa.default: _gqa_onnx,
                torch.ops.edgecloud_export.rms_norm.default: _rms_norm_onnx,
            },
            optimize=True,
        )
    assert program is not None
    program.save(str(onnx_path), external_data=True)
    return TorchExportResult(onnx_path, inputs, outputs)
