"""SmoothQuant for the edge's int8 graph: per input channel, move part of each RMSNorm-fed
MatMul's activation range into its weights before the weights are quantized.

``MatMulNBits`` with ``accuracy_level=4`` quantizes every activation row to int8 by blocks, so
a channel far larger than its block's neighbours costs them their precision. The attention and
MLP inputs are a norm's output ``x * gamma`` (``(Skip)SimplifiedLayerNormalization`` in the gqa
graph, a ``Mul`` in the concat graph) read only by MatMuls: dividing ``gamma`` by ``s`` and
multiplying those MatMuls' weight rows by ``s`` leaves the fp32 function unchanged and flattens
the activations the kernel quantizes. With SmoothQuant's rule
``s_j = max|X_j|**ALPHA / max|W_j|**(1 - ALPHA)``, the maxima ``X_j`` taken on a shipped
calibration set (``data/calibration.json``, apart from the quality gate's set).

The graph's ops, hence its speed, are unchanged. On the default model the smoothed int8
graph's reference NLL is within 0.6% of fp32's; its count of the gate's plain questions rests on
a few near ties (``bench/gate_stability.py``: 15 to 19 of 24 over near-identical copies, fp32
19), so the gate keeps it on some CPUs and not on others.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from edge_runtime.graph_info import GraphInfo

ALPHA = 0.5  # SmoothQuant's migration strength (the paper's default)
NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
_FLOOR = 1e-5  # a channel never seen active, or a zero weight row, keeps a finite scale


def calibration_prompts() -> tuple[str, ...]:
    """The shipped calibration prompts (user turns)."""
    raw = resources.files("edge_runtime").joinpath("data/calibration.json").read_bytes()
    return tuple(json.loads(raw)["prompts"])


@dataclass(frozen=True)
class Site:
    """A place :func:`smooth` may rescale: ``node``'s output is ``x * gamma`` per channel
    (``gamma`` a 1-D initializer only it reads) and feeds only ``matmuls``, each with a 2-D
    initializer weight only it reads."""

    node: onnx.NodeProto
    gamma: str
    matmuls: tuple[onnx.NodeProto, ...]

    @property
    def output(self) -> str:
        return self.node.output[0]


def smoothing_sites(model: onnx.ModelProto) -> list[Site]:
    """The norms whose outputs feed only MatMuls: ``(Skip)SimplifiedLayerNormalization`` (the
    gqa graph) or the ``Mul`` by the norm's weight that ends a norm in standard ops (the concat
    graph, whose q, k and v MatMuls share one)."""
    inits = {t.name: t for t in model.graph.initializer}
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)

    def own(name: str, dims: int) -> bool:  # an initializer of that rank read by one node
        return name in inits and len(inits[name].dims) == dims and len(users[name]) == 1

    sites = []
    for node in model.graph.node:
        if node.op_type in NORMS:
            gamma = node.input[NORMS.index(node.op_type) + 1]
        elif node.op_type == "Mul":
            gamma = next((i for i in node.input if i in inits), "")
        else:
            continue
        fed = users.get(node.output[0], [])
        if (
            own(gamma, 1)
            and fed
            and all(
                f.op_type == "MatMul" and f.input[0] == node.output[0] and own(f.input[1], 2)
                for f in fed
            )
        ):
            sites.append(Site(node, gamma, tuple(fed)))
    return sites


def _feed(info: GraphInfo, ids: list[int]) -> dict[str, np.ndarray]:
    """The inputs of one prefill of ``ids`` from an empty cache, as the decoder feeds them."""
    t = len(ids)
    feed: dict[str, np.ndarray] = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, t), np.int64),
    }
    if info.has_position_ids:
        feed["position_ids"] = np.arange(t, dtype=np.int64)[None]
    if info.has_logits_to_keep:
        feed["logits_to_keep"] = np.ones(1, np.int64)  # the last position's logits only
    past = np.zeros((1, info.num_kv_heads, 0, info.head_dim), info.kv_dtype)
    for layer in range(info.num_layers):
        for kv in ("key", "value"):
            feed[info.past_name(layer, kv)] = past
    return feed


def activation_max(
    model: onnx.ModelProto,
    info: GraphInfo,
    prompts: list[list[int]],
    threads: int | None = None,
) -> dict[str, np.ndarray]:
    """Per channel, the largest |value| of each smoothable norm's output over ``prompts``
    (token ids, each prefilled alone), run by ONNX Runtime on the CPU; ``info``: the graph's
    layout (:func:`edge_runtime.graph_info.read_graph_info`)."""
    import onnxruntime as ort

    names = [site.output for site in smoothing_sites(model)]
    if not names:
        return {}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for name in names:
        probe.graph.output.append(
            onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
        )
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # errors only: the probe's warnings are not the user's business
    if threads:
        opts.intra_op_num_threads = threads
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix="edgecloud-calib-") as tmp:
        path = Path(tmp) / "probe.onnx"
        onnx.save(probe, str(path), save_as_external_data=True, location="probe.data")
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        for ids in prompts:
            for name, value in zip(names, session.run(names, _feed(info, ids)), strict=True):
                m = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0)
                out[name] = m if name not in out else np.maximum(out[name], m)
    return out


def smooth(model: onnx.ModelProto, amax: dict[str, np.ndarray], alpha: float = ALPHA) -> int:
    """Rescale every site of :func:`smoothing_sites` whose output ``amax`` covers (in place;
    the fp32 function is unchanged up to rounding); the number of sites rescaled."""
    inits = {t.name: t for t in model.graph.initializer}
    done = 0
    for site in smoothing_sites(model):
        a = amax.get(site.output)
        if a is None:
            continue
        weights = [
            numpy_helper.to_array(inits[m.input[1]]).astype(np.float32) for m in site.matmuls
        ]
        w_max = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)  # per input channel
        s = np.maximum(a, _FLOOR) ** alpha / np.maximum(w_max, _FLOOR) ** (1 - alpha)
        s = (s / np.exp(np.log(s).mean())).astype(np.float32)  # geometric mean 1
        gamma = numpy_helper.to_array(inits[site.gamma]).astype(np.float32)
        inits[site.gamma].CopyFrom(numpy_helper.from_array(gamma / s, site.gamma))
        for m, w in zip(site.matmuls, weights, strict=True):
            inits[m.input[1]].CopyFrom(numpy_helper.from_array(w * s[:, None], m.input[1]))
        done += 1
    return done
