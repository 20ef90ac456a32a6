"""Edge export: graph layout, JSON, caching by identity, atomic folders, quantized variants.

The tiny random model exports in a few seconds; the default model's export and its quality
checks (int8/int4 still answer "Paris", greedy agreement with fp32) are marked slow.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edge_runtime import export as export_mod
from edge_runtime.decoder import Decoder
from edge_runtime.export import QUANTIZATION, ensure_export, export_folder
from edge_runtime.graph_info import META_FILE, ExportMeta, read_graph_info
from routing.model_store import resolve


@pytest.fixture(scope="module")
def onnx_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache root for the session: both edge test modules reuse each other's exports."""
    root = tmp_path_factory.getbasetemp() / "edge-onnx"
    root.mkdir(exist_ok=True)
    return root


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _prefill_feeds(info, ids: np.ndarray) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    b, t = ids.shape
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones((b, t), np.int64),
        "position_ids": np.tile(np.arange(t, dtype=np.int64), (b, 1)),
    }
    for layer in range(info.num_layers):
        for kv in ("key", "value"):
            shape = (b, info.num_kv_heads, 0, info.head_dim)
            feeds[info.past_name(layer, kv)] = np.zeros(shape, np.float32)
    return feeds


@pytest.mark.parametrize("attention", ["gqa", "concat"])
def test_export_layout_and_meta(tiny_model_path: Path, onnx_root: Path, attention: str) -> None:
    graph = ensure_export(tiny_model_path, "fp32", attention, root=onnx_root)
    info = read_graph_info(graph.graph_path)
    assert (info.num_layers, info.num_kv_heads, info.head_dim) == (2, 2, 16)
    assert info.vocab_size == 49152
    assert info.attention == attention
    assert info.has_position_ids and info.has_logits_to_keep and info.extra_inputs == ()

    model = onnx.load(str(graph.graph_path), load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    outputs = [o.name for o in model.graph.output]
    expected_in = ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")
    ]
    # GroupQueryAttention takes its positions from the mask (graph_passes.implicit_gqa_positions)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == (2 if attention == "gqa" else 0)
    assert all(len(n.input) < 10 or not n.input[9] for n in gqa)
    assert [n for n in inputs if n != "logits_to_keep"] == expected_in
    assert outputs == ["logits"] + [
        f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")
    ]
    dims = [
        d.dim_param or d.dim_value
        for d in inputs["past_key_values.1.value"].type.tensor_type.shape.dim
    ]
    assert dims == ["batch", 2, "past_sequence_length", 16]
    ids_dims = [d.dim_param for d in inputs["input_ids"].type.tensor_type.shape.dim]
    assert ids_dims == ["batch", "sequence_length"]

    meta = json.loads((graph.folder / META_FILE).read_text())
    assert meta["model_identity"] == resolve(tiny_model_path).identity
    assert meta["variant"] == "fp32" and meta["attention"] == attention
    assert (meta["num_layers"], meta["num_kv_heads"], meta["head_dim"]) == (2, 2, 16)
    assert meta["context_length"] == 2048 and meta["eos_token_ids"][:1] == [2]
    assert {"torch", "onnx", "onnxruntime"} <= set(meta["tool_versions"])
    assert (graph.folder / meta["tokenizer_dir"] / "tokenizer.json").is_file()
    assert graph.folder == export_folder(resolve(tiny_model_path), "fp32", attention, onnx_root)


def test_one_graph_serves_prefill_and_decode(tiny_model_path: Path, onnx_root: Path) -> None:
    """Plain session.run (no IOBinding), as any consumer of the layout would: empty past for
    the prompt, then its presents as the past of one decode step; logits_to_keep defaults to
    every position."""
    graph = ensure_export(tiny_model_path, "fp32", "concat", root=onnx_root)
    info = read_graph_info(graph.graph_path)
    sess = _session(graph.graph_path)
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], np.int64)
    feeds = _prefill_feeds(info, ids)
    outs = sess.run(None, feeds)
    assert outs[0].shape == (2, 4, 49152)
    assert outs[1].shape == (2, 2, 4, 16)
    kept = sess.run(["logits"], {**feeds, "logits_to_keep": np.array([1], np.int64)})[0]
    np.testing.assert_allclose(kept[:, 0], outs[0][:, -1], rtol=1e-5, atol=1e-5)

    nxt = outs[0][:, -1].argmax(-1).reshape(2, 1)
    step = {
        "input_ids": nxt,
        "attention_mask": np.ones((2, 5), np.int64),
        "position_ids": np.full((2, 1), 4, np.int64),
    }
    for i, name in enumerate(
        info.past_name(layer, kv) for layer in range(2) for kv in ("key", "value")
    ):
        step[name] = outs[1 + i]
    decoded = sess.run(None, step)
    full = sess.run(None, _prefill_feeds(info, np.concatenate([ids, nxt], axis=1)))
    np.testing.assert_allclose(decoded[0][:, -1], full[0][:, -1], rtol=1e-4, atol=1e-4)
    assert decoded[1].shape == (2, 2, 5, 16)


def test_cache_reused_and_rebuilt_on_identity_change(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache logic without torch: a stand-in exporter counts its calls."""
    calls: list[Path] = []

    def fake_export(info, graph_path: Path, attention: str) -> None:  # type: ignore[no-untyped-def]
        calls.append(graph_path)
        graph_path.write_bytes(b"graph")

    monkeypatch.setattr(export_mod, "_export_fp32", fake_export)
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    root = tmp_path / "onnx"

    first = ensure_export(model, "fp32", root=root)
    again = ensure_export(model, "fp32", root=root)
    assert len(calls) == 1 and again.folder == first.folder
    assert again.meta.created_unix == first.meta.created_unix

    # new weights -> new identity -> a new folder and a fresh export
    weights = model / "model.safetensors"
    os.utime(weights, (weights.stat().st_atime, weights.stat().st_mtime + 100))
    changed = ensure_export(model, "fp32", root=root)
    assert len(calls) == 2 and changed.folder != first.folder
    assert changed.meta.model_identity == resolve(model).identity != first.meta.model_identity

    forced = ensure_export(model, "fp32", root=root, force=True)
    assert len(calls) == 3 and forced.folder == changed.folder
    assert not [p for p in forced.folder.parent.iterdir() if p.name.startswith(".")]


def test_failed_export_leaves_nothing(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(info, graph_path: Path, attention: str) -> None:  # type: ignore[no-untyped-def]
        graph_path.write_bytes(b"half a graph")
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(export_mod, "_export_fp32", broken)
    root = tmp_path / "onnx"
    with pytest.raises(RuntimeError, match="exporter crashed"):
        ensure_export(tiny_model_path, "fp32", root=root)
    folder = export_folder(resolve(tiny_model_path), "fp32", "gqa", root)
    assert not folder.exists()
    assert [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_bad_variant_rejected(tiny_model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="variant"):
        ensure_export(tiny_model_path, "int3", root=tmp_path)


@pytest.mark.parametrize(("variant", "op"), [("int8", "MatMulNBits"), ("int4", "MatMulNBits")])
def test_quantized_variants(tiny_model_path: Path, onnx_root: Path, variant: str, op: str) -> None:
    graph = ensure_export(tiny_model_path, variant, root=onnx_root)
    assert graph.meta.variant == variant
    assert graph.meta.quantization == export_mod.QUANTIZATION[variant]
    model = onnx.load(str(graph.graph_path), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    # every MatMul with a weight is quantized, the LM head included (it is untied)
    assert "MatMul" not in ops and ops.count(op) == 2 * 4 + 1
    if variant == "int4":
        assert "GatherBlockQuantized" in ops
    # blocks of 32 inputs (a GGUF block); int8 affine (zero points), int4 symmetric
    want = {"int4": (4, 32), "int8": (8, 32)}[variant]
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            assert attrs["accuracy_level"] == 4  # int8 activations: the fast kernels
            assert (attrs["bits"], attrs["block_size"]) == want
            zero_points = len(node.input) > 3 and bool(node.input[3])
            assert zero_points == (variant == "int8")
    decoder = Decoder(_session(graph.graph_path), read_graph_info(graph.graph_path), 1, 64)
    logits = decoder.prefill(0, [5, 6, 7, 8], 0)
    assert logits.shape == (49152,) and np.isfinite(logits).all()


def test_int8_folder_of_an_older_method_is_rebuilt(tiny_model_path: Path, tmp_path: Path) -> None:
    first = ensure_export(tiny_model_path, "int8", root=tmp_path)
    again = ensure_export(tiny_model_path, "int8", root=tmp_path)
    assert again.meta.created_unix == first.meta.created_unix  # reused
    # a folder of the per-tensor method (or written before the field existed) is rebuilt
    data = json.loads((first.folder / META_FILE).read_text())
    del data["quantization"]
    (first.folder / META_FILE).write_text(json.dumps(data))
    rebuilt = ensure_export(tiny_model_path, "int8", root=tmp_path)
    assert rebuilt.meta.quantization == QUANTIZATION["int8"]
    assert rebuilt.meta.created_unix > first.meta.created_unix


def test_int8_logits_and_prompt_chunking(tiny_model_path: Path, onnx_root: Path) -> None:
    """A prompt prefilled in one chunk or in two gives the same last logits with int8 (each
    token's activations quantized on their own): a greedy answer does not depend on how the
    engine chunked it."""
    graph = ensure_export(tiny_model_path, "int8", root=onnx_root)
    info = read_graph_info(graph.graph_path)
    whole = Decoder(_session(graph.graph_path), info, 1, 256)
    split = Decoder(_session(graph.graph_path), info, 1, 256)
    ids = np.random.default_rng(3).integers(3, 49152, 120).tolist()
    ref = whole.prefill(0, ids, 0).copy()
    split.prefill(0, ids[:37], 0)
    got = split.prefill(0, ids[37:], 37)
    assert float(np.abs(got - ref).max()) == 0.0


def test_cli_export_prints_folder(
    tiny_model_path: Path,
    onnx_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gateway.commands import edge

    cached = ensure_export(tiny_model_path, "fp32", root=onnx_root)
    monkeypatch.setattr(export_mod, "onnx_root", lambda: onnx_root)
    parser = argparse.ArgumentParser(prog="edgecloud")
    edge.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["edge", "export", str(tiny_model_path), "--variant", "fp32"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(cached.folder)
    bad = parser.parse_args(["edge", "export", "no-such-model", "-p", "fp32"])
    assert bad.func(bad) == 1


def test_meta_roundtrip(tmp_path: Path) -> None:
    meta = ExportMeta(
        model_name="m",
        model_identity="m-1",
        variant="int4",
        attention="gqa",
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        hidden_size=64,
        vocab_size=10,
        context_length=128,
        tokenizer_dir=".",
        eos_token_ids=[2],
    )
    meta.write(tmp_path)
    assert ExportMeta.read(tmp_path) == meta
    assert ExportMeta.read(tmp_path / "missing") is None
