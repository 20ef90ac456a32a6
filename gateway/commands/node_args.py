"""Flags shared by the node commands (``edge serve``, ``cloud serve``); imports nothing heavy."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from gateway.commands.argtypes import port
from gateway.server_limits import add_server_arguments

NODE_TOKEN_ENV = "EDGECLOUD_NODE_TOKEN"  # = gateway.auth.NODE_TOKEN_ENV (not imported: light)


def add_node_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The flags every ``... serve`` node command shares (model, place, fleet store, limits)."""
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="store name (see: edgecloud models list) or Hugging Face folder path",
    )
    parser.add_argument(
        "--region", default="local", help="the region this node is in (routing prefers near nodes)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (non-loopback needs a node token)"
    )
    parser.add_argument("--port", type=port, default=default_port, help="port to listen on")
    parser.add_argument(
        "--node-id", default=None, help="the id gateways know it by (default: kind-host-port)"
    )
    parser.add_argument(
        "--public-url", default=None, help="URL gateways use (default: http://host:port)"
    )
    parser.add_argument(
        "--redis",
        dest="redis_url",
        default=None,
        help="fleet store, e.g. redis://host:6379/0 or rediss:// (TLS); password: "
        "$EDGECLOUD_REDIS_PASSWORD",
    )
    parser.add_argument(
        "--node-token",
        default=None,
        help=f"requests must carry it (X-Edgecloud-Node-Token); default ${NODE_TOKEN_ENV}, "
        "which keeps it out of the process list",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve a non-loopback host without a node token",
    )
    add_server_arguments(parser)


def node_token_from_args(args: argparse.Namespace, prog: str) -> str | None:
    """The node token (flag, else environment), checked; exits with status 2 (and a message)
    when it is weak, or when the node would listen beyond loopback without one and without
    ``--insecure-no-auth``."""
    from gateway.auth import check_node_token

    token = args.node_token or os.environ.get(NODE_TOKEN_ENV) or None
    if token is not None:
        try:
            check_node_token(token)
        except ValueError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        return token
    host = args.host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not args.insecure_no_auth:
        print(
            f"{prog}: error: refusing to serve on {args.host} without a node token: anyone who "
            f"can reach it could run generations. Set ${NODE_TOKEN_ENV} (or --node-token) to "
            "the token the gateways send (their node_token), or pass --insecure-no-auth.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return None
