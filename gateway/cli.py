"""The ``edgecloud`` command. Each subcommand lives in its own ``gateway.commands.*`` module
exposing ``register(subparsers)``; heavy imports (torch, onnxruntime) happen inside the
handlers, so ``edgecloud --help`` and the gateway start fast."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# One line per subcommand module; each registers its own parsers.
COMMAND_MODULES = [
    "gateway.commands.models",
    "gateway.commands.chat",
    "gateway.commands.gateway",
    "gateway.commands.cloud",
    "gateway.commands.edge",
    "gateway.commands.sim",
    "gateway.commands.profile",
    "gateway.commands.tune",
    "gateway.commands.replay",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgecloud", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # A process started by a Supervisor (``edgecloud serve``'s nodes) dies with its parent.
    from gateway.supervisor import bind_to_parent

    bind_to_parent()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # one line per node poll is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
