"""Flags shared by the node commands (``edge serve``, ``cloud serve``); imports nothing heavy."""

from __future__ import annotations

import argparse

from gateway.server_limits import add_server_arguments


def add_node_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The flags every ``... serve`` node command shares (model, place, fleet store, limits)."""
    parser.add_argument("--model", default="smollm2-135m-instruct", help="store name or HF folder")
    parser.add_argument("--region", default="local")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=default_port)
    parser.add_argument("--node-id", default=None)
    parser.add_argument(
        "--public-url", default=None, help="URL gateways use (default: http://host:port)"
    )
    parser.add_argument(
        "--redis", dest="redis_url", default=None, help="fleet store, e.g. redis://host:6379/0"
    )
    add_server_arguments(parser)
