"""Building one rank's part of a parallel engine: weights, KV pool shard, runner or worker loop."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.kv_pool import KVPool, budget_bytes_for
from cloud_engine.parallel.dist import ParallelConfig, Rank
from cloud_engine.parallel.model import ShardedLlama
from cloud_engine.parallel.moe import read_config
from cloud_engine.parallel.pipeline import PipelineCore
from cloud_engine.parallel.runner import DistRunner, make_pool, worker_loop


def load_rank(folder: str | Path, rank: Rank, cfg: EngineConfig) -> tuple[ShardedLlama, KVPool]:
    """This rank's weights (only its shards are read) and its shard of the KV pool.

    ``cfg.kv_memory_bytes`` (or the CUDA fraction) is the budget of *each* rank; the block
    count is the minimum over the world."""
    cfg = cfg.resolved()
    assert cfg.dtype is not None
    mc, _ = read_config(str(folder))
    layers = rank.config.stage_layers(mc.num_hidden_layers)[rank.pp_rank]
    model = ShardedLlama(str(folder), rank, layers, cfg.dtype)
    budget = budget_bytes_for(rank.device, cfg.kv_memory_fraction, cfg.kv_memory_bytes)
    return model, make_pool(model, rank, budget, cfg)


def driver_core(folder: str | Path, identity: str, rank: Rank, cfg: EngineConfig) -> EngineCore:
    """Rank 0's engine core: the one scheduler and block manager over every rank."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, pool = load_rank(folder, rank, cfg)
    runner = DistRunner(model, pool, rank, cfg)
    cfg = replace(cfg, overlap=False, device=str(rank.device))
    if rank.config.pp > 1:
        return PipelineCore(model, identity, cfg, runner, depth=rank.config.pp)
    return EngineCore(model, identity, cfg, runner)  # type: ignore[arg-type]


def single_process_core(folder: str | Path, identity: str, cfg: EngineConfig) -> EngineCore:
    """A whole model in this process, loaded by the parallel package (the families with
    mixture-of-experts layers): on CUDA the fused model with its kernels and CUDA graphs
    (:class:`cloud_engine.cuda_runner.CudaRunner`), elsewhere the eager layers."""
    cfg = cfg.resolved()
    rank = Rank(ParallelConfig(), 0, None, torch.device(cfg.device))
    model, pool = load_rank(folder, rank, cfg)
    if rank.device.type == "cuda":
        return EngineCore(model, identity, cfg, pool=pool)  # type: ignore[arg-type]
    cfg = replace(cfg, overlap=False)
    return EngineCore(model, identity, cfg, DistRunner(model, pool, rank, cfg))  # type: ignore[arg-type]


def run_worker(folder: str | Path, rank: Rank, cfg: EngineConfig) -> None:
    """A non-driver rank: load its part and serve steps until the driver sends STOP."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, pool = load_rank(folder, rank, cfg)
    worker_loop(model, pool, rank, cfg)


__all__ = ["ParallelConfig", "driver_core", "load_rank", "run_worker", "single_process_core"]
