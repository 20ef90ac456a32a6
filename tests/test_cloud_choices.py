"""The paged engine core's logprobs, prompt logprobs and ``n`` choices, against the dense
reference (tiny random fp32 model, CPU), with both runners' logic: the reference torch runner
and the CUDA runner's (fused weights, tiling) with torch ops on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cloud_engine.core import EngineCore
from cloud_engine.model.dense import DenseKVCache, generate
from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.model.loader import load_model, save_random_model, tiny_config
from routing.engine import GenerationRequest, SamplingParams, TokenLogprob
from tests.test_cloud_core import make_core

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RUNNERS = ["reference", "cuda-logic"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    path = save_random_model(tmp_path_factory.mktemp("tiny-choices"), tiny_config(), seed=11)
    return load_model(Path(path))


@torch.inference_mode()
def ref_logprobs(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    dev = next(model.parameters()).device
    cache = DenseKVCache(model, 1, len(ids))
    pos = torch.arange(len(ids), device=dev).unsqueeze(0)
    logits = model(torch.tensor([ids], device=dev), pos, cache)[0]
    return torch.log_softmax(logits.float(), dim=-1)


def run(
    core: EngineCore, reqs: list[GenerationRequest]
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprob]], dict[str, list]]:
    """Add every request, step to the end: tokens, logprobs and prompt logprobs by id."""
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    lps: dict[str, list[TokenLogprob]] = {r.request_id: [] for r in reqs}
    prompt: dict[str, list] = {}
    for r in reqs:
        core.add(r)
    seqs = {r.request_id: core.seqs[r.request_id] for r in reqs}
    while core.has_work():
        for o in core.step():
            toks[o.seq.request_id] += o.new_token_ids
            lps[o.seq.request_id] += o.logprobs or []
    for rid, seq in seqs.items():
        if seq.prompt_logprobs is not None:
            prompt[rid] = seq.prompt_logprobs
    return toks, lps, prompt


@pytest.mark.parametrize("runner", RUNNERS)
def test_choices_compute_their_prompt_once(tiny: LlamaForCausalLM, runner: str) -> None:
    """Three choices of one 40-token prompt: the first prefills it, the others wait for its
    two full blocks and compute only the 8 tokens after them; every choice decodes as the
    dense reference does."""
    core = make_core(tiny, runner)
    prompt = [(7 * i + 3) % 500 for i in range(40)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    reqs = [
        GenerationRequest(prompt, params, request_id=f"c{i}", prefill_with=None if i == 0 else "c0")
        for i in range(3)
    ]
    toks, _, _ = run(core, reqs)
    want = generate(tiny, prompt, params).token_ids
    assert all(t == want for t in toks.values()), toks
    assert core.counters.prefill_tokens == 40 + 2 * 8
    assert core.counters.cached_prompt_tokens == 2 * 32

    alone = make_core(tiny, runner)  # without prefill_with they prefill side by side
    run(alone, [GenerationRequest(prompt, params, request_id=f"c{i}") for i in range(3)])
    assert alone.counters.prefill_tokens == 3 * 40


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("runner", RUNNERS)
def test_logprobs_equal_the_reference_log_softmax(
    tiny: LlamaForCausalLM, runner: str, overlap: bool
) -> None:
    """In one batch beside a row that asks nothing: sampled tokens' logprobs (top 3, sorted,
    the greedy token first) and prompt logprobs (after the prompt's blocks were cached by an
    earlier request: they are computed, not skipped) equal the dense reference's
    log-softmax of the raw logits, also for a row sampled at temperature 1.5; with look-ahead
    decode steps too (``overlap``: launched before the previous step's tokens are read)."""
    core = make_core(tiny, runner, max_tokens_per_step=24, overlap=overlap)  # 2 prompt chunks
    prompt = [(5 * i + 1) % 500 for i in range(37)]
    run(core, [GenerationRequest(prompt, SamplingParams(max_tokens=2, temperature=0.0))])
    reqs = [
        GenerationRequest(
            prompt,
            SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, prompt_logprobs=2),
            request_id="greedy",
        ),
        GenerationRequest(
            prompt,
            SamplingParams(max_tokens=5, temperature=1.5, seed=3, logprobs=0),
            request_id="hot",
        ),
        GenerationRequest(prompt[:20], SamplingParams(max_tokens=5), request_id="plain"),
    ]
    toks, lps, prompt_lps = run(core, reqs)
    assert (core.counters.ahead_steps > 0) == overlap
    assert lps["plain"] == [] and set(prompt_lps) == {"greedy"}
    for rid, k in (("greedy", 3), ("hot", 0)):
        ids = prompt + toks[rid]
        ref = ref_logprobs(tiny, ids)
        assert [e.token_id for e in lps[rid]] == toks[rid]
        for j, e in enumerate(lps[rid]):
            row = ref[len(prompt) + j - 1]
            assert e.logprob == pytest.approx(float(row[e.token_id]), abs=1e-4)
            assert len(e.top) == k
            assert [v for _, v in e.top] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)
            if rid == "greedy":
                assert e.top[0] == (e.token_id, e.logprob)
    got = prompt_lps["greedy"]
    assert len(got) == len(prompt) and got[0] is None
    ref = ref_logprobs(tiny, prompt)
    for p in range(1, len(prompt)):
        assert got[p].token_id == prompt[p]
        assert got[p].logprob == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
        assert len(got[p].top) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_engine_logprobs_and_choices(overlap: bool) -> None:
    """The CUDA runner (Triton kernels, CUDA graphs, look-ahead steps) in fp32: logprobs and
    prompt logprobs equal the dense reference's log-softmax; three choices of one prompt
    prefill it once and decode as the reference does; rows asking nothing keep the graphs."""
    import copy

    from cloud_engine.config import EngineConfig
    from tests.test_cloud_gpu import tiny_gpu_model

    model = tiny_gpu_model("qwen3", torch.float32)
    cfg = EngineConfig(
        device="cuda", kv_memory_bytes=64 * 2**20, max_running=16, max_tokens_per_step=512,
        overlap=overlap, debug_checks=True,
    )  # fmt: skip
    core = EngineCore(copy.deepcopy(model), "gpu-lp", cfg)
    prompt = [(11 * i + 5) % 2048 for i in range(70)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    asks = SamplingParams(max_tokens=8, temperature=0.0, logprobs=4, prompt_logprobs=1)
    reqs = [
        GenerationRequest(prompt, greedy, request_id=f"c{i}", prefill_with=None if i == 0 else "c0")
        for i in range(3)
    ] + [GenerationRequest(prompt[:33], asks, request_id="lp")]
    toks, lps, prompt_lps = run(core, reqs)
    want = generate(model, prompt, greedy).token_ids
    assert [toks[f"c{i}"] for i in range(3)] == [want] * 3
    assert core.counters.prefill_tokens == 70 + 2 * 6 + 33
    ids = prompt[:33] + toks["lp"]
    ref = ref_logprobs(model, ids).cpu()
    assert [e.token_id for e in lps["lp"]] == toks["lp"]
    for j, e in enumerate(lps["lp"]):
        row = ref[33 + j - 1]
        assert e.logprob == pytest.approx(float(row[e.token_id]), abs=1e-3)
        assert e.top[0][0] == e.token_id and len(e.top) == 4
    got = prompt_lps["lp"]
    assert len(got) == 33 and got[0] is None
    for p in range(1, 33):
        assert got[p].logprob == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-3)
