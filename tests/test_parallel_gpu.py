"""TP=2 on one GPU: two processes, gloo with CUDA tensors (NCCL wants one GPU per rank), plain
torch layers on the shards; gives the single-process tokens. Marked ``gpu``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parallel_jobs import Job, drive, jobs_rank, mixed_requests

from cloud_engine.config import EngineConfig
from cloud_engine.model.loader import save_random_model, tiny_config
from cloud_engine.parallel.build import driver_core
from cloud_engine.parallel.dist import ParallelConfig, Rank
from cloud_engine.parallel.local import run_world

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tp2_on_one_gpu_with_gloo_matches_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDGECLOUD_PP_BACKEND", "gloo")
    folders = [
        save_random_model(tmp_path / "llama", tiny_config(), seed=3),
        save_random_model(
            tmp_path / "qwen3",
            tiny_config(model_type="qwen3", qk_norm=True, num_key_value_heads=1, vocab_size=501),
            seed=4,
        ),
    ]
    cfg = EngineConfig(
        device="cuda", dtype=torch.float32, max_kv_blocks=14, max_tokens_per_step=128
    )
    reqs, arrivals = mixed_requests(16, 500)
    one = Rank(ParallelConfig(), 0, None, torch.device("cuda", 0))
    refs, jobs = [], []
    with torch.inference_mode():
        for f in folders:
            refs.append(drive(driver_core(f, "gpu", one, cfg), reqs, arrivals))
            jobs.append(Job(str(f), 2, 1, reqs, arrivals, cfg))
    results = run_world(jobs_rank, 2, jobs, timeout_s=300)
    for ref, got in zip(refs, results, strict=True):
        assert got["tokens"] == ref
        assert got["preemptions"] > 0
