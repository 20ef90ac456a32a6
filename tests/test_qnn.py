"""QNN as a plugin EP: a QDQ decoder block on the HTP backend (x86 emulation, CPU fallback off)
against the CPU provider, a precompiled context written and reloaded, and the provider chain.

The QNN tests need ``onnxruntime-qnn`` (run them in ``.venv-qnn``, see docs/npu.md); elsewhere
they skip with the reason, and the chain's skip path is tested instead.

CI (scripts/test.sh) runs ``-m "not slow"`` in ``.venv-qnn``: the plugin registers and runs the
QDQ block on HTP within tolerance (uint8 and uint16), and a precompiled context round-trips. The
chain's tests on the plugin are marked ``slow`` (``-m ""`` runs the whole file); the two that need
no plugin are not, being part of the main suite.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_runtime import qnn
from edge_runtime.providers import CPU, create_session

SEQ, HIDDEN, FFN = 8, 64, 128  # static shapes: HTP compiles for fixed ones


def _plugin_reason() -> str:
    try:
        qnn.find_plugin()
    except qnn.PluginUnavailable as exc:
        return str(exc)
    return ""


PLUGIN_REASON = _plugin_reason()
needs_qnn = pytest.mark.skipif(bool(PLUGIN_REASON), reason=f"no QNN plugin: {PLUGIN_REASON}")


def decoder_block(path: Path, seed: int = 0) -> Path:
    """An attention-free decoder block, ``y = x + W_down(silu(W_gate h) * W_up h)`` with
    ``h = rms_norm(x) * g``, random weights, fp32, opset 21 (16-bit QDQ needs >= 21)."""
    rng = np.random.default_rng(seed)

    def init(name: str, value: np.ndarray) -> onnx.TensorProto:
        return numpy_helper.from_array(value.astype(np.float32), name)

    inits = [
        init("w_gate", rng.standard_normal((HIDDEN, FFN)) / np.sqrt(HIDDEN)),
        init("w_up", rng.standard_normal((HIDDEN, FFN)) / np.sqrt(HIDDEN)),
        init("w_down", rng.standard_normal((FFN, HIDDEN)) / np.sqrt(FFN)),
        init("norm_w", 1 + 0.1 * rng.standard_normal(HIDDEN)),
        init("eps", np.array(1e-5)),
        numpy_helper.from_array(np.array([-1], np.int64), "axes"),
    ]
    node = helper.make_node
    nodes = [
        node("Mul", ["x", "x"], ["sq"]),
        node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        node("Add", ["ms", "eps"], ["ms_eps"]),
        node("Sqrt", ["ms_eps"], ["rms"]),
        node("Div", ["x", "rms"], ["xn"]),
        node("Mul", ["xn", "norm_w"], ["h"]),
        node("MatMul", ["h", "w_gate"], ["gate"]),
        node("MatMul", ["h", "w_up"], ["up"]),
        node("Sigmoid", ["gate"], ["gate_sig"]),
        node("Mul", ["gate", "gate_sig"], ["silu"]),
        node("Mul", ["silu", "up"], ["act"]),
        node("MatMul", ["act", "w_down"], ["down"]),
        node("Add", ["x", "down"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "decoder_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def sample(seed: int) -> dict[str, np.ndarray]:
    """One input of the block: hidden states of unit scale, as a decoder's residual stream."""
    x = np.random.default_rng(seed).standard_normal((1, SEQ, HIDDEN)).astype(np.float32)
    return {"x": x}


def quantize_qdq(src: Path, dst: Path, activations: str) -> Path:
    """QDQ with ``activations`` ("uint8"/"uint16") activations and int8 symmetric weights,
    calibrated by min-max on 16 samples (ONNX Runtime's static quantizer with its QNN config).

    The QNN config quantizes only MatMul weights to int8 and the elementwise constants as
    activations: a plain ``quantize_static`` (int8 on ``Mul``/``Add`` constants too) does not
    finalize on HTP (``QNN_COMMON_ERROR_MEM_ALLOC``).
    """
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    class Calibration(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([sample(100 + i) for i in range(16)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    act = {"uint8": QuantType.QUInt8, "uint16": QuantType.QUInt16}[activations]
    config = get_qnn_qdq_config(
        str(src), Calibration(), activation_type=act, weight_type=QuantType.QInt8,
        weight_symmetric=True,
    )  # fmt: skip
    quantize(str(src), str(dst), config)
    return dst


def output_step(qdq: Path) -> float:
    """The quantization step of the graph output ``y`` (its QuantizeLinear scale)."""
    model = onnx.load(qdq)
    return float(next(numpy_helper.to_array(i) for i in model.graph.initializer
                      if i.name == "y_scale"))  # fmt: skip


def cpu_run(graph: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(graph), providers=[CPU])
    return session.run(None, feed)[0]


@pytest.fixture(scope="module")
def fp32_block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return decoder_block(tmp_path_factory.mktemp("qnn") / "block.onnx")


@pytest.fixture(scope="module", params=["uint8", "uint16"])
def qdq_block(request: pytest.FixtureRequest, fp32_block: Path) -> Iterator[tuple[str, Path]]:
    if PLUGIN_REASON:  # quantizing is the slow part: not where the tests using it skip
        pytest.skip(f"no QNN plugin: {PLUGIN_REASON}")
    dst = fp32_block.with_name(f"block.qdq.{request.param}.onnx")
    yield request.param, quantize_qdq(fp32_block, dst, request.param)


@needs_qnn  # CI subset: a session with QNN first proves the plugin registered
def test_qdq_block_on_htp_matches_cpu(qdq_block: tuple[str, Path], fp32_block: Path) -> None:
    """The QDQ block on HTP, every node on QNN (CPU fallback off), against the CPU provider's
    run of the same QDQ graph.

    Tolerance: 3 output quantization steps (both sides round each of ~10 requantized tensors, and
    may round to neighbouring values), but never tighter than 1% of the output's largest
    magnitude: HTP's 16-bit kernels (Sigmoid, Div, Sqrt) are fixed-point approximations, not ORT's
    dequantize-float-requantize reference. Measured: uint8 0.068 = 2 steps (tolerance 0.102),
    uint16 0.026 = 0.67% of 3.88, about 200 of its tiny steps (tolerance 0.039).
    """
    activations, graph = qdq_block
    feed = sample(7)  # not one of the calibration samples
    session = ort.InferenceSession(str(graph), sess_options=qnn.htp_session_options())
    assert session.get_providers()[0] == qnn.EP_NAME
    on_htp = session.run(None, feed)[0]
    on_cpu = cpu_run(graph, feed)
    reference = cpu_run(fp32_block, feed)

    tolerance = max(3 * output_step(graph), 0.01 * float(np.abs(reference).max()))
    diff = float(np.abs(on_htp - on_cpu).max())
    assert diff <= tolerance, f"{activations}: HTP vs CPU max |diff| {diff:.4g} > {tolerance:.4g}"
    # not vacuous: the block moves its input by far more than the tolerance
    assert float(np.abs(reference - feed["x"]).max()) > 10 * tolerance
    # and HTP is as close to fp32 as the CPU's QDQ run is, within the tolerance
    assert float(np.abs(on_htp - reference).max()) <= (
        float(np.abs(on_cpu - reference).max()) + tolerance
    )


@needs_qnn  # CI subset
def test_precompiled_context_round_trip(qdq_block: tuple[str, Path], tmp_path: Path) -> None:
    """Compiling with ``ep.context_enable`` writes ``*_ctx.onnx`` (one EPContext node) and the
    context binary beside it; a session on that file gives the compiled session's outputs."""
    _, graph = qdq_block
    ctx = tmp_path / "block_ctx.onnx"
    feed = sample(11)
    compiled = ort.InferenceSession(str(graph), sess_options=qnn.htp_session_options(ctx))
    expected = compiled.run(None, feed)[0]

    model = onnx.load(ctx)
    assert [n.op_type for n in model.graph.node] == ["EPContext"]
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    assert attrs["embed_mode"] == 0 and attrs["source"] == qnn.EP_NAME.encode()
    binary = tmp_path / attrs["ep_cache_context"].decode()
    assert binary.suffix == ".bin" and binary.stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ctx.name, binary.name])

    reloaded = ort.InferenceSession(str(ctx), sess_options=qnn.htp_session_options())
    assert reloaded.get_providers()[0] == qnn.EP_NAME
    np.testing.assert_array_equal(reloaded.run(None, feed)[0], expected)


@pytest.mark.slow
@needs_qnn
def test_chain_picks_the_qnn_plugin(qdq_block: tuple[str, Path]) -> None:
    """The default chain registers the plugin and puts QNN first (its bare ``libQnnHtp.so``
    resolved to the package's); its output is the HTP session's within 3 output steps: with CPU
    fallback allowed, QNN leaves the graph input's Quantize and output's Dequantize to the CPU
    EP (its ``offload_graph_io_quantization`` default), which may round an input to the next
    step (measured: uint8 2 steps, uint16 5e-7)."""
    _, graph = qdq_block
    session, choice = create_session(graph)
    assert choice.active == qnn.EP_NAME and choice.short_name == "QNN"
    assert qnn.is_registered() and session.get_providers()[0] == qnn.EP_NAME
    assert (qnn.nodes_on(session) or 0) > 0 and qnn.nodes_on(session, CPU) == 2  # I/O Q, DQ
    feed = sample(3)
    htp = ort.InferenceSession(str(graph), sess_options=qnn.htp_session_options())
    step = output_step(graph)
    np.testing.assert_allclose(session.run(None, feed)[0], htp.run(None, feed)[0], atol=3 * step)


@pytest.mark.slow
@needs_qnn
def test_chain_passes_over_qnn_when_it_takes_no_node(fp32_block: Path, tmp_path: Path) -> None:
    """A graph of dynamic shapes loads with QNN registered but every node on CPU: the chain
    records QNN as failed, with why, instead of reporting QNN while CPU does the work."""
    model = onnx.load(fp32_block)
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[1].dim_param = "seq"
    dynamic = tmp_path / "dynamic.onnx"
    onnx.save(model, dynamic)
    session, choice = create_session(dynamic, ["qnn", "cpu"])
    assert choice.active == CPU
    assert "took no node" in choice.skipped[qnn.EP_NAME]
    np.testing.assert_array_equal(session.run(None, sample(5))[0], cpu_run(dynamic, sample(5)))


@pytest.mark.skipif(not PLUGIN_REASON, reason="onnxruntime-qnn is installed: QNN is offered")
def test_chain_records_why_qnn_is_skipped(fp32_block: Path) -> None:
    """Without the plugin the chain skips QNN, says why, and runs on CPU."""
    session, choice = create_session(fp32_block, ["qnn", "cpu"])
    assert choice.active == CPU
    reason = choice.skipped[qnn.EP_NAME]
    assert "not offered" in reason and PLUGIN_REASON in reason
    out = session.run(None, sample(5))[0]
    np.testing.assert_allclose(out, cpu_run(fp32_block, sample(5)), rtol=0, atol=0)


def test_plugin_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing package and a pre-2.0 package (QNN built into its own onnxruntime) each give
    a reason, never an exception."""

    def missing() -> types.ModuleType:
        raise ImportError("No module named 'onnxruntime_qnn'")

    monkeypatch.setattr(qnn, "_import_plugin_module", missing)
    assert qnn.try_register().startswith("onnxruntime-qnn is not installed")
    monkeypatch.setattr(qnn, "_import_plugin_module", lambda: types.ModuleType("onnxruntime_qnn"))
    assert "get_library_path" in qnn.try_register()
