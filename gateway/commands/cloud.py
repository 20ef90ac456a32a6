"""``edgecloud cloud serve``: the torch paged engine behind the Node API."""

from __future__ import annotations

import argparse
import os

from gateway.commands.argtypes import cloud_stall_ratio, positive_int
from gateway.commands.node_args import add_node_arguments


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    c = sub.add_parser("cloud", help="cloud engine commands")
    csub = c.add_subparsers(dest="cloud_command", required=True)
    s = csub.add_parser("serve", help="serve a model with the paged torch engine")
    add_node_arguments(s, default_port=8002)
    s.add_argument("--device", default="auto", help="cuda, cpu or auto")
    s.add_argument("--threads", type=int, default=None, help="torch threads on CPU")
    s.add_argument("--kv-budget-mb", type=float, default=None, help="KV pool bytes on CPU")
    s.add_argument(
        "--max-running",
        type=positive_int,
        default=None,
        help="max running sequences (default 256 on CUDA, 4 per --threads on CPU; more wait)",
    )
    s.add_argument("--max-waiting", type=int, default=None, help="waiting queue size (then 429)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one process each)")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages (one process each)")
    s.add_argument(
        "--pp-layers",
        default=None,
        help="layers per stage, e.g. 10,14, or balanced (the LM head counted on the last "
        "stage) (default: even)",
    )
    s.add_argument(
        "--prefill-stall-ratio",
        type=cloud_stall_ratio,
        default=None,
        help="while answers decode, a step takes at most this many decode steps' time of "
        "prompt tokens, so each of their tokens waits at most 1 + ratio steps ('off': the "
        "whole step budget; default 1 on CPU, off on CUDA)",
    )
    s.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import torch

    from cloud_engine.engine import CloudEngine
    from gateway.commands.node_args import node_token_from_args
    from gateway.node.server import serve_node
    from gateway.server_limits import limits_from_args
    from routing.model_store import resolve

    node_token = node_token_from_args(args, "edgecloud cloud serve")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads or torch.get_num_threads()))
    info = resolve(args.model)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    from cloud_engine.config import EngineConfig

    cfg = EngineConfig(
        device=device,
        threads=args.threads,
        max_running=args.max_running,
        max_waiting=args.max_waiting if args.max_waiting is not None else 1024,
        kv_memory_bytes=int(args.kv_budget_mb * 2**20) if args.kv_budget_mb else None,
        prefill_stall_ratio=args.prefill_stall_ratio,
    )
    if args.tp * args.pp > 1:  # rank processes on this host, or this rank of a torchrun world
        from cloud_engine.parallel.launch import parallel_engine_for

        engine = parallel_engine_for(info, cfg, args.tp, args.pp, args.pp_layers)
        if engine is None:  # a torchrun rank other than 0: its worker loop has ended
            return 0
    else:
        engine = CloudEngine.from_model(info.path, device=device, config=cfg)
    serve_node(
        engine,
        info,
        region=args.region,
        host=args.host,
        port=args.port,
        node_id=args.node_id,
        public_url=args.public_url,
        redis_url=args.redis_url,
        limits=limits_from_args(args),
        node_token=node_token,
    )
    return 0
