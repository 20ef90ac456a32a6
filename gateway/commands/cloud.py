"""``edgecloud cloud serve``: the torch paged engine behind the Node API."""

from __future__ import annotations

import argparse
import os

from gateway.commands.argtypes import nonneg_int, positive_float, positive_int, pp_spec
from gateway.commands.node_args import CLOUD_FLAGS, add_engine_flags, add_node_arguments


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    c = sub.add_parser("cloud", help="cloud engine commands")
    csub = c.add_subparsers(dest="cloud_command", required=True)
    s = csub.add_parser("serve", help="serve a model with the paged torch engine")
    add_node_arguments(s, default_port=8002)
    add_engine_flags(s, CLOUD_FLAGS)
    s.add_argument(
        "--kv-budget-mb",
        type=positive_float,
        default=None,
        help="KV cache memory on CPU; raise it for longer or more answers at once (default 512)",
    )
    s.add_argument(
        "--max-waiting",
        type=nonneg_int,
        default=1024,
        help="requests that may wait for a batch row before the node answers 429",
    )
    s.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks, one GPU each")
    s.add_argument(
        "--pp",
        type=pp_spec,
        default=(1, None),
        metavar="STAGES[:LAYERS]",
        help="pipeline stages, one process each; ':balanced' or ':10,14' sets the layers per "
        "stage (default: 1; layers even)",
    )
    s.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import torch

    from cloud_engine.engine import CloudEngine
    from gateway.commands.node_args import (
        check_redis_args,
        drain_limits,
        node_tls_from_env,
        node_token_from_args,
    )
    from gateway.node.server import serve_node
    from routing.model_store import resolve

    node_token = node_token_from_args(args, "edgecloud cloud serve")
    check_redis_args(args, "edgecloud cloud serve")
    tls = node_tls_from_env("edgecloud cloud serve")
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
        max_waiting=args.max_waiting,
        kv_memory_bytes=int(args.kv_budget_mb * 2**20) if args.kv_budget_mb else None,
        prefill_stall_ratio=args.prefill_stall_ratio,
        kv_dtype=args.kv_dtype,
    )
    pp, pp_layers = args.pp
    if args.tp * pp > 1:  # rank processes on this host, or this rank of a torchrun world
        from cloud_engine.parallel.launch import parallel_engine_for

        engine = parallel_engine_for(info, cfg, args.tp, pp, pp_layers)
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
        limits=drain_limits(args),
        node_token=node_token,
        watts=args.watts,
        tls=tls,
    )
    return 0
