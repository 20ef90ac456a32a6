"""Small edits to an exported decoder graph, applied once after the torch export.

- ``name_axes``: readable, consistent names for the dynamic axes of the graph's inputs and outputs
  (``batch``, ``sequence_length``, ``total_sequence_length``, ``past_sequence_length``,
  ``present_sequence_length``), replacing the exporter's ``s0``-style symbols.
- ``fuse_skip_norms``: residual ``Add`` + ``SimplifiedLayerNormalization`` as one
  ``SkipSimplifiedLayerNormalization`` (ONNX Runtime does not fuse them in exported graphs).
- ``add_logits_to_keep``: an optional int64 input ``logits_to_keep`` (shape ``[1]``, default 0)
  that slices the last k positions before the LM head. Its default keeps every position, so
  the graph still returns ``[batch, sequence_length, vocab]`` to callers that do not feed it; the
  runtime feeds 1 during prefill and skips the head's work on every other prompt position.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_PAST = re.compile(r"^past_key_values\.\d+\.(key|value)$")
_PRESENT = re.compile(r"^present\.\d+\.(key|value)$")


def _set_dim(value: onnx.ValueInfoProto, axis: int, name: str) -> None:
    dim = value.type.tensor_type.shape.dim[axis]
    dim.Clear()
    dim.dim_param = name


def name_axes(model: onnx.ModelProto) -> None:
    graph = model.graph
    for value in graph.input:
        if value.name in ("input_ids", "position_ids"):
            _set_dim(value, 0, "batch")
            _set_dim(value, 1, "sequence_length")
        elif value.name == "attention_mask":
            _set_dim(value, 0, "batch")
            _set_dim(value, 1, "total_sequence_length")
        elif _PAST.match(value.name):
            _set_dim(value, 0, "batch")
            _set_dim(value, 2, "past_sequence_length")
    for value in graph.output:
        if value.name == "logits":
            _set_dim(value, 0, "batch")
            _set_dim(value, 1, "sequence_length")
        elif _PRESENT.match(value.name):
            _set_dim(value, 0, "batch")
            _set_dim(value, 2, "present_sequence_length")
    # Intermediate shapes carry the exporter's symbols; they are hints only, so drop them.
    del graph.value_info[:]


def add_logits_to_keep(model: onnx.ModelProto) -> bool:
    """Insert ``Slice(hidden, -k, end, axis=1)`` before the node that produces ``logits``.

    Returns False (graph unchanged) when ``logits`` is not produced by a MatMul/Gemm.
    """
    graph = model.graph
    if any(i.name == "logits_to_keep" for i in graph.input):
        return True
    producer = next((n for n in graph.node if "logits" in n.output), None)
    if producer is None or producer.op_type not in ("MatMul", "Gemm"):
        return False
    hidden = producer.input[0]
    sliced = hidden + "/last_k"
    neg = "logits_to_keep/neg"
    consts = [
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "logits_to_keep/end"),
        numpy_helper.from_array(np.array([1], np.int64), "logits_to_keep/axis"),
    ]
    default = numpy_helper.from_array(np.array([0], np.int64), "logits_to_keep")
    graph.initializer.extend([*consts, default])
    graph.input.append(helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1]))
    nodes = [
        helper.make_node("Neg", ["logits_to_keep"], [neg], name="logits_to_keep/Neg"),
        helper.make_node(
            "Slice",
            [hidden, neg, "logits_to_keep/end", "logits_to_keep/axis"],
            [sliced],
            name="logits_to_keep/Slice",
        ),
    ]
    index = list(graph.node).index(producer)
    for offset, node in enumerate(nodes):
        graph.node.insert(index + offset, node)
    producer.input[0] = sliced
    for value in graph.output:
        if value.name == "logits":
            _set_dim(value, 1, "logits_length")
    return True


def implicit_gqa_positions(model: onnx.ModelProto) -> int:
    """Unwire ``position_ids`` from every ``com.microsoft.GroupQueryAttention`` node (input 9),
    so that each node derives positions from the mask (row ``b``'s new tokens sit right after
    its ``sum(attention_mask[b]) - new`` cached ones, which is how the runtime fills rows).
    The graph input stays, the interface of the ONNX-community layout, read by no node when
    every RoPE is inside these nodes. Returns the number of nodes changed."""
    changed = 0
    for node in model.graph.node:
        gqa = node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft"
        if gqa and len(node.input) > 9 and node.input[9]:
            node.input[9] = ""
            changed += 1
    return changed


def fuse_skip_norms(model: onnx.ModelProto) -> int:
    """``Add(a, b) -> SimplifiedLayerNormalization`` becomes one
    ``com.microsoft.SkipSimplifiedLayerNormalization(a, b, gamma)`` whose fourth output is the
    sum, so the residual stream's other readers are unchanged. Returns the number fused.

    Only Adds of two activations (the residual adds of the decoder layers) qualify.
    """
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    constants = {i.name for i in graph.initializer}
    fused = 0
    drop: list[onnx.NodeProto] = []
    for index, node in enumerate(list(graph.node)):
        if node.op_type != "SimplifiedLayerNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        add = producers.get(node.input[0])
        if add is None or add.op_type != "Add" or any(i in constants for i in add.input):
            continue
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        skip = helper.make_node(
            "SkipSimplifiedLayerNormalization",
            [add.input[0], add.input[1], node.input[1]],
            [node.output[0], "", "", add.output[0]],
            name=f"{node.name or 'norm'}/skip{index}",
            domain="com.microsoft",
            epsilon=eps,
        )
        graph.node.insert(list(graph.node).index(add), skip)  # where the sum was made
        drop += [node, add]
        fused += 1
    for node in drop:
        graph.node.remove(node)
    if fused and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return fused
