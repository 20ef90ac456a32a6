"""Tensor and pipeline parallelism give exactly the single-process tokens (CPU, gloo, spawned
ranks, one torch thread each).

Tiny random Llama (GQA, 2 KV heads) and Qwen3 (q/k norms, tied head, one KV head: replicated
over the 2 TP ranks; vocabulary 501, padded to divide). 16 mixed requests arriving over
time: prefix hits, a small pool that forces preemptions, rows through the logits path.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from parallel_jobs import Job, drive, jobs_rank, mixed_requests, with_grammar

from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.model.loader import load_model, save_random_model, tiny_config
from cloud_engine.parallel.dist import ParallelConfig
from cloud_engine.parallel.local import run_world

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Schedules compared step for step: no cut of prompt tokens by measured (wall-clock) rates.
# 64 rows: the pools, not the row cap, bound the batches (CPU's default cap is 4 a thread)
SMALL = EngineConfig(
    max_kv_blocks=14,
    max_tokens_per_step=128,
    max_running=64,
    debug_checks=True,
    prefill_stall_ratio="off",
)
LARGE = replace(SMALL, max_kv_blocks=200)
# the fused model on the shards (the CUDA path's code with the torch ops on CPU)
FUSED = replace(SMALL, fused_shards=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel-models")
    return {
        "llama": save_random_model(root / "llama", tiny_config(), seed=3),
        "qwen3": save_random_model(
            root / "qwen3",
            tiny_config(
                model_type="qwen3",
                qk_norm=True,
                num_key_value_heads=1,
                tie_word_embeddings=True,
                vocab_size=501,
            ),
            seed=4,
        ),
    }


def reference(folder: Path, cfg: EngineConfig, reqs, arrivals):  # type: ignore[no-untyped-def]
    core = EngineCore(load_model(folder), "parity", cfg)
    return drive(core, reqs, arrivals), core.counters


def check(results, refs) -> None:  # type: ignore[no-untyped-def]
    for (name, (ref, counters)), got in zip(refs, results, strict=True):
        assert got["tokens"] == ref, name
        assert got["preemptions"] == counters.preemptions, name
        assert got["cached"] == counters.cached_prompt_tokens, name


def test_stage_layers_split_evenly_or_as_told() -> None:
    assert ParallelConfig(pp=3).stage_layers(8) == [range(0, 3), range(3, 6), range(6, 8)]
    assert ParallelConfig(pp=2, pp_layers=(1, 3)).stage_layers(4) == [range(0, 1), range(1, 4)]
    with pytest.raises(ValueError):
        ParallelConfig(pp=2, pp_layers=(1, 1)).stage_layers(4)


def test_tp2_and_pp2_match_one_process(models: dict[str, Path]) -> None:
    reqs, arrivals = mixed_requests(16, 500)
    plan = [
        ("llama tp2", "llama", 2, 1, SMALL),
        ("qwen3 tp2", "qwen3", 2, 1, SMALL),
        ("llama pp2", "llama", 1, 2, SMALL),
        ("qwen3 pp2", "qwen3", 1, 2, SMALL),
        ("llama pp2 in flight", "llama", 1, 2, LARGE),
        ("llama tp2 fused", "llama", 2, 1, FUSED),
        ("qwen3 tp2 fused", "qwen3", 2, 1, FUSED),
        ("qwen3 pp2 fused", "qwen3", 1, 2, FUSED),
    ]
    refs = []
    jobs = []
    with torch.inference_mode():
        for label, name, tp, pp, cfg in plan:
            refs.append((label, reference(models[name], cfg, reqs, arrivals)))
            jobs.append(Job(str(models[name]), tp, pp, reqs, arrivals, cfg))
    jobs.append(Job(str(models["llama"]), 1, 2, reqs, arrivals, LARGE, abandon_after=3))
    results = run_world(jobs_rank, 2, jobs, timeout_s=240)
    abandoned = results.pop()  # stopped with batches in flight: drained, then a clean stop
    assert abandoned["in_flight_at_stop"] >= 1 and len(abandoned["stats"]) == 2
    check(results, refs)
    assert all(r["preemptions"] > 0 for i, r in enumerate(results) if i != 4)  # small pools
    assert all(r["cached"] > 0 for r in results)  # prefix hits
    assert results[4]["in_flight"] == 2  # the pipeline held two batches at once
    for r in results:
        assert (
            len(r["stats"]) == 2 and r["stats"][1][2] == r["stats"][0][2]
        )  # same steps everywhere
    assert [r["executor"] for r in results[5:]] == ["FusedStage"] * 3


def test_grammar_rows_in_tp2_and_pp2_match_one_process(
    tmp_path: Path, default_model_path: Path
) -> None:
    """Rows following a JSON-schema grammar beside plain rows (greedy and sampled): the
    driver masks the last stage's logits as one process masks its own, token for token."""
    from routing.grammar import json_schema_spec
    from routing.prompt import PromptFormatter

    folder = save_random_model(
        tmp_path / "m", tiny_config(vocab_size=49152), seed=5, tokenizer_from=default_model_path
    )
    spec = json_schema_spec(
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}}
    )
    reqs, arrivals = mixed_requests(8, 49152, seed=2)
    with torch.inference_mode():
        ref = reference(folder, LARGE, with_grammar(str(folder), reqs, spec), arrivals)
    jobs = [
        Job(str(folder), tp, pp, reqs, arrivals, LARGE, grammar=spec) for tp, pp in ((2, 1), (1, 2))
    ]
    results = run_world(jobs_rank, 2, jobs, timeout_s=240)
    check(results, [("tp2", ref), ("pp2", ref)])
    fmt = PromptFormatter.from_folder(folder)
    texts = {r.request_id: fmt.decode(ref[0][r.request_id]) for r in reqs}
    assert all(texts[r.request_id].startswith("{") for r in reqs[::2])  # the grammar's rows
    assert not all(texts[r.request_id].startswith("{") for r in reqs[1::2])  # the plain rows


@pytest.mark.slow
def test_tp2_x_pp2_matches_one_process(models: dict[str, Path]) -> None:
    reqs, arrivals = mixed_requests(16, 500)
    refs, jobs = [], []
    with torch.inference_mode():
        for name in ("llama", "qwen3"):
            refs.append((name, reference(models[name], SMALL, reqs, arrivals)))
            jobs.append(Job(str(models[name]), 2, 2, reqs, arrivals, SMALL))
    check(run_world(jobs_rank, 4, jobs, timeout_s=300), refs)
