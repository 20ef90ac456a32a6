"""Edge runtime: parity with the torch reference, slots, sampling, admission, abort, providers.

Parity uses the tiny random model (exported in seconds); the default model's parity and the
int8/int4 quality checks are marked slow (they reuse the cached exports under the edgecloud
home, so after the first run they take about a minute).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cloud_engine.model.dense import generate as torch_generate
from cloud_engine.model.loader import load_model
from edge_runtime.engine import EdgeEngine, EdgeEngineConfig, InvalidRequest, greedy
from edge_runtime.export import ensure_export
from edge_runtime.graph_info import META_FILE
from edge_runtime.huge_pages import collapse_supported
from edge_runtime.providers import CPU, create_session
from routing.engine import (
    Engine,
    FinishReason,
    GenerationRequest,
    QueueFull,
    RequestTooLong,
    SamplingParams,
    TokenEvent,
)
from tests.conftest import torch_threads

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def onnx_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.getbasetemp() / "edge-onnx"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="module")
def tiny_gqa(tiny_model_path: Path, onnx_root: Path) -> Path:
    return ensure_export(tiny_model_path, "fp32", "gqa", root=onnx_root).folder


@pytest.fixture(scope="module")
def tiny_torch(tiny_model_path: Path):  # type: ignore[no-untyped-def]
    return load_model(tiny_model_path)


def _config(**kw: object) -> EdgeEngineConfig:
    base: dict[str, object] = dict(slots=4, context=512, threads=1, max_waiting=256)
    base.update(kw)
    return EdgeEngineConfig(**base)  # type: ignore[arg-type]


async def _collect(engine: Engine, request: GenerationRequest) -> tuple[list[int], TokenEvent]:
    tokens: list[int] = []
    last: TokenEvent | None = None
    async for event in engine.generate(request):
        tokens += event.token_ids
        last = event
    assert last is not None and last.finished
    return tokens, last


def _prompts(lengths: Sequence[int], vocab: int = 49152, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


async def _parity(
    folder: Path, torch_model, lengths: Sequence[int], new: int, **cfg: object
) -> None:  # type: ignore[no-untyped-def]
    """All prompts submitted at once (more than the slots): mixed lengths decode together."""
    engine = EdgeEngine(folder, _config(**cfg))
    await engine.start()
    assert isinstance(engine, Engine) and engine.kind == "edge"
    prompts = _prompts(lengths)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, engine.stats().running)
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(
            *(_collect(engine, GenerationRequest(p, greedy(new))) for p in prompts)
        )
    finally:
        watcher.cancel()
        await engine.shutdown()
    mismatches = []
    for prompt, (tokens, last) in zip(prompts, results, strict=True):
        with torch_threads(1):  # eager torch at this size is dispatch-bound: 1 thread is fastest
            ref = torch_generate(torch_model, prompt, greedy(new)).token_ids
        assert last.finish_reason is FinishReason.LENGTH and last.prompt_tokens == len(prompt)
        if tokens != ref:
            mismatches.append((len(prompt), ref, tokens))
    assert mismatches == []
    assert peak == min(engine.config.slots, len(prompts))  # the slots really ran together


async def test_parity_tiny_gqa_lengths_1_to_200(tiny_gqa: Path, tiny_torch) -> None:  # type: ignore[no-untyped-def]
    """Every prompt length 1..200, 4 slots, a prefill chunk of 64 (so long prompts are
    prefilled in several chunks between the other slots' decode steps)."""
    await _parity(tiny_gqa, tiny_torch, range(1, 201), new=6, prefill_chunk=64)


async def test_parity_tiny_concat_graph_without_json(
    tiny_model_path: Path, onnx_root: Path, tmp_path: Path, tiny_torch
) -> None:  # type: ignore[no-untyped-def]
    """The portable (concat) flavour, with the JSON removed: a graph "exported elsewhere"."""
    src = ensure_export(tiny_model_path, "fp32", "concat", root=onnx_root).folder
    foreign = tmp_path / "foreign-graph"
    shutil.copytree(src, foreign)
    (foreign / META_FILE).unlink()
    engine = EdgeEngine(foreign, _config())
    assert engine.meta is None and engine.info.attention == "concat"
    assert engine.model_id == "foreign-graph" and engine.max_context == 512
    await _parity(foreign, tiny_torch, [1, 2, 17, 64, 150, 200], new=8)


def test_concat_graph_batches_decode_rows(tiny_model_path: Path, onnx_root: Path) -> None:
    """Slots of different lengths decoded in one run of the concat graph give the logits each
    gives alone, step after step (the gather, the padding mask and the scatter back)."""
    folder = ensure_export(tiny_model_path, "fp32", "concat", root=onnx_root).folder
    batched = EdgeEngine(folder, _config(slots=3, warmup=False))._load().decoder
    alone = EdgeEngine(folder, _config(slots=3, warmup=False))._load().decoder
    prompts = _prompts([5, 40, 17])
    tokens = np.array([p[-1] for p in prompts], np.int64)
    lengths = np.array([len(p) - 1 for p in prompts], np.int64)
    for slot, p in enumerate(prompts):
        batched.prefill(slot, p[:-1], 0)
        alone.prefill(slot, p[:-1], 0)
    everyone = np.ones(3, bool)
    for _step in range(4):
        got = batched.decode(tokens, lengths, everyone).copy()
        for row in range(3):
            only = np.zeros(3, bool)
            only[row] = True
            ref = alone.decode(tokens, lengths, only)[row]
            np.testing.assert_allclose(got[row], ref, rtol=1e-4, atol=1e-4)
            assert int(np.argmax(got[row])) == int(np.argmax(ref))
        tokens = got.argmax(axis=1).astype(np.int64)
        lengths = lengths + 1


@pytest.mark.parametrize("attention", ["gqa", "concat"])
def test_prefill_all_gives_every_position_and_the_same_cache(
    tiny_model_path: Path, onnx_root: Path, tiny_torch, attention: str
) -> None:  # type: ignore[no-untyped-def]
    """``prefill_all`` (``logits_to_keep`` fed 0): one logits row per token, equal to the
    torch reference's at every position, its last row what ``prefill`` returns, and it leaves
    the slot's cache as ``prefill`` does (the next chunk and a decode step agree), in two
    chunks from a nonzero start too."""
    import torch

    from cloud_engine.model.dense import DenseKVCache

    folder = ensure_export(tiny_model_path, "fp32", attention, root=onnx_root).folder
    dec = EdgeEngine(folder, _config(slots=2, warmup=False))._load().decoder
    (prompt,) = _prompts([40])
    first = dec.prefill_all(0, prompt[:24], 0)
    rest = dec.prefill_all(0, prompt[24:], 24)
    assert first.shape == (24, dec.vocab) and rest.shape == (16, dec.vocab)
    dec.prefill(1, prompt[:24], 0)
    np.testing.assert_allclose(dec.prefill(1, prompt[24:], 24), rest[-1], rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        cache = DenseKVCache(tiny_torch, 1, 40)
        ref = tiny_torch(torch.tensor([prompt]), torch.arange(40).unsqueeze(0), cache)[0]
    got = np.concatenate([first, rest])
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-3, atol=1e-3)
    tokens = np.array([7, 7], np.int64)
    lengths = np.array([40, 40], np.int64)
    both = dec.decode(tokens, lengths, np.ones(2, bool))
    np.testing.assert_allclose(both[0], both[1], rtol=1e-4, atol=1e-4)


def test_decode_public_wrapper_path_matches(tiny_gqa: Path) -> None:
    """Decode through onnxruntime's public wrappers (a session that does not expose its pybind
    object) gives the logits of the pybind fast path, for one row and for several."""
    from edge_runtime.decoder import Decoder

    class PublicOnly:
        def __init__(self, session: ort.InferenceSession) -> None:
            self.inner = session

        def __getattr__(self, name: str) -> object:
            if name == "_sess":
                raise AttributeError(name)
            return getattr(self.inner, name)

    fast = EdgeEngine(tiny_gqa, _config(slots=2, warmup=False))._load().decoder
    public = Decoder(PublicOnly(fast.session), fast.info, 2, fast.context)  # type: ignore[arg-type]
    assert fast._c_session is not None and public._c_session is None
    prompts = _prompts([9, 23])
    for d in (fast, public):
        for slot, p in enumerate(prompts):
            d.prefill(slot, p[:-1], 0)
    tokens = np.array([p[-1] for p in prompts], np.int64)
    lengths = np.array([len(p) - 1 for p in prompts], np.int64)
    for rows in (1, 2, 2, 1):
        active = np.ones(rows, bool)
        got = fast.decode(tokens[:rows], lengths[:rows], active).copy()
        ref = public.decode(tokens[:rows], lengths[:rows], active)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        tokens[:rows] = got.argmax(axis=1)
        lengths[:rows] += 1


async def test_kv_cache_updated_in_place(tiny_gqa: Path) -> None:
    engine = EdgeEngine(tiny_gqa, _config(slots=2, warmup=False))
    await engine.start()
    decoder = engine._require_started().decoder
    buffers = [(id(b), b.__array_interface__["data"][0]) for b in decoder._kv]
    prompt = _prompts([20])[0]
    _tokens, _ = await _collect(engine, GenerationRequest(prompt, greedy(10)))
    # same buffers, same memory; slot 0 holds prompt + 9 fed tokens, the rest is untouched
    assert [(id(b), b.__array_interface__["data"][0]) for b in decoder._kv] == buffers
    k0 = decoder._kv[0]
    filled = np.abs(k0[0]).sum(axis=(0, 2))  # per position
    assert (filled[: 20 + 9] > 0).all() and (filled[20 + 9 :] == 0).all()
    assert np.abs(k0[1]).sum() == 0  # slot 1 never used
    await engine.shutdown()


async def test_huge_pages_only_when_asked(tiny_gqa: Path) -> None:
    engine = EdgeEngine(tiny_gqa, _config(slots=2, huge_pages=False))
    await engine.start()
    assert engine.huge_pages.advised_bytes == 0 and engine.huge_pages.note == "off"
    await engine.shutdown()
    engine = EdgeEngine(tiny_gqa, _config(slots=2))
    await engine.start()
    report = engine.huge_pages
    if collapse_supported():  # whatever new memory the load made was collapsed, in 2 MB pages
        assert report.note == "" and report.collapsed_bytes == report.advised_bytes
        assert report.collapsed_bytes % (2 << 20) == 0
    tokens, _ = await _collect(engine, GenerationRequest(_prompts([20])[0], greedy(5)))
    assert len(tokens) == 5
    await engine.shutdown()


async def test_sampling_seed_stop_and_max_tokens(tiny_gqa: Path) -> None:
    engine = EdgeEngine(tiny_gqa, _config())
    await engine.start()
    prompt = _prompts([12])[0]
    base, _ = await _collect(engine, GenerationRequest(prompt, greedy(12)))
    assert len(base) == 12

    # a stop token ends the stream before it, with STOP; ignore_eos runs on
    stop = base[4]
    first = base.index(stop)
    got, last = await _collect(engine, GenerationRequest(prompt, greedy(12, [stop])))
    assert got == base[:first] and last.finish_reason is FinishReason.STOP
    assert last.completion_tokens == first
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,), ignore_eos=True)
    got, last = await _collect(engine, GenerationRequest(prompt, params))
    assert got == base and last.finish_reason is FinishReason.LENGTH

    # seeded sampling is reproducible, and differs between seeds
    def sampled(seed: int) -> GenerationRequest:
        p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=seed)
        return GenerationRequest(prompt, p)

    a, _ = await _collect(engine, sampled(1))
    b, _ = await _collect(engine, sampled(1))
    c, _ = await _collect(engine, sampled(2))
    assert a == b and a != c and len(a) == 16
    # top_k=1 and a tiny top_p are greedy whatever the temperature
    k1 = SamplingParams(max_tokens=12, temperature=2.0, top_k=1, seed=3)
    p0 = SamplingParams(max_tokens=12, temperature=0.7, top_p=1e-6, seed=3)
    assert (await _collect(engine, GenerationRequest(prompt, k1)))[0] == base
    assert (await _collect(engine, GenerationRequest(prompt, p0)))[0] == base
    await engine.shutdown()


async def test_tokens_stream_one_per_event_in_order(tiny_gqa: Path) -> None:
    """One event per token as it is sampled; a stop token ends the stream unemitted."""
    prompt = _prompts([12])[0]
    engine = EdgeEngine(tiny_gqa, _config())
    await engine.start()
    events = [e async for e in engine.generate(GenerationRequest(prompt, greedy(12)))]
    base = [t for e in events for t in e.token_ids]
    stop = GenerationRequest(prompt, greedy(12, [base[6]]))
    stopped = [e async for e in engine.generate(stop)]
    await engine.shutdown()
    assert [len(e.token_ids) for e in events] == [1] * 12
    assert [e.completion_tokens for e in events] == list(range(1, 13))
    assert events[-1].finish_reason is FinishReason.LENGTH
    first = base.index(base[6])
    assert [t for e in stopped for t in e.token_ids] == base[:first]
    assert stopped[-1].finish_reason is FinishReason.STOP
    assert stopped[-1].completion_tokens == first


async def test_check_too_long_invalid_and_queue_full(tiny_gqa: Path) -> None:
    with pytest.raises(ValueError, match="exceeds the model"):
        EdgeEngine(tiny_gqa, _config(context=4096))  # the tiny model's context is 2048
    engine = EdgeEngine(tiny_gqa, _config(slots=1, max_waiting=1, context=64))
    await engine.start()
    with pytest.raises(RequestTooLong):
        engine.check(GenerationRequest([5] * 60, greedy(5)))
    engine.check(GenerationRequest([5] * 59, greedy(5)))  # exactly fits
    with pytest.raises(InvalidRequest):
        engine.check(GenerationRequest([], greedy(5)))
    with pytest.raises(InvalidRequest):
        engine.check(GenerationRequest([49152], greedy(5)))
    with pytest.raises(RequestTooLong):  # generate raises before yielding anything
        await anext(engine.generate(GenerationRequest([5] * 64, greedy(1))))

    await engine.shutdown()

    engine = EdgeEngine(tiny_gqa, _config(slots=1, max_waiting=1, context=2048))
    await engine.start()
    running = engine.generate(GenerationRequest([5, 6, 7], greedy(1900)))
    queued = engine.generate(GenerationRequest([5, 6, 7], greedy(1900)))
    await anext(running)  # holds the only slot
    first_queued = asyncio.create_task(anext(queued))  # waits in the queue (size 1)
    while engine.stats().waiting == 0:
        await asyncio.sleep(0.002)
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (1, 1)
    with pytest.raises(QueueFull) as exc:
        engine.check(GenerationRequest([5], greedy(5)))
    assert 0 < exc.value.retry_after_s <= 60
    with pytest.raises(QueueFull):
        await anext(engine.generate(GenerationRequest([5], greedy(5))))
    await running.aclose()  # frees the slot: the queued request gets it
    assert (await first_queued).token_ids
    await queued.aclose()
    assert engine.stats().running == 0 and engine.stats().waiting == 0
    await engine.shutdown()


async def test_abort_frees_slot_at_once(tiny_gqa: Path) -> None:
    engine = EdgeEngine(tiny_gqa, _config(slots=2, context=2048))
    await engine.start()
    streams = [engine.generate(GenerationRequest(p, greedy(1900))) for p in _prompts([30, 40])]
    for s in streams:
        await anext(s)
    assert engine.stats().running == 2
    await streams[0].aclose()  # the client went away
    assert engine.stats().running == 1  # no await in between: freed synchronously
    # abort by id: the consumer sees a final ABORT event
    request = GenerationRequest(_prompts([8])[0], greedy(1900))
    third = engine.generate(request)
    await anext(third)
    assert engine.stats().running == 2
    await engine.abort(request.request_id)
    assert engine.stats().running == 1
    events = [e async for e in third]
    assert events and events[-1].finish_reason is FinishReason.ABORT
    await streams[1].aclose()
    assert engine.stats().running == 0
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_total == 2 * 2048 // 16
    await engine.shutdown()


async def test_stats_measured(tiny_gqa: Path) -> None:
    engine = EdgeEngine(tiny_gqa, _config(slots=2, context=2048))
    await engine.start()
    stream = engine.generate(GenerationRequest(_prompts([40])[0], greedy(1900)))
    await anext(stream)
    stats = engine.stats()
    assert stats.traits.device == "CPU" and stats.traits.max_batch == 2
    fields = stats.node_fields()  # NodeState's names: the traits and the load side by side
    assert (fields["device"], fields["max_batch"], fields["running"]) == ("CPU", 2, 1)
    assert "traits" not in fields
    assert stats.running == 1 and stats.kv_blocks_used >= 3  # at least 41 positions: 3 blocks
    assert stats.prefill_tokens_per_s > 0 and stats.decode_ms_per_token > 0
    await stream.aclose()
    await engine.shutdown()


async def test_provider_fallback_ends_on_cpu(tiny_gqa: Path) -> None:
    """Absent providers are skipped; one that raises at session creation is passed over."""
    graph = tiny_gqa / "model.onnx"
    absent = ("QNNExecutionProvider", "OpenVINOExecutionProvider", "coreml", "dml")
    _, choice = create_session(graph, absent)
    assert choice.active == CPU and choice.short_name == "CPU"
    assert set(choice.skipped) == {
        "QNNExecutionProvider",
        "OpenVINOExecutionProvider",
        "CoreMLExecutionProvider",
        "DmlExecutionProvider",
    }

    tried: list[str] = []

    def flaky_npu(path: str, sess_options=None, providers=None):  # type: ignore[no-untyped-def]
        tried.append(providers[0][0])
        if providers[0][0] == "FakeNpuExecutionProvider":
            raise RuntimeError("NPU driver not loaded")
        return ort.InferenceSession(path, sess_options=sess_options, providers=providers)

    _, choice = create_session(
        graph,
        ["FakeNpuExecutionProvider", "QNNExecutionProvider"],
        session_factory=flaky_npu,
        available=["FakeNpuExecutionProvider", CPU],
    )
    assert tried == ["FakeNpuExecutionProvider", CPU]
    assert choice.active == CPU
    assert "NPU driver not loaded" in choice.skipped["FakeNpuExecutionProvider"]
    assert "not offered" in choice.skipped["QNNExecutionProvider"]

    # through the engine: stats report the provider that is active
    engine = EdgeEngine(
        tiny_gqa,
        _config(providers=("OpenVINOExecutionProvider", "AzureExecutionProvider")),
        session_factory=lambda path, sess_options=None, providers=None: (
            _raise("Azure EP refused")
            if providers[0][0] == "AzureExecutionProvider"
            else ort.InferenceSession(path, sess_options=sess_options, providers=providers)
        ),
    )
    await engine.start()
    assert engine.stats().traits.device == "CPU"
    assert engine.provider is not None and engine.provider.active == CPU
    assert "Azure EP refused" in engine.provider.skipped.get("AzureExecutionProvider", "") or (
        "AzureExecutionProvider" not in ort.get_available_providers()
    )
    tokens, _ = await _collect(engine, GenerationRequest([5, 6, 7], greedy(4)))
    assert len(tokens) == 4
    await engine.shutdown()


def _raise(message: str):  # type: ignore[no-untyped-def]
    raise RuntimeError(message)


# --- the default model (slow: exports it once into the edgecloud home) -------------------------

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for happy.",
    "What planet is known as the red planet?",
    "How many days are in a leap year?",
    "What is photosynthesis?",
    "Name a famous painting by Leonardo da Vinci.",
    "What is the largest ocean on Earth?",
    "Explain what a noun is.",
    "What language is spoken in Brazil?",
    "What is the square root of 81?",
    "Suggest a name for a pet cat.",
    "What does CPU stand for?",
    "Who was the first person to walk on the moon?",
    "List two benefits of exercise.",
]


@pytest.mark.slow
async def test_parity_default_model(default_model_path: Path) -> None:
    folder = ensure_export(default_model_path, "fp32").folder
    model = load_model(default_model_path)
    await _parity(folder, model, [1, 2, 5, 16, 33, 64, 100, 150, 199, 200], new=12, threads=2)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["int8", "int4"])
async def test_quantized_default_model_answers_paris(
    default_model_path: Path, variant: str
) -> None:
    """Still "Paris"; greedy agreement with fp32 over 20 chat prompts, reported as numbers:
    teacher-forced next-token agreement (the quantized model predicts the fp32 model's next
    token, along the fp32 greedy continuation) and identical full answers."""
    from routing.prompt import PromptFormatter

    fp32 = EdgeEngine(ensure_export(default_model_path, "fp32").folder, _config(threads=2))
    quant = EdgeEngine(ensure_export(default_model_path, variant).folder, _config(threads=2))
    fmt = PromptFormatter.from_folder(fp32.tokenizer_dir)
    stops = fmt.stop_token_ids
    await fp32.start()
    await quant.start()
    paris_ids = fmt.encode_chat([{"role": "user", "content": CHAT_PROMPTS[0]}])
    answer, _ = await _collect(quant, GenerationRequest(paris_ids, greedy(16, stops)))
    assert "Paris" in fmt.decode(answer)

    hits = total = identical = 0
    decoder = quant._require_started().decoder
    for text in CHAT_PROMPTS:
        ids = fmt.encode_chat([{"role": "user", "content": text}])
        ref, _ = await _collect(fp32, GenerationRequest(ids, greedy(32, stops)))
        got, _ = await _collect(quant, GenerationRequest(ids, greedy(32, stops)))
        identical += got == ref
        # teacher forcing on slot 0 of the quantized engine's decoder (the engine is idle)
        logits = decoder.prefill(0, ids, 0)
        preds = [int(logits.argmax())]
        for i, tok in enumerate(ref[:-1] if ref else []):
            row = decoder.decode(np.array([tok]), np.array([len(ids) + i]), np.array([True]))
            preds.append(int(row[0].argmax()))
        hits += sum(p == r for p, r in zip(preds, ref, strict=False))
        total += max(len(ref), 1)
    agreement = hits / total
    print(
        f"\n{variant}: next-token agreement with fp32 {agreement:.3f}; identical answers {identical}/20"
    )
    assert agreement > 0.6
    await fp32.shutdown()
    await quant.shutdown()


def test_sampler_nucleus_and_top_k() -> None:
    from edge_runtime.sampler import Sampler

    vocab = 49152
    peaked = np.zeros(vocab, np.float32)
    peaked[7] = np.log(0.6 * (vocab - 1) / 0.4)  # token 7 holds 60% of the mass
    nucleus = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    assert {nucleus(peaked) for _ in range(50)} == {7}
    # a flat distribution: the nucleus is half the vocabulary (the widening path)
    flat = np.zeros(vocab, np.float32)
    wide = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    draws = [wide(flat) for _ in range(200)]
    assert len(set(draws)) > 150
    top3 = np.full(vocab, -10.0, np.float32)
    top3[[3, 30, 300]] = 5.0
    k3 = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=1))
    assert {k3(top3) for _ in range(100)} == {3, 30, 300}
    assert Sampler(SamplingParams(temperature=0.0))(top3) == 3


async def _beside_a_decoding_answer(folder: Path, ratio: float | None) -> tuple[int, list[int]]:
    """A decodes; B (400 prompt tokens) arrives. Returns how many of A's tokens came out while
    B prefilled (after B was submitted, before B's first token), and B's tokens."""
    engine = EdgeEngine(
        folder,
        _config(slots=2, prefill_chunk=256, prefill_stall_ratio=ratio),
    )
    await engine.start()
    a_prompt, b_prompt = _prompts([12, 400])
    seen: list[tuple[str, int]] = []  # (who, completion tokens) in arrival order
    try:
        # as long an answer as the context holds: on a fast machine the tiny model decodes 200
        # tokens in under 50 ms, all before B would arrive
        a = engine.generate(GenerationRequest(a_prompt, greedy(480)))
        while (await anext(a)).completion_tokens < 3:  # A has prefilled and decoded
            pass

        async def drain_a() -> None:
            async for event in a:
                seen.append(("a", event.completion_tokens))

        async def run_b() -> list[int]:
            # A's tokens made by now but still queued for its consumer do not count
            scheduler = engine._require_started()
            with scheduler.lock:
                made = max(r.generated for r in scheduler.slots if r is not None)
            seen.append(("b-submitted", made))
            tokens: list[int] = []
            async for event in engine.generate(GenerationRequest(b_prompt, greedy(4))):
                if not tokens:
                    seen.append(("b-first", 0))
                tokens += event.token_ids
            return tokens

        a_task = asyncio.create_task(drain_a())
        # B goes in once the drain runs; A's tokens made before B was submitted, still queued
        # for the drain, are not counted as made while B prefilled (``made`` above)
        while not seen:
            await asyncio.sleep(0)
        await asyncio.sleep(0.005)
        b_tokens = await run_b()
        a_task.cancel()
        stats = engine.stats()
        assert stats.traits.prefill_chunk == 256
        assert stats.traits.prefill_chunk_decoding == (
            16 if ratio is not None and ratio < 1 else 256
        )
    finally:
        await engine.shutdown()
    whos = [who for who, _ in seen]
    start, first = whos.index("b-submitted"), whos.index("b-first")
    made = seen[start][1]
    return sum(1 for who, n in seen[start:first] if who == "a" and n > made), b_tokens


async def test_a_prompt_beside_decoding_answers_is_prefilled_in_small_chunks(
    tiny_gqa: Path,
) -> None:
    """Stall ratio 0: B's 400 tokens go in 16-token chunks, one of A's decode steps after each
    (about 24 of A's tokens before B's first); off: two 256-token chunks (A waits for each).
    B's greedy tokens are the same either way. (B's prompt is long enough, and A's answer,
    that on a fast machine, where the tiny model decodes a token in a fraction of a
    millisecond, the engine's order still shows through the consumers' wake-ups.)"""
    small_steps, small_tokens = await _beside_a_decoding_answer(tiny_gqa, 0.0)
    full_steps, full_tokens = await _beside_a_decoding_answer(tiny_gqa, None)
    assert small_steps >= 8, (small_steps, full_steps)
    # one full chunk stalls A for all of B's prompt; on a loaded machine A's stream drains
    # late and its queued tokens count in both runs alike, so the two are also compared
    assert full_steps <= 2 or small_steps >= full_steps + 6, (small_steps, full_steps)
    assert small_tokens == full_tokens and len(small_tokens) == 4
