"""Mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral),
written by transformers' own classes: our logits match transformers' in float32, and TP=2
with expert parallelism gives the single-process tokens."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from moe_checkpoints import VOCAB, write_moe_models
from parallel_jobs import Job, drive, jobs_rank, mixed_requests

from cloud_engine.attention_torch import TorchPagedBackend, make_meta
from cloud_engine.config import EngineConfig
from cloud_engine.kv_pool import KVPool, KVSpec
from cloud_engine.parallel.build import driver_core
from cloud_engine.parallel.dist import ParallelConfig, Rank
from cloud_engine.parallel.local import run_world
from cloud_engine.parallel.model import ShardedLlama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_moe_models(tmp_path_factory.mktemp("moe"))


ONE = Rank(ParallelConfig(), 0, None, torch.device("cpu"))


def our_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    model = ShardedLlama(str(folder), ONE, range(model_layers(folder)), torch.float32)
    cfg = model.config
    pool = KVPool(KVSpec(len(model.layers), model.kv_heads, cfg.head_dim, torch.float32), 4, "cpu")
    t = len(ids)
    meta = make_meta(torch.arange(t), torch.arange(4).unsqueeze(0), [0, t], [t])
    with torch.inference_mode():
        hidden = model.forward_stage(
            torch.tensor([ids]), None, torch.arange(t).unsqueeze(0), TorchPagedBackend(pool, meta)
        )
        return model.local_logits(hidden[0])


def model_layers(folder: Path) -> int:
    from cloud_engine.parallel.moe import read_config

    return read_config(str(folder))[0].num_hidden_layers


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_packed", "qwen2_moe", "mixtral"])
def test_logits_match_transformers(moe_models: dict[str, Path], name: str) -> None:
    import transformers as tf

    ids = [
        int(x) for x in torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(5))
    ]
    ref = tf.AutoModelForCausalLM.from_pretrained(moe_models[name], dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0].float()
    got = our_logits(moe_models[name], ids)
    assert want.abs().max().item() > 1.0  # spread logits, not a near-zero comparison
    assert (got - want).abs().max().item() < 1e-4


def test_tp2_expert_parallel_matches_one_process(moe_models: dict[str, Path]) -> None:
    reqs, arrivals = mixed_requests(12, VOCAB, seed=2)
    cfg = EngineConfig(max_kv_blocks=40, max_tokens_per_step=128, debug_checks=True)
    refs, jobs = [], []
    with torch.inference_mode():
        for name, folder in moe_models.items():
            if name.endswith("packed"):
                continue
            core = driver_core(folder, "moe", ONE, cfg)
            refs.append((name, drive(core, reqs, arrivals)))
            jobs.append(Job(str(folder), 2, 1, reqs, arrivals, cfg))
            if name == "qwen3_moe":  # the fused model on the shards too
                refs.append((name + " fused", refs[-1][1]))
                jobs.append(Job(str(folder), 2, 1, reqs, arrivals, replace(cfg, fused_shards=True)))
    results = run_world(jobs_rank, 2, jobs, timeout_s=240)
    for (name, ref), got in zip(refs, results, strict=True):
        assert got["tokens"] == ref, name
        assert got["executor"] == ("FusedStage" if "fused" in name else "StageExecutor")


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_fused_model_over_moe_layers_matches_the_eager_layers(
    moe_models: dict[str, Path], name: str
) -> None:
    """The CUDA runner's logic (fused model built from the shard, device block tables, decode
    batches) with the torch ops on CPU gives the eager layers' tokens, prefix hits and the
    logits path included."""
    from cloud_engine.core import EngineCore
    from cloud_engine.cuda_runner import CudaRunner
    from cloud_engine.model.torch_ops import TorchOps
    from cloud_engine.parallel.build import load_rank

    reqs, arrivals = mixed_requests(12, VOCAB, seed=3)
    cfg = EngineConfig(max_kv_blocks=60, max_tokens_per_step=128, debug_checks=True)
    with torch.inference_mode():
        ref = drive(driver_core(moe_models[name], "moe", ONE, cfg), reqs, arrivals)
        model, pool = load_rank(moe_models[name], ONE, cfg)
        runner = CudaRunner(model, pool, max_batch=16, max_context=1024, ops=TorchOps())  # type: ignore[arg-type]
        core = EngineCore(model, "moe", cfg, runner)  # type: ignore[arg-type]
        got = drive(core, reqs, arrivals)
    assert sum(map(len, ref.values())) > 100
    assert got == ref
    assert core.counters.cached_prompt_tokens > 0


def test_a_moe_folder_loads_as_one_process_engine(moe_models: dict[str, Path]) -> None:
    """``CloudEngine.from_model`` (``edgecloud cloud serve`` at tp=1) takes a MoE checkpoint
    through the parallel loader and gives its tokens."""
    from cloud_engine.engine import CloudEngine

    reqs, arrivals = mixed_requests(6, VOCAB, seed=4)
    cfg = EngineConfig(max_kv_blocks=60, max_tokens_per_step=128)
    with torch.inference_mode():
        ref = drive(driver_core(moe_models["qwen3_moe"], "moe", ONE, cfg), reqs, arrivals)
        engine = CloudEngine.from_model(moe_models["qwen3_moe"], config=cfg)
        assert engine.core.vocab_size == VOCAB
        assert drive(engine.core, reqs, arrivals) == ref
