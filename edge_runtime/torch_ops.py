"""Custom torch ops for the export and their ONNX translations.

``gqa_op`` has ``com.microsoft.GroupQueryAttention``'s semantics (right-padded rows: row ``b``
holds ``sum(attention_mask[b])`` valid positions and its new keys and values are written at the
row's own offset) and ``rms_norm_op`` is the reference RMSNorm; each has a fake (shape-only)
implementation for the tracer and an onnxscript translation (``CUSTOM_TRANSLATIONS``) that
emits one ONNX Runtime node. The torch body and the ONNX node compute the same thing; torch is
imported here only during the export step.
"""

from __future__ import annotations

import torch


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


CUSTOM_TRANSLATIONS = {
    torch.ops.edgecloud_export.gqa.default: _gqa_onnx,
    torch.ops.edgecloud_export.rms_norm.default: _rms_norm_onnx,
}
