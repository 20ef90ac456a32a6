"""The export driver: the decoder wrapper and ``torch.onnx.export`` of a model folder.

The graph layout is fixed: ``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.N.key|value`` in; ``logits``, ``present.N.key|value`` out; k/v
``[B, Hkv, S, D]``; every axis dynamic except heads and head_dim (``position_ids`` stays an input
even where ``graph_passes.implicit_gqa_positions`` later leaves it unread). Weights and layer
math are the reference model's (``cloud_engine.model``); only the attention backend
(``torch_attention``) and, for ``gqa``, the export-friendly modules (``torch_modules``) differ.
With ``torch_ops`` these are the only modules of ``edge_runtime`` that import torch, and they
run only inside the export step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cloud_engine.model.llama import LlamaForCausalLM
from edge_runtime.torch_attention import AttentionKind, ConcatBackend, GqaBackend
from edge_runtime.torch_modules import prepare_for_export
from edge_runtime.torch_ops import CUSTOM_TRANSLATIONS


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
            custom_translation_table=CUSTOM_TRANSLATIONS,
            optimize=True,
        )
    assert program is not None
    program.save(str(onnx_path), external_data=True)
    return TorchExportResult(onnx_path, inputs, outputs)
