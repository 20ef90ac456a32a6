"""Starting a parallel cloud engine: rank processes on one host, or a ``torchrun`` world.

One host (``edgecloud cloud serve --tp N --pp M``): the node process is rank 0 (the driver);
:func:`start_local_ranks` starts ranks ``1 .. N*M-1`` as ``python -m
cloud_engine.parallel.worker`` children under one :class:`routing.supervisor.Supervisor`
(they die with the node: parent-death signal and pipe). A rank that exits while the node runs
is fatal: the node kills the other ranks and exits at once (exit code 75), so a dead rank takes
the node down well within 10 s, and clients see it unhealthy (not answering) rather than hung.

``torchrun`` (several hosts, or one): every process runs the same ``edgecloud cloud serve
--tp N --pp M`` command; ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` come from the
environment, rank 0 serves the Node API and the others run the worker loop. torchrun owns
their lifecycle (it stops the group when one fails); each collective's timeout is the last
line of defence.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cloud_engine.config import EngineConfig
from cloud_engine.parallel.dist import ParallelConfig, Rank, init_world, parse_pp_layers
from cloud_engine.parallel.local import free_port

log = logging.getLogger(__name__)

FATAL_EXIT = 75


@dataclass
class LocalRanks:
    """The rank processes this node started (rank 0 is this process)."""

    supervisor: object | None
    pids: list[int] = field(default_factory=list)


def under_torchrun() -> bool:
    """The world comes from the environment (torchrun or any ``env://`` launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _die(reason: str, supervisor: object | None) -> None:
    """Fatal: a rank is gone. Kill the other ranks and leave now (no drain: the engine is broken)."""
    log.critical("%s: stopping the node", reason)
    if supervisor is not None:
        for child in list(getattr(supervisor, "children", [])):
            with contextlib.suppress(OSError):
                child.proc.kill()
    sys.stderr.flush()
    os._exit(FATAL_EXIT)


def worker_argv(
    folder: str, pcfg: ParallelConfig, rank: int, init: str, cfg: EngineConfig, timeout_s: float
) -> list[str]:
    argv = [sys.executable, "-m", "cloud_engine.parallel.worker", "--model", folder]
    argv += ["--tp", str(pcfg.tp), "--pp", str(pcfg.pp), "--rank", str(rank), "--init", init]
    argv += ["--device", cfg.device, "--timeout-s", str(timeout_s)]
    if pcfg.pp_layers:
        argv += ["--pp-layers", ",".join(map(str, pcfg.pp_layers))]
    if cfg.dtype is not None:
        argv += ["--dtype", str(cfg.dtype).removeprefix("torch.")]
    if cfg.threads:
        argv += ["--threads", str(cfg.threads)]
    if cfg.kv_memory_bytes is not None:
        argv += ["--kv-bytes", str(cfg.kv_memory_bytes)]
    if cfg.max_kv_blocks is not None:
        argv += ["--max-kv-blocks", str(cfg.max_kv_blocks)]
    # what shapes a rank's tables and decode graphs: every rank of a group must agree
    if cfg.max_running is not None:
        argv += ["--max-running", str(cfg.max_running)]
    if cfg.max_context is not None:
        argv += ["--max-context", str(cfg.max_context)]
    argv += ["--max-graph-batch", str(cfg.max_graph_batch)]
    argv += ["--cuda-graphs", "1" if cfg.cuda_graphs else "0"]
    if cfg.fused_shards is not None:
        argv += ["--fused-shards", "1" if cfg.fused_shards else "0"]
    return argv


def start_local_ranks(
    folder: str, pcfg: ParallelConfig, cfg: EngineConfig, init: str, timeout_s: float
) -> LocalRanks:
    """Start ranks 1.. as children of this process (call from the main thread)."""
    from routing.supervisor import ChildSpec, Supervisor

    holder: list[object] = []
    sup = Supervisor(
        on_unexpected_exit=lambda ex: _die(ex.describe(), holder[0] if holder else None)
    )
    holder.append(sup)
    pids = []
    for r in range(1, pcfg.world_size):
        env = dict(os.environ, LOCAL_RANK=str(r), OMP_NUM_THREADS=str(cfg.threads or 1))
        child = sup.start(
            ChildSpec(f"rank {r}", worker_argv(folder, pcfg, r, init, cfg, timeout_s), env)
        )
        pids.append(child.pid)
    return LocalRanks(sup, pids)


def parallel_engine(
    folder: str | Path,
    identity: str,
    pcfg: ParallelConfig,
    cfg: EngineConfig,
    *,
    timeout_s: float = 30.0,
):  # type: ignore[no-untyped-def]
    """This process's part of a parallel engine: the :class:`CloudEngine` on rank 0, or None
    on another torchrun rank once its worker loop has ended (the caller then exits)."""
    from cloud_engine.engine import CloudEngine
    from cloud_engine.parallel.build import driver_core, run_worker
    from cloud_engine.parallel.dist import close_world

    cfg = cfg.resolved()
    folder = str(folder)
    if under_torchrun():
        rank_idx = int(os.environ["RANK"])
        if int(os.environ["WORLD_SIZE"]) != pcfg.world_size:
            raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but tp*pp={pcfg.world_size}")
        rank = init_world(pcfg, rank_idx, device=cfg.device, timeout_s=timeout_s)
        local = LocalRanks(None)
        if not rank.is_driver:
            try:
                run_worker(folder, rank, cfg)
            finally:
                close_world()
            return None
    else:
        init = f"tcp://127.0.0.1:{free_port()}"
        local = start_local_ranks(folder, pcfg, cfg, init, timeout_s)
        rank = init_world(pcfg, 0, init_method=init, device=cfg.device, timeout_s=timeout_s)
    core = driver_core(folder, identity, rank, cfg)
    runner = core.runner
    runner.on_error = lambda exc: _die(f"a collective failed ({exc!r})", local.supervisor)  # type: ignore[attr-defined]
    runner.local_ranks = local  # type: ignore[attr-defined]
    return CloudEngine(core, parallel=describe(rank))


def describe(rank: Rank) -> dict[str, object]:
    """A parallel engine's ``EngineTraits`` fields: tp, pp and each rank's device."""
    dev = rank.device
    n = rank.config.world_size
    if dev.type == "cuda":
        devices = [f"cuda:{i % max(1, torch.cuda.device_count())}" for i in range(n)]
    else:
        devices = ["cpu"] * n
    return {"tp": rank.config.tp, "pp": rank.config.pp, "devices": devices}


def parallel_engine_for(info, cfg: EngineConfig, tp: int, pp: int, pp_layers: str | None = None):  # type: ignore[no-untyped-def]
    """``edgecloud cloud serve --tp --pp``: the engine of a store model (``info``), with each
    rank's torch threads defaulting to the host's cores divided among the ranks."""
    from dataclasses import replace

    pcfg = ParallelConfig(tp, pp, parse_pp_layers(pp_layers, info.path, pp))
    if not cfg.threads and torch.device(cfg.device).type == "cpu":
        cfg = replace(cfg, threads=max(1, (os.cpu_count() or 1) // pcfg.world_size))
    return parallel_engine(info.path, info.identity, pcfg, cfg)
