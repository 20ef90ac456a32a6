"""The OpenVINO execution provider: greedy parity with the CPU provider, device reporting.

The parity tests need ``onnxruntime-openvino`` (``scripts/setup_openvino.sh`` makes
``.venv-openvino``; ``scripts/test.sh`` runs this file there) and are skipped elsewhere. They
run the graph form the edge picks on OpenVINO (``concat``) on the tiny random model with
``device_type=CPU`` and compare every greedy token with the CPU provider's, for prompts
prefilled whole and in chunks and for answers decoded in one batch. The tests of the device
and graph-form logic run everywhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_runtime import openvino
from edge_runtime.engine import EdgeEngine, EdgeEngineConfig, greedy
from edge_runtime.export import ensure_export
from edge_runtime.providers import CPU, ProviderChoice, ProviderSpec, create_session, parse_provider
from routing.engine import FinishReason, GenerationRequest
from routing.latency.priors import on_cpu

pytestmark = pytest.mark.timeout(300)

OV_CPU = "openvino:device_type=CPU"
needs_openvino = pytest.mark.skipif(
    openvino.OPENVINO not in ort.get_available_providers(),
    reason="OpenVINOExecutionProvider not offered by this onnxruntime "
    "(run in .venv-openvino: scripts/setup_openvino.sh)",
)


@pytest.fixture(scope="module")
def ov_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openvino-onnx")


@pytest.fixture(scope="module")
def tiny_concat(tiny_model_path: Path, ov_root: Path) -> Path:
    return ensure_export(tiny_model_path, "fp32", "concat", root=ov_root).folder


def _prompts(lengths: Sequence[int], vocab: int = 49152, seed: int = 11) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


async def _greedy_tokens(
    folder: Path, providers: tuple[str, ...], prompts: list[list[int]], new: int, **cfg: object
) -> tuple[list[list[int]], EdgeEngine]:
    """Every prompt submitted at once to one engine; each one's greedy tokens."""
    base: dict[str, object] = dict(slots=4, context=512, threads=1, max_waiting=64)
    base.update(cfg)
    engine = EdgeEngine(folder, EdgeEngineConfig(providers=providers, **base))  # type: ignore[arg-type]
    await engine.start()

    async def one(prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for event in engine.generate(GenerationRequest(prompt, greedy(new))):
            tokens += event.token_ids
            if event.finished:
                assert event.finish_reason is FinishReason.LENGTH
        return tokens

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts))), engine
    finally:
        await engine.shutdown()


# --- parity (needs onnxruntime-openvino) -------------------------------------------------------


@needs_openvino
@pytest.mark.parametrize(
    ("chunk", "lengths"),
    [(256, [1, 7, 33, 120, 200]), (16, [17, 50, 130, 3])],
    ids=["whole-prompts", "chunked-prompts"],
)
async def test_greedy_parity_with_cpu(tiny_concat: Path, chunk: int, lengths: list[int]) -> None:
    """The same greedy tokens as the CPU provider, token for token: prompts prefilled whole
    (chunk 256) or in 16-token chunks, 4 slots decoding together in one batch."""
    prompts = _prompts(lengths)
    ref, cpu = await _greedy_tokens(tiny_concat, (CPU,), prompts, 12, prefill_chunk=chunk)
    got, ov = await _greedy_tokens(tiny_concat, (OV_CPU,), prompts, 12, prefill_chunk=chunk)
    assert cpu.device == "CPU" and ov.device == "OpenVINO:CPU"
    assert [len(t) for t in got] == [12] * len(prompts)
    assert got == ref


@needs_openvino
async def test_batched_decode_matches_one_at_a_time(tiny_concat: Path) -> None:
    """On OpenVINO, answers decoded in one batch equal each answer decoded alone."""
    prompts = _prompts([5, 40, 90, 2], seed=3)
    batched, _ = await _greedy_tokens(tiny_concat, (OV_CPU,), prompts, 10)
    alone = [
        (await _greedy_tokens(tiny_concat, (OV_CPU,), [p], 10, slots=1))[0][0] for p in prompts
    ]
    assert batched == alone


@needs_openvino
@pytest.mark.parametrize("variant", ["int8", "int4"])
async def test_quantized_answers_alike_chunked_and_batched(
    tiny_model_path: Path, ov_root: Path, tiny_concat: Path, variant: str
) -> None:
    """The quantized variants on OpenVINO: greedy answers do not change with prompt chunking
    or batching. (Not token-equal to the CPU provider's: measured int8 3/5 prompts alike,
    int4 5/5; OpenVINO's int8 kernels round otherwise than MatMulNBits' on CPU.)"""
    folder = ensure_export(tiny_model_path, variant, "concat", root=ov_root).folder
    prompts = _prompts([3, 40, 130], seed=5)
    whole, _ = await _greedy_tokens(folder, (OV_CPU,), prompts, 10)
    chunked, _ = await _greedy_tokens(folder, (OV_CPU,), prompts, 10, prefill_chunk=16)
    alone = [(await _greedy_tokens(folder, (OV_CPU,), [p], 10, slots=1))[0][0] for p in prompts]
    assert chunked == whole and alone == whole


@needs_openvino
def test_from_model_picks_concat_on_openvino(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With OpenVINO first in the chain the edge exports and serves the concat graph; with
    the CPU provider the gqa graph."""
    monkeypatch.setenv("EDGECLOUD_HOME", str(tmp_path))
    ov = EdgeEngine.from_model(
        tiny_model_path, "fp32", config=EdgeEngineConfig(providers=(OV_CPU,))
    )
    assert ov.info.attention == "concat" and ov.folder.name == "fp32-concat"
    cpu = EdgeEngine.from_model(tiny_model_path, "fp32", config=EdgeEngineConfig(providers=(CPU,)))
    assert cpu.info.attention == "gqa"


@needs_openvino
def test_graph_runs_whole_on_openvino(tiny_concat: Path) -> None:
    """The concat graph needs no CPU fallback (creating the session with fallback disabled
    succeeds), and the session really is on OpenVINO."""
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.log_severity_level = 3
    session = ort.InferenceSession(
        str(tiny_concat / "model.onnx"), so, providers=[(openvino.OPENVINO, {"device_type": "CPU"})]
    )
    assert session.get_providers()[0] == openvino.OPENVINO


@needs_openvino
def test_missing_npu_is_not_reported_as_npu(tiny_concat: Path) -> None:
    """Asked for an NPU this machine lacks, the node reports what it really got."""
    if "NPU" in (openvino.available_devices() or []):
        pytest.skip("this machine has an NPU")
    _, choice = create_session(tiny_concat / "model.onnx", ["openvino:device_type=NPU"])
    assert "NPU" not in choice.label
    assert choice.label in ("CPU", "OpenVINO:CPU")


@needs_openvino
async def test_stats_report_device_and_prefix_cache(tiny_concat: Path) -> None:
    """NodeState's device is the provider and device really used; a stateless OpenVINO graph
    keeps its KV in our slots, so prefix reuse stays on."""
    _, engine = await _greedy_tokens(tiny_concat, (OV_CPU,), _prompts([20]), 2)
    traits = engine.stats().traits
    assert traits.device == "OpenVINO:CPU" and on_cpu(traits.device)
    assert traits.prefix_cache and traits.prefix_in_slots


# --- device and graph-form logic (runs everywhere) --------------------------------------------


def test_real_device_falls_back_to_cpu_when_unseen() -> None:
    assert openvino.real_device({"device_type": "NPU"}, ["CPU"]) == "CPU"
    assert openvino.real_device({"device_type": "NPU"}, ["CPU", "NPU"]) == "NPU"
    assert openvino.real_device({"device_type": "GPU.1"}, ["CPU", "GPU.0", "GPU.1"]) == "GPU.1"
    assert openvino.real_device({"device_type": "AUTO:GPU,CPU"}, ["CPU"]) == "CPU"
    assert openvino.real_device({"device_type": "AUTO:GPU,CPU"}, ["CPU", "GPU"]) == "GPU"
    assert openvino.real_device({}, ["CPU"]) == "CPU"
    assert openvino.real_device({"device_type": "NPU"}, None) == "NPU"  # devices unknown


def test_stateful_compile_turns_prefix_reuse_off(tiny_concat: Path) -> None:
    """A stateful (causal LM) compile keeps the KV inside the model: no prefix credit."""
    assert openvino.stateful({"enable_causallm": "True"})
    assert not openvino.stateful({"device_type": "NPU"})
    engine = EdgeEngine(tiny_concat, EdgeEngineConfig(slots=1, context=64))
    assert engine.prefix_reuse
    engine.provider = ProviderChoice(openvino.OPENVINO, (), "OpenVINO:NPU", stateful=True)
    traits = engine.stats().traits
    assert traits.device == "OpenVINO:NPU" and not on_cpu(traits.device)
    assert not (traits.prefix_cache or traits.prefix_catch_up or traits.prefix_in_slots)


def test_graph_form_follows_the_provider() -> None:
    """concat where OpenVINO sees the asked-for device, gqa otherwise."""
    ov_cpu = parse_provider(OV_CPU)
    expected = "concat" if openvino.available_devices() else "gqa"
    assert openvino.attention_for(ov_cpu) == expected
    assert openvino.attention_for(ProviderSpec(CPU)) == "gqa"
    assert openvino.attention_for(parse_provider("openvino:device_type=NO_SUCH")) == "gqa"


def test_cli_providers_keep_several_options() -> None:
    """``--providers openvino:device_type=NPU,enable_causallm=True,cpu``: two providers, the
    first with both options."""
    from gateway.commands.node_args import _providers

    got = _providers("openvino:device_type=NPU,enable_causallm=True, cpu")
    assert got == ("openvino:device_type=NPU,enable_causallm=True", "cpu")
    spec = parse_provider(got[0])
    assert spec.options == {"device_type": "NPU", "enable_causallm": "True"}
    assert openvino.stateful(spec.options)
    assert _providers("qnn,cpu") == ("qnn", "cpu")
