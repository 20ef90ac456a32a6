"""``edgecloud edge``: the edge tier's commands.

``edge export MODEL``: export a model to a cached ONNX decoder graph (fp32, int8 or int4) and
print the graph's folder. Further ``edge`` subcommands (``serve``) register in ``register``
below, each with its own ``add_*`` function; torch and onnxruntime load only in the handlers.
"""

from __future__ import annotations

import argparse
import sys

from gateway.commands.node_args import EDGE_FLAGS, add_engine_flags, add_node_arguments
from routing.model_store import DEFAULT_MODEL

VARIANTS = ("fp32", "int8", "int4")  # edge_runtime.export's (not imported: it loads onnx)
# "auto": the quality gate's pick for this CPU (edge_runtime.quality_gate)
VARIANT_CHOICES = ("auto", *VARIANTS)
VARIANT_HELP = (
    "weights: fp32, int8 or int4 (8- or 4-bit blocks); default auto: the fastest that answers "
    "as well as fp32 on this CPU (the quality gate)"
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("edge", help="edge tier: export models to ONNX (and serve them)")
    esub = p.add_subparsers(dest="edge_command", metavar="{export,serve}")
    p.set_defaults(func=lambda args: _no_subcommand(p))
    add_export(esub)
    add_serve(esub)


def _no_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def add_export(esub: argparse._SubParsersAction) -> None:
    e = esub.add_parser(
        "export",
        help="export a model to a cached ONNX decoder graph",
        description=(
            "Export a model (store name or Hugging Face folder) to an ONNX decoder graph with "
            "KV-cache inputs and outputs, cached under the edgecloud home by the model's "
            "identity; an export that is already cached is reused. Prints the graph's folder."
        ),
    )
    e.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    e.add_argument("--variant", "-p", choices=VARIANT_CHOICES, default="auto", help=VARIANT_HELP)
    e.add_argument(
        "--attention",
        choices=("gqa", "concat"),
        default="gqa",
        help=(
            "gqa: ONNX Runtime's GroupQueryAttention, KV updated in place (fastest); "
            "concat: standard ONNX ops only, for execution providers without contrib ops"
        ),
    )
    e.add_argument("--force", action="store_true", help="re-export even if cached")
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from edge_runtime.export import ensure_export
    from edge_runtime.quality_gate import choose_variant
    from gateway.cli import describe_error
    from routing.model_store import ModelNotFound

    try:
        variant = args.variant
        if variant == "auto":
            variant = choose_variant(args.model).chosen
        graph = ensure_export(args.model, variant, args.attention, force=args.force)
    except ModelNotFound as e:  # one line naming what is stored and what can be pulled
        message = describe_error(e)
        print(f"edgecloud edge export: error: {message[0] if message else e}", file=sys.stderr)
        return 1
    print(graph.folder)
    return 0


def add_serve(esub: argparse._SubParsersAction) -> None:
    s = esub.add_parser("serve", help="serve a model with the ONNX Runtime edge engine")
    add_node_arguments(s, default_port=8001)
    s.add_argument("--variant", "-p", choices=VARIANT_CHOICES, default="auto", help=VARIANT_HELP)
    add_engine_flags(s, EDGE_FLAGS)
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from edge_runtime.engine import EdgeEngine, EdgeEngineConfig
    from gateway.commands.node_args import (
        check_redis_args,
        drain_limits,
        node_tls_from_env,
        node_token_from_args,
    )
    from gateway.node.server import serve_node
    from routing.model_store import resolve

    node_token = node_token_from_args(args, "edgecloud edge serve")
    check_redis_args(args, "edgecloud edge serve")
    tls = node_tls_from_env("edgecloud edge serve")
    info = resolve(args.model)
    cfg = EdgeEngineConfig(**{f.key: getattr(args, f.key) for f in EDGE_FLAGS})
    engine = EdgeEngine.from_model(info.path, args.variant, config=cfg)
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
