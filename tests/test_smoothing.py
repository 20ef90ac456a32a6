"""SmoothQuant on the edge's fp32 graph (the tiny random model's real export, run by ONNX
Runtime): the rescaled graph computes the same logits, and afterwards every channel's
activation maximum stands in the same ratio to its weight row's maximum (what ALPHA = 0.5
means), measured again through the graph."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from edge_runtime.decoder import Decoder
from edge_runtime.export import ensure_export
from edge_runtime.graph_info import read_graph_info
from edge_runtime.smoothing import (
    ALPHA,
    activation_max,
    calibration_prompts,
    smooth,
    smoothing_sites,
)
from routing.prompt import PromptFormatter


def _prompts(folder: Path) -> list[list[int]]:
    fmt = PromptFormatter.from_folder(folder)
    return [fmt.encode_chat([{"role": "user", "content": p}]) for p in calibration_prompts()[:6]]


def _logits(path: Path, ids: list[int]) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return Decoder(session, read_graph_info(path), 1, 256).prefill(0, ids, 0)


def test_calibration_set_is_apart_from_the_quality_set() -> None:
    from edge_runtime.quality_gate import QualitySet

    judged = {p for p, _ in QualitySet.shipped().references}
    judged |= {p for p, _ in QualitySet.shipped().questions}
    prompts = calibration_prompts()
    assert len(prompts) >= 16 and not judged & set(prompts)


@pytest.mark.parametrize("attention", ["gqa", "concat"])
def test_smoothing_keeps_the_function_and_balances_each_channel(
    tiny_model_path: Path, tmp_path: Path, attention: str
) -> None:
    graph = ensure_export(tiny_model_path, "fp32", attention, root=tmp_path / "onnx")
    model = onnx.load(str(graph.graph_path), load_external_data=True)
    sites = smoothing_sites(model)
    info = read_graph_info(graph.graph_path)
    layers = info.num_layers
    assert len(sites) == 2 * layers  # attention and MLP inputs of every layer
    assert {len(site.matmuls) for site in sites} == ({1} if attention == "gqa" else {2, 3})
    prompts = _prompts(graph.folder)
    before = activation_max(model, info, prompts, threads=1)
    assert all(np.isfinite(a).all() and (a > 0).all() for a in before.values())

    assert smooth(model, before) == 2 * layers
    out = tmp_path / "smoothed"
    out.mkdir()
    saved = onnx.ModelProto()
    saved.CopyFrom(model)  # saving moves a proto's tensors out to the data file
    onnx.save(saved, str(out / "model.onnx"), save_as_external_data=True, location="m.data")

    ids = prompts[0]
    want, got = _logits(graph.graph_path, ids), _logits(out / "model.onnx", ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert int(np.argmax(got)) == int(np.argmax(want))

    after = activation_max(model, info, prompts, threads=1)
    weights = {t.name: t for t in model.graph.initializer}
    assert ALPHA == 0.5
    for site in sites:
        w_max = np.max(
            [np.abs(numpy_helper.to_array(weights[m.input[1]])).max(axis=1) for m in site.matmuls],
            axis=0,
        )
        ratio = after[site.output] / w_max  # the same for every channel
        assert ratio.max() / ratio.min() < 1.01, site.node.name


def test_int8_of_a_base_model_calibrates_on_plain_text(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """A model without a chat template (a base model) still gets its int8 graph: the
    calibration prompts go in as plain text."""
    base = tmp_path / "tiny-base"
    shutil.copytree(tiny_model_path, base)
    tcfg = json.loads((base / "tokenizer_config.json").read_text())
    tcfg.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    assert PromptFormatter.from_folder(base).chat_template is None

    graph = ensure_export(base, "int8", root=tmp_path / "onnx")
    logits = _logits(graph.graph_path, PromptFormatter.from_folder(base).encode("Once upon"))
    assert logits.shape == (49152,) and np.isfinite(logits).all()
