"""``python -m cloud_engine.parallel.worker``: one non-driver rank of a parallel cloud engine.

Started by :func:`cloud_engine.parallel.launch.start_local_ranks` (bound to the node process:
it dies with it) with the world's address and this rank's index; runs steps until the driver
sends STOP. Any failure (a peer gone, a timed-out wait) ends it with exit code 1.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from cloud_engine.config import EngineConfig

log = logging.getLogger("cloud_engine.parallel.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cloud_engine.parallel.worker")
    p.add_argument("--model", required=True, help="the model folder")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--pp-layers", default=None)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init", required=True, help="tcp://host:port of the world's store")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-bytes", type=int, default=None)
    p.add_argument("--max-kv-blocks", type=int, default=None)
    p.add_argument("--max-running", type=int, default=None)
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--max-graph-batch", type=int, default=256)
    p.add_argument("--cuda-graphs", type=int, choices=(0, 1), default=1)
    p.add_argument("--fused-shards", type=int, choices=(0, 1), default=None)
    p.add_argument("--timeout-s", type=float, default=30.0)
    return p


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(x) for x in text.split(",")) if text else None


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the driver passed on (``launch.worker_argv``)."""
    return EngineConfig(
        device=args.device,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        threads=args.threads,
        kv_memory_bytes=args.kv_bytes,
        max_kv_blocks=args.max_kv_blocks,
        max_running=args.max_running,
        max_context=args.max_context,
        max_graph_batch=args.max_graph_batch,
        cuda_graphs=bool(args.cuda_graphs),
        fused_shards=None if args.fused_shards is None else bool(args.fused_shards),
    )


def main(argv: list[str] | None = None) -> int:
    from routing.supervisor import bind_to_parent

    bind_to_parent()
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s: %(message)s"
    )
    from cloud_engine.parallel.build import run_worker
    from cloud_engine.parallel.dist import ParallelConfig, close_world, init_world

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_from_args(args)
    pcfg = ParallelConfig(args.tp, args.pp, parse_layers(args.pp_layers))
    try:
        rank = init_world(
            pcfg, args.rank, init_method=args.init, device=args.device, timeout_s=args.timeout_s
        )
        run_worker(args.model, rank, cfg)
    except Exception:
        log.exception("rank %d failed", args.rank)
        return 1
    finally:
        close_world()
    return 0


if __name__ == "__main__":
    sys.exit(main())
