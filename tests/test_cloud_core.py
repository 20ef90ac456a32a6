"""The paged engine core against the dense reference (tiny random fp32 model, CPU).

Parity, prefix sharing, preemption, cancellation and admission errors, all with assertions on
exact token ids and on the engine's own counters.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path

import pytest
import torch

from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.cuda_runner import CudaRunner
from cloud_engine.kv_pool import KVPool, KVSpec
from cloud_engine.kv_quant import storage_of
from cloud_engine.model.dense import generate
from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.model.loader import load_model, save_random_model, tiny_config
from cloud_engine.model.torch_ops import TorchOps
from routing.blocks import block_hashes, model_seed
from routing.engine import GenerationRequest, QueueFull, RequestTooLong, SamplingParams
from tests.parallel_jobs import drive

VOCAB = 512


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    torch.manual_seed(0)
    path = save_random_model(tmp_path_factory.mktemp("tiny-cloud"), tiny_config(), seed=7)
    return load_model(Path(path))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def reference(model: LlamaForCausalLM, reqs: list[GenerationRequest]) -> dict[str, list[int]]:
    return {r.request_id: generate(model, r.prompt_token_ids, r.sampling).token_ids for r in reqs}


def random_requests(
    n: int, seed: int, max_prompt: int = 300, max_out: int = 40
) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [
        GenerationRequest(
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))],
            greedy(rng.randint(1, max_out)),
            request_id=f"r{i}",
        )
        for i in range(n)
    ]


def make_core(model: LlamaForCausalLM, runner: str = "reference", **kw: object) -> EngineCore:
    cfg = EngineConfig(
        **{"max_tokens_per_step": 256, "max_running": 16, "debug_checks": True, **kw}
    )  # type: ignore[arg-type]
    if runner == "reference":
        return EngineCore(model, "tiny", cfg)
    # The CUDA runner's logic (fused weights, device block tables, tiling) with torch ops on CPU.
    c = model.config
    blocks = int(kw.get("max_kv_blocks", 400))  # type: ignore[call-overload]
    kv = str(kw.get("kv_dtype", "auto"))
    spec = KVSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, torch.float32)
    pool = KVPool(spec if kv == "auto" else spec.with_storage(storage_of(kv)), blocks, "cpu")
    run = CudaRunner(copy.deepcopy(model), pool, max_batch=16, max_context=1024, ops=TorchOps())
    return EngineCore(model, "tiny", cfg, runner=run)


@pytest.mark.parametrize(
    ("runner", "overlap"), [("reference", False), ("fused", False), ("fused", True)]
)
def test_paged_matches_dense_with_random_arrivals(
    tiny: LlamaForCausalLM, runner: str, overlap: bool
) -> None:
    reqs = random_requests(32, seed=1)
    ref = reference(tiny, reqs)
    rng = random.Random(2)
    arrivals = [rng.randint(0, 60) for _ in reqs]
    core = make_core(tiny, runner, max_kv_blocks=400, overlap=overlap)
    out = drive(core, reqs, arrivals)
    assert out == ref
    assert core.counters.preemptions == 0
    assert (core.counters.ahead_steps > 0) == overlap
    assert core.blocks.num_used == 0
    core.blocks.check_integrity()
    # mixed steps happened: some step carried both decodes and prefill chunks
    assert core.counters.decode_tokens == sum(len(v) for v in ref.values())


def test_overlap_drops_stopped_and_aborted_sequences(tiny: LlamaForCausalLM) -> None:
    """Look-ahead steps carry sequences that then stop on a stop token or get aborted: their
    extra token is dropped, their blocks freed, and the others' tokens stay exact."""
    base = random_requests(6, seed=8, max_prompt=60, max_out=1)
    plain = [
        GenerationRequest(r.prompt_token_ids, greedy(30), request_id=r.request_id) for r in base
    ]
    ref = reference(tiny, plain)
    # stop each of the first three on its 4th, 9th and 14th reference token
    reqs = [
        GenerationRequest(
            r.prompt_token_ids,
            SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(ref[r.request_id][k],)),
            request_id=r.request_id,
        )
        if i < 3
        else r
        for i, (r, k) in enumerate(zip(plain, [3, 8, 13, 0, 0, 0], strict=True))
    ]
    ref = reference(tiny, reqs)
    aborted = reqs[5].request_id
    core = make_core(tiny, "fused", max_kv_blocks=200, overlap=True)
    seen: list[int] = []

    def abort_mid_stream(c: EngineCore) -> None:
        seen.append(c.counters.ahead_steps)
        if len(seen) == 12:
            assert c.has_ahead  # a look-ahead step is in flight while we abort
            assert c.abort(aborted) is not None

    out = drive(core, reqs, after_step=abort_mid_stream)
    assert core.counters.ahead_steps > 10
    for r in reqs[:5]:
        assert out[r.request_id] == ref[r.request_id], r.request_id
    assert out[aborted] == ref[aborted][: len(out[aborted])] and len(out[aborted]) < 30
    assert core.blocks.num_used == 0 and not core.has_work()
    core.blocks.check_integrity()


class _FakeTime:
    """``cloud_engine.core``'s ``time``: a clock that moves only when a step's tokens are read,
    by what the step is said to cost; anything else is the real ``time`` module's."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


class _Timed:
    """A launched step whose ``read`` takes ``cost`` seconds of the fake clock."""

    def __init__(self, launched: object, cost: float, clock: _FakeTime) -> None:
        self._launched, self._cost, self._clock = launched, cost, clock

    def read(self) -> list[int]:
        out = self._launched.read()  # type: ignore[attr-defined]
        self._clock.now += self._cost
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self._launched, name)


PREFILL_S_PER_TOKEN = 0.0005  # the controlled step costs: 2000 prompt tokens/s,
DECODE_STEP_S = 0.0045  # and 4.5 ms per decode step


@pytest.mark.parametrize(("runner", "overlap"), [("reference", False), ("fused", True)])
def test_measured_rates_match_the_wall_clock(
    tiny: LlamaForCausalLM, runner: str, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rates the node advertises (and the router predicts with) are what steps take.

    Steps are given known durations on an injected clock (read-to-read, as on a GPU: a
    look-ahead step launched before the previous read must not be charged twice or not at
    all), so the check is exact and does not depend on how busy the machine is."""
    import cloud_engine.core as core_module

    clock = _FakeTime()
    monkeypatch.setattr(core_module, "time", clock)
    core = make_core(tiny, runner, max_kv_blocks=200, overlap=overlap)
    launch = core.runner.launch
    costs: list[float] = []

    def timed_launch(batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        prompt = sum(max(0, min(it.num_new, it.seq.num_prompt - it.start)) for it in batch.items)
        cost = prompt * PREFILL_S_PER_TOKEN if prompt else DECODE_STEP_S
        costs.append(cost)
        return _Timed(launch(batch, *args, **kwargs), cost, clock)

    monkeypatch.setattr(core.runner, "launch", timed_launch)
    core.add(GenerationRequest(list(range(1, 200)), greedy(60), request_id="r"))
    while core.has_work():
        core.step()
    c = core.counters
    assert len(costs) >= 60 and c.decode_tokens == 60
    assert c.prefill_tok_s.value == pytest.approx(1 / PREFILL_S_PER_TOKEN, rel=1e-6)
    assert c.decode_ms.value == pytest.approx(DECODE_STEP_S * 1e3, rel=1e-6)


def test_each_prompt_is_charged_its_share_of_the_steps_that_ran_it(
    tiny: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's own compute (what the node reports as ``prefill_ms``): alone, the steps that
    ran its chunks; beside decode rows, what the step took beyond their decode (the
    decode-only steps' time), split by prompt tokens between the prompts of the step."""
    import cloud_engine.core as core_module

    clock = _FakeTime()
    monkeypatch.setattr(core_module, "time", clock)
    core = make_core(tiny, "reference", max_kv_blocks=200, overlap=False, prefill_stall_ratio="off")
    launch = core.runner.launch

    def timed_launch(batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        prompt = sum(max(0, min(it.num_new, it.seq.num_prompt - it.start)) for it in batch.items)
        decoding = any(it.num_new == 1 and it.seq.num_output > 0 for it in batch.items)
        cost = prompt * PREFILL_S_PER_TOKEN + (DECODE_STEP_S if decoding else 0.0)
        return _Timed(launch(batch, *args, **kwargs), cost, clock)

    monkeypatch.setattr(core.runner, "launch", timed_launch)
    a = core.add(GenerationRequest(list(range(1, 101)), greedy(40), request_id="a"))
    for _ in range(5):  # a's prompt (one step), then 4 decode-only steps
        core.step()
    b = core.add(GenerationRequest(list(range(3, 63)), greedy(4), request_id="b"))
    c = core.add(GenerationRequest(list(range(5, 25)), greedy(4), request_id="c"))
    core.step()  # b's and c's prompts beside a's decode row
    assert a.prefill_ms == pytest.approx(100 * PREFILL_S_PER_TOKEN * 1e3)
    assert b.prefill_ms == pytest.approx(60 * PREFILL_S_PER_TOKEN * 1e3)
    assert c.prefill_ms == pytest.approx(20 * PREFILL_S_PER_TOKEN * 1e3)


@pytest.mark.parametrize("ratio", [4.05, "off"])
def test_prompts_beside_decode_rows_take_the_stall_ratios_tokens(
    tiny: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, ratio: float | str
) -> None:
    """While a row decodes, a step's prompt tokens are cut to ``ratio`` decode steps' worth at
    the measured rates (4.05 x 4.5 ms / 0.5 ms: 36 tokens, in whole 16-token blocks: 32), oldest
    prompt first; the decode row is in every step, and the tokens are those of the dense
    reference. Off: the step budget."""
    import cloud_engine.core as core_module

    clock = _FakeTime()
    monkeypatch.setattr(core_module, "time", clock)
    core = make_core(tiny, "reference", max_kv_blocks=200, overlap=False, prefill_stall_ratio=ratio)
    launch = core.runner.launch
    steps: list[dict[str, int]] = []

    def timed_launch(batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        steps.append({it.seq.request_id: it.num_new for it in batch.items})
        prompt = sum(max(0, min(it.num_new, it.seq.num_prompt - it.start)) for it in batch.items)
        decoding = any(it.num_new == 1 and it.seq.num_output > 0 for it in batch.items)
        cost = prompt * PREFILL_S_PER_TOKEN + (DECODE_STEP_S if decoding else 0.0)
        return _Timed(launch(batch, *args, **kwargs), cost, clock)

    monkeypatch.setattr(core.runner, "launch", timed_launch)
    reqs = [
        GenerationRequest(list(range(1, 101)), greedy(30), request_id="a"),
        GenerationRequest(list(range(3, 63)), greedy(4), request_id="b"),
        GenerationRequest(list(range(5, 25)), greedy(4), request_id="c"),
    ]
    core.add(reqs[0])
    for _ in range(5):  # a's prompt, then 4 decode-only steps (the rates are measured)
        core.step()
    assert core.chunk_beside_decode() == (None if ratio == "off" else 32)
    core.add(reqs[1])
    core.add(reqs[2])
    out: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            out.setdefault(o.seq.request_id, []).extend(o.new_token_ids)
    if ratio == "off":
        assert steps[5] == {"a": 1, "b": 60, "c": 20}
    else:
        assert steps[5:8] == [
            {"a": 1, "b": 32},
            {"a": 1, "b": 28, "c": 4},
            {"a": 1, "b": 1, "c": 16},
        ]
        assert core.chunk_beside_decode() == 32
    ref = reference(tiny, reqs)
    assert out["b"] == ref["b"] and out["c"] == ref["c"]
    core.blocks.check_integrity()


def test_the_step_cost_fitted_on_the_steps_is_what_they_cost(
    tiny: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step cost the node publishes (``NodeState.step_cost``) is fitted on its own steps:
    given steps that cost a pass, each decode row and each prompt token (nothing per token of
    context), on an injected clock, the fit gives those three back exactly and no context
    cost; a prompt's chunk beside decode rows costs its tokens, not a second pass."""
    import cloud_engine.core as core_module

    clock = _FakeTime()
    monkeypatch.setattr(core_module, "time", clock)
    core = make_core(tiny, "reference", max_kv_blocks=400, overlap=False)
    launch = core.runner.launch
    pass_s, row_s, token_s = 0.020, 0.003, 0.0005

    def timed_launch(batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        prompt = sum(max(0, min(it.num_new, it.seq.num_prompt - it.start)) for it in batch.items)
        rows = sum(
            1
            for it in batch.items
            if it.num_new == 1 and it.samples and it.start >= it.seq.num_prompt
        )
        cost = pass_s + row_s * rows + token_s * prompt
        return _Timed(launch(batch, *args, **kwargs), cost, clock)

    monkeypatch.setattr(core.runner, "launch", timed_launch)
    assert core.step_fit.latest is None  # nothing fitted before any step
    for wave in range(4):  # prompts arriving beside rows that decode
        for r in random_requests(4, seed=wave, max_prompt=200, max_out=30):
            core.add(GenerationRequest(r.prompt_token_ids, r.sampling, f"{wave}-{r.request_id}"))
        for _ in range(12):
            core.step()
    while core.has_work():
        core.step()
    cost = core.step_fit.solve()
    assert cost is not None and cost.steps == len(core.step_fit.steps) >= 48
    assert cost.pass_ms == pytest.approx(pass_s * 1e3, rel=1e-6)
    assert cost.ms_per_row == pytest.approx(row_s * 1e3, rel=1e-6)
    assert cost.ms_per_prompt_token == pytest.approx(token_s * 1e3, rel=1e-6)
    assert cost.ms_per_context_token == pytest.approx(0.0, abs=1e-9)
    assert core.step_fit.latest is not None  # refitted as the steps came


def test_measured_rates_are_real_numbers_on_the_real_clock(tiny: LlamaForCausalLM) -> None:
    """Without the injected clock the counters are measured (positive, finite); no bound on
    their values: that would test the machine's load, not the code."""
    core = make_core(tiny, "fused", max_kv_blocks=200, overlap=True)
    core.add(GenerationRequest(list(range(1, 50)), greedy(8), request_id="r"))
    while core.has_work():
        core.step()
    c = core.counters
    assert 0 < c.prefill_tok_s.value < float("inf") and 0 < c.decode_ms.value < float("inf")


def test_prefix_sharing_computes_only_new_tokens(tiny: LlamaForCausalLM) -> None:
    rng = random.Random(3)
    system = [rng.randrange(VOCAB) for _ in range(200)]
    reqs = [
        GenerationRequest(
            system + [rng.randrange(VOCAB) for _ in range(rng.randint(5, 40))],
            greedy(12),
            request_id=f"p{i}",
        )
        for i in range(6)
    ]
    ref = reference(tiny, reqs)
    core = make_core(tiny, max_kv_blocks=200)
    out = drive(core, reqs[:1])
    first = core.counters.prefill_tokens
    assert first == len(reqs[0].prompt_token_ids)
    out.update(drive(core, reqs[1:]))
    shared = (200 // 16) * 16  # 12 full blocks of the system prompt
    expected_new = sum(len(r.prompt_token_ids) - shared for r in reqs[1:])
    assert core.counters.prefill_tokens - first == expected_new
    assert core.counters.cached_prompt_tokens == shared * 5
    assert out == ref
    assert core.prefix_hit_rate == pytest.approx(
        shared * 5 / sum(len(r.prompt_token_ids) for r in reqs)
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_recomputes_and_keeps_output(tiny: LlamaForCausalLM, overlap: bool) -> None:
    reqs = random_requests(12, seed=4, max_prompt=120, max_out=60)
    ref = reference(tiny, reqs)
    runner = "fused" if overlap else "reference"
    core = make_core(tiny, runner, max_kv_blocks=24, max_tokens_per_step=128, overlap=overlap)
    checks = []

    def integrity(c: EngineCore) -> None:
        c.blocks.check_integrity()
        checks.append(c.blocks.num_used)

    out = drive(core, reqs, after_step=integrity)
    assert core.counters.preemptions > 0
    assert out == ref
    assert max(checks) <= 24 and core.blocks.num_used == 0


def test_cancellation_frees_blocks(tiny: LlamaForCausalLM) -> None:
    core = make_core(tiny, max_kv_blocks=100)
    reqs = random_requests(4, seed=5, max_prompt=100, max_out=1)
    for r in reqs:
        core.add(GenerationRequest(r.prompt_token_ids, greedy(500), request_id=r.request_id))
    for _ in range(3):
        core.step()
    assert core.blocks.num_used > 0
    for r in reqs[:3]:
        assert core.abort(r.request_id) is not None
    assert core.abort("nope") is None
    # only the last request's blocks remain in use
    seq = core.seqs[reqs[3].request_id]
    assert core.blocks.num_used == len(seq.block_table)
    core.abort(reqs[3].request_id)
    assert core.blocks.num_used == 0 and not core.has_work()
    core.blocks.check_integrity()


def test_check_rejects_what_can_never_fit(tiny: LlamaForCausalLM) -> None:
    core = make_core(tiny, max_kv_blocks=10, max_waiting=2)
    with pytest.raises(RequestTooLong):  # context (1024)
        core.check(GenerationRequest([1] * 1000, greedy(100)))
    with pytest.raises(RequestTooLong):  # the whole pool (160 slots)
        core.check(GenerationRequest([1] * 150, greedy(20)))
    ok = GenerationRequest([1] * 10, greedy(5))
    core.check(ok)
    core.add(ok)
    core.add(GenerationRequest([1] * 10, greedy(5)))
    with pytest.raises(QueueFull) as info:
        core.check(GenerationRequest([1] * 10, greedy(5)))
    assert info.value.retry_after_s > 0


def test_block_events_use_routing_hashes(tiny: LlamaForCausalLM) -> None:
    core = make_core(tiny, max_kv_blocks=12)
    prompt = list(range(40))
    drive(core, [GenerationRequest(prompt, greedy(3), request_id="a")])
    ev = core.drain_block_events()
    # both full prompt blocks are announced under the gateway's hashes
    assert set(block_hashes(prompt, model_seed("tiny"))) <= set(ev.stored)
    assert ev.removed == []
    # a request that needs the whole pool evicts them, and says so
    drive(core, [GenerationRequest([7] * 150, greedy(30), request_id="b")])
    ev = core.drain_block_events()
    assert set(block_hashes(prompt, model_seed("tiny"))) <= set(ev.removed)


def test_priority_is_served_first(tiny: LlamaForCausalLM) -> None:
    core = make_core(tiny, max_kv_blocks=100, max_running=1)
    order: list[str] = []
    reqs = [
        GenerationRequest([1, 2, 3], greedy(2), request_id="low", priority=5),
        GenerationRequest([1, 2, 3], greedy(2), request_id="high", priority=0),
        GenerationRequest([1, 2, 3], greedy(2), request_id="mid", priority=1),
    ]
    for r in reqs:
        core.add(r)
    while core.has_work():
        for o in core.step():
            if o.finish_reason is not None:
                order.append(o.seq.request_id)
    assert order == ["high", "mid", "low"]


def test_int8_kv_stays_close_on_tiny_model(tiny: LlamaForCausalLM) -> None:
    reqs = random_requests(8, seed=6, max_prompt=200, max_out=20)
    ref = reference(tiny, reqs)
    out = drive(make_core(tiny, kv_dtype="int8", max_kv_blocks=400), reqs)
    agree = sum(a == b for r in ref for a, b in zip(ref[r], out[r], strict=False))
    assert agree / sum(len(v) for v in ref.values()) > 0.8


def test_request_needing_the_whole_pool_runs(tiny: LlamaForCausalLM) -> None:
    core = make_core(tiny, max_kv_blocks=8, max_tokens_per_step=256)
    req = GenerationRequest(
        list(range(100)), greedy(28), request_id="whole"
    )  # 128 slots = 8 blocks
    core.check(req)
    assert drive(core, [req]) == reference(tiny, [req])
