"""``CloudEngine``: the async Engine protocol over the paged core (tiny random model, CPU)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.engine import CloudEngine
from cloud_engine.model.dense import generate
from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.model.loader import load_model, save_random_model, tiny_config
from routing.blocks import block_hashes
from routing.engine import (
    Engine,
    FinishReason,
    GenerationRequest,
    QueueFull,
    RequestTooLong,
    SamplingParams,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("tiny-engine"), tiny_config(), seed=11)


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> LlamaForCausalLM:
    return load_model(tiny_folder)


def make_engine(model: LlamaForCausalLM, **kw: object) -> CloudEngine:
    cfg = EngineConfig(
        **{"max_kv_blocks": 200, "max_tokens_per_step": 256, "debug_checks": True, **kw}
    )  # type: ignore[arg-type]
    return CloudEngine(EngineCore(model, "tiny-engine", cfg))


async def collect(engine: CloudEngine, req: GenerationRequest) -> tuple[list[int], list[object]]:
    toks: list[int] = []
    events = []
    async for ev in engine.generate(req):
        toks += ev.token_ids
        events.append(ev)
    return toks, events


async def wait_until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_concurrent_streams_match_dense(tiny: LlamaForCausalLM) -> None:
    engine = make_engine(tiny)
    assert isinstance(engine, Engine) and engine.kind == "cloud"
    await engine.start()
    try:
        rng = random.Random(0)
        reqs = [
            GenerationRequest(
                [rng.randrange(512) for _ in range(rng.randint(5, 120))],
                SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0),
            )
            for _ in range(16)
        ]
        results = await asyncio.gather(*(collect(engine, r) for r in reqs))
        for r, (toks, events) in zip(reqs, results, strict=True):
            assert toks == generate(tiny, r.prompt_token_ids, r.sampling).token_ids
            last = events[-1]
            assert last.finish_reason is FinishReason.LENGTH  # type: ignore[attr-defined]
            assert last.completion_tokens == len(toks)  # type: ignore[attr-defined]
            assert last.prompt_tokens == len(r.prompt_token_ids)  # type: ignore[attr-defined]
        st = engine.stats()
        assert st.running == 0 and st.waiting == 0 and st.kv_blocks_used == 0
        assert (
            st.kv_blocks_total == 200 and st.prefill_tokens_per_s > 0 and st.decode_ms_per_token > 0
        )
    finally:
        await engine.shutdown()


async def test_cancellation_frees_blocks(tiny: LlamaForCausalLM) -> None:
    engine = make_engine(tiny)
    await engine.start()
    try:
        req = GenerationRequest(list(range(100)), SamplingParams(max_tokens=500, temperature=0.0))
        gen = engine.generate(req)
        await gen.__anext__()
        await gen.__anext__()
        assert engine.stats().kv_blocks_used > 0
        await gen.aclose()
        await wait_until(lambda: engine.stats().kv_blocks_used == 0 and engine.stats().running == 0)
        engine.core.blocks.check_integrity()
        # abort() ends a live stream with an ABORT event
        req2 = GenerationRequest(list(range(50)), SamplingParams(max_tokens=500, temperature=0.0))
        events = []
        async for ev in engine.generate(req2):
            events.append(ev)
            if len(events) == 2:
                await engine.abort(req2.request_id)
        assert events[-1].finish_reason is FinishReason.ABORT
        await wait_until(lambda: engine.stats().kv_blocks_used == 0)
    finally:
        await engine.shutdown()


async def test_stop_token_and_prefix_hit_reported(tiny: LlamaForCausalLM) -> None:
    engine = make_engine(tiny)
    await engine.start()
    try:
        prompt = list(range(64))
        ref = generate(tiny, prompt, SamplingParams(max_tokens=10, temperature=0.0)).token_ids
        stop = ref[3]
        first = ref.index(stop)
        toks, events = await collect(
            engine,
            GenerationRequest(
                prompt, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop,))
            ),
        )
        assert toks == ref[:first] and events[-1].finish_reason is FinishReason.STOP  # type: ignore[attr-defined]
        # the same prompt again: three of its four blocks come from the cache
        toks, events = await collect(
            engine, GenerationRequest(prompt, SamplingParams(max_tokens=3, temperature=0.0))
        )
        assert events[0].cached_tokens == 48  # type: ignore[attr-defined]
        assert engine.stats().prefix_hit_rate == pytest.approx(48 / 128)
        ev = engine.drain_block_events()
        assert set(block_hashes(prompt, engine.core.seed)) <= set(ev.stored)
    finally:
        await engine.shutdown()


async def test_check_errors_raise_before_streaming(tiny: LlamaForCausalLM) -> None:
    engine = make_engine(tiny, max_waiting=1, max_running=1)
    with pytest.raises(RequestTooLong):
        await anext(engine.generate(GenerationRequest([1] * 1020, SamplingParams(max_tokens=10))))
    with pytest.raises(RequestTooLong):  # more than the whole pool (200 blocks = 3200 slots)?
        engine.check(GenerationRequest([1] * 10, SamplingParams(max_tokens=5000)))
    # not started: the first submission takes the one running place, the second the one queue
    # place, a third is refused
    g1 = engine.generate(GenerationRequest([1] * 10, SamplingParams(max_tokens=4)))
    t1 = asyncio.ensure_future(anext(g1))
    g2 = engine.generate(GenerationRequest([1] * 10, SamplingParams(max_tokens=4)))
    t2 = asyncio.ensure_future(anext(g2))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull) as info:
        engine.check(GenerationRequest([1] * 10, SamplingParams(max_tokens=4)))
    assert info.value.retry_after_s >= 1.0
    await engine.start()
    try:
        ev = await asyncio.wait_for(t1, 10)
        assert ev.token_ids
        await g1.aclose()
        assert (await asyncio.wait_for(t2, 10)).token_ids
        await g2.aclose()
    finally:
        await engine.shutdown()


async def test_from_model_folder(tiny_folder: Path) -> None:
    engine = CloudEngine.from_model(tiny_folder, "cpu", kv_memory_bytes=4 * 2**20)
    assert engine.max_context == 1024 and engine.model_id
    assert engine.stats().kv_blocks_total == 4 * 2**20 // engine.core.pool.spec.bytes_per_block
    await engine.start()
    try:
        toks, _ = await collect(
            engine, GenerationRequest([3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))
        )
        assert len(toks) == 4
    finally:
        await engine.shutdown()
    assert torch.get_num_threads() >= 1
