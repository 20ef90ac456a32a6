"""What the runtime needs to know about a decoder graph, read from its JSON or from the graph.

A graph follows the ONNX-community decoder layout: inputs ``input_ids``, ``attention_mask``,
optionally ``position_ids`` and ``logits_to_keep``, and ``past_key_values.N.key|value``
(``[batch, kv_heads, past, head_dim]``); outputs ``logits`` and ``present.N.key|value``.

Invariants:
- ``attention`` is ``"gqa"`` exactly when the graph contains ``com.microsoft.GroupQueryAttention``
  nodes (then the cache may be updated in place); otherwise ``"concat"``.
- ``ExportMeta`` is written by the export next to the graph; ``GraphInfo`` is always derived from
  the graph itself, so graphs exported elsewhere (no JSON) run too.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

META_FILE = "edgecloud_export.json"
GRAPH_FILE = "model.onnx"
META_FORMAT = 3  # 3: GroupQueryAttention positions from the mask (position_ids kept, unread)

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_ONNX_TO_NUMPY = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
}


@dataclass(frozen=True)
class GraphInfo:
    """Shapes and options of a decoder graph, derived from its inputs, outputs and nodes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int | None
    attention: Literal["gqa", "concat"]
    kv_dtype: str  # numpy dtype name of the past/present tensors
    has_position_ids: bool
    has_logits_to_keep: bool
    extra_inputs: tuple[str, ...] = ()  # inputs the runtime does not know (an error if required)
    context_length: int | None = None  # when the folder says (onnxruntime-genai's config)

    def past_name(self, layer: int, kv: str) -> str:
        return f"past_key_values.{layer}.{kv}"

    def present_name(self, layer: int, kv: str) -> str:
        return f"present.{layer}.{kv}"


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    out: list[int | str] = []
    for d in value.type.tensor_type.shape.dim:
        out.append(d.dim_value if d.HasField("dim_value") else d.dim_param)
    return out


def _genai_config(graph_path: Path) -> dict[str, Any]:
    """The decoder section of an onnxruntime-genai ``genai_config.json`` next to the graph."""
    path = graph_path.parent / "genai_config.json"
    if not path.is_file():
        return {}
    model = json.loads(path.read_text()).get("model", {})
    return {**model.get("decoder", {}), "context_length": model.get("context_length")}


def read_graph_info(graph_path: Path) -> GraphInfo:
    """Derive :class:`GraphInfo` from the graph (weights are not loaded).

    A symbolic head size (onnxruntime-genai graphs) is taken from ``genai_config.json``.
    """
    graph_path = Path(graph_path)
    model = onnx.load(str(graph_path), load_external_data=False)
    genai = _genai_config(graph_path)
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    inputs = {i.name: i for i in graph.input}
    layers: set[int] = set()
    kv_heads = head_dim = 0
    kv_dtype = "float32"
    for name, value in inputs.items():
        m = _PAST.match(name)
        if not m:
            continue
        layers.add(int(m.group(1)))
        dims = _dims(value)
        if len(dims) == 4 and not isinstance(dims[3], int) and genai.get("head_size"):
            dims[3] = int(genai["head_size"])
        if len(dims) != 4 or not isinstance(dims[1], int) or not isinstance(dims[3], int):
            raise ValueError(f"{name}: expected [batch, kv_heads, past, head_dim], got {dims}")
        kv_heads, head_dim = dims[1], dims[3]
        elem = value.type.tensor_type.elem_type
        if elem not in _ONNX_TO_NUMPY:
            raise ValueError(f"{name}: unsupported KV element type {elem}")
        kv_dtype = np.dtype(_ONNX_TO_NUMPY[elem]).name
    if not layers or sorted(layers) != list(range(len(layers))):
        raise ValueError(f"{graph_path}: no past_key_values.N.key|value inputs in 0..N-1")
    for required in ("input_ids", "attention_mask"):
        if required not in inputs:
            raise ValueError(f"{graph_path}: missing input {required!r}")
    known = {"input_ids", "attention_mask", "position_ids", "logits_to_keep"}
    extra = tuple(
        n for n in inputs if n not in known and not _PAST.match(n) and n not in initializers
    )
    vocab: int | None = None
    for out in graph.output:
        if out.name == "logits":
            last = _dims(out)[-1] if _dims(out) else None
            vocab = last if isinstance(last, int) else None
    gqa = any(
        n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft" for n in graph.node
    )
    return GraphInfo(
        num_layers=len(layers),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        attention="gqa" if gqa else "concat",
        kv_dtype=kv_dtype,
        has_position_ids="position_ids" in inputs,
        has_logits_to_keep="logits_to_keep" in inputs,
        extra_inputs=extra,
        context_length=genai.get("context_length"),
    )


@dataclass
class ExportMeta:
    """The JSON written next to an exported graph (``edgecloud_export.json``)."""

    model_name: str
    model_identity: str
    variant: str  # fp32 | int8 | int4
    attention: str  # gqa | concat
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_length: int
    tokenizer_dir: str
    eos_token_ids: list[int]
    graph_file: str = GRAPH_FILE
    export_seconds: float = 0.0
    created_unix: float = 0.0
    tool_versions: dict[str, str] = field(default_factory=dict)
    format: int = META_FORMAT
    # how an int8 graph was quantized (``edge_runtime.quantize.INT8_METHODS``); "" otherwise,
    # and in int8 folders written before the field (they are ``per_tensor``)
    quantization: str = ""

    def write(self, folder: Path) -> None:
        (folder / META_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, folder: Path) -> ExportMeta | None:
        path = folder / META_FILE
        if not path.is_file():
            return None
        data: dict[str, Any] = json.loads(path.read_text())
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})
