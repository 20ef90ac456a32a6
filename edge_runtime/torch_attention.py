"""The two attention backends the reference model calls while it is traced for export.

Both take the graph's flat ``past`` list ``[k0, v0, k1, v1, ...]`` (k/v ``[B, Hkv, P, D]``) and
collect one present per past in the same order. ``gqa`` hands attention to ``gqa_op``
(GroupQueryAttention: right-padded rows, the cache written in place when ``present`` is bound to
``past``); ``concat`` uses standard ONNX ops only (``present = concat(past, new)``, the mask
spanning past plus new), for execution providers without contrib ops.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from cloud_engine.model.config import ModelConfig
from edge_runtime.torch_ops import gqa_op

AttentionKind = Literal["gqa", "concat"]


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
