"""The node commands' flags (``edge serve``, ``cloud serve``), declared once: each engine flag
is added to its node command and, where ``serve`` offers it, to ``serve`` under a prefixed name
and handed back to the node it starts. Imports nothing heavy."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.commands.argtypes import (
    cloud_stall_ratio,
    kv_dtype,
    nonneg_float,
    nonneg_int,
    port,
    positive_int,
    serve_cloud_device,
    stall_ratio,
    torch_device,
    watts,
)
from gateway.server_limits import ServerLimits

if TYPE_CHECKING:
    from gateway.tls_folder import TLSFolder

NODE_TOKEN_ENV = "EDGECLOUD_NODE_TOKEN"  # = gateway.node_token.NODE_TOKEN_ENV (not imported: light)


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag: ``--name`` on its node command; on ``serve`` as ``--serve_as`` (unset
    there: not handed on, the node's default holds). Invariant: ``serve`` hands a value on as
    ``--name VALUE``, which the node command parses back to the same value."""

    name: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    serve_as: str | None = None
    serve_help: str | None = None
    action: str | None = None  # "store_false" for a --no-... switch (never on serve)
    dest: str | None = None
    serve_type: Callable[[str], Any] | None = None  # on serve, when not ``type``

    @property
    def key(self) -> str:
        """Its attribute on the node command's parsed arguments."""
        return self.dest or self.name.replace("-", "_")

    @property
    def serve_key(self) -> str:
        assert self.serve_as is not None
        return self.serve_as.replace("-", "_")


def _providers(text: str) -> tuple[str, ...]:
    """``"openvino:device_type=NPU,enable_causallm=True,cpu"`` as providers: a ``key=value``
    after a comma is one more option of the provider before it."""
    out: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, _ = part.partition("=")
        if out and sep and ":" not in key:
            out[-1] += f",{part}"
        else:
            out.append(part)
    return tuple(out)


_SERVE_STALL_HELP = (
    "both nodes' --prefill-stall-ratio: lower keeps answers streaming while prompts arrive, "
    "higher gives new prompts their first token sooner ('off': whole chunks)"
)

EDGE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag(
        "threads",
        "ONNX Runtime threads; lower it when other processes share the cores "
        "(default: the CPUs, at most 8)",
        positive_int,
        serve_as="edge-threads",
        serve_help="the edge node's threads (default: half the cores beside a cloud node, "
        "its own alone)",
    ),
    EngineFlag(
        "slots",
        "answers decoded together; raise it to serve more users at once, each a little slower",
        positive_int,
        4,
        serve_as="edge-slots",
        serve_help="the edge node's --slots: answers it decodes together (default 4 beside a cloud "
        "node, 16 alone)",
    ),
    EngineFlag(
        "max-waiting",
        "requests that may wait for a slot before the node answers 429",
        nonneg_int,
        16,
    ),
    EngineFlag(
        "context",
        "tokens of KV cache per slot; lower it to save memory (default: the model's, at most 2048)",
        positive_int,
    ),
    EngineFlag(
        "providers",
        "ONNX Runtime execution providers to try, in order, comma-separated (default: NPUs, "
        "then CPU)",
        _providers,
    ),
    EngineFlag(
        "prefill-stall-ratio",
        "while answers decode, a prompt runs in chunks of this many decode steps' time; lower "
        "keeps answers streaming, higher gives new prompts their first token sooner ('off': "
        "256-token chunks)",
        stall_ratio,
        1.0,
        serve_as="prefill-stall-ratio",
        serve_help=_SERVE_STALL_HELP,
        serve_type=cloud_stall_ratio,  # keeps 'off' as said, so that it is handed on
    ),
    EngineFlag(
        "no-huge-pages",
        "keep the weights and KV cache in 4 KB pages; use it where transparent huge pages "
        "misbehave",
        action="store_false",
        dest="huge_pages",
    ),
)

CLOUD_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag(
        "device",
        "torch device: cuda, cuda:N, cpu or auto (cuda where available)",
        torch_device,
        default="auto",
        serve_as="cloud-device",
        serve_help="the cloud node's device: cuda, cpu, or off (no cloud node); default auto: "
        "cuda where visible, else off (without a GPU the edge alone on every core answers sooner)",
        serve_type=serve_cloud_device,
    ),
    EngineFlag(
        "threads",
        "torch threads on CPU; lower it when other processes share the cores",
        positive_int,
        serve_as="cloud-threads",
        serve_help="the cloud node's threads (default: the other half of the cores)",
    ),
    EngineFlag(
        "max-running",
        "answers decoded together (default 256 on CUDA, 4 per thread on CPU, where more only "
        "slow every answer)",
        positive_int,
        serve_as="cloud-max-running",
        serve_help="the cloud node's --max-running (default: 4 per thread on CPU, 256 on CUDA)",
    ),
    EngineFlag(
        "kv-dtype",
        "what the KV cache stores: bf16, fp8 (e4m3) or int8 (8-bit with a scale per token and "
        "head: about twice the tokens in the same memory), or auto: the model's dtype unless "
        "that cache would hold fewer than 4 requests of the full context on CUDA, then fp8 (on "
        "CPU auto never compresses)",
        kv_dtype,
        "auto",
        serve_as="kv-dtype",
        serve_help="the cloud node's --kv-dtype: auto, bf16, fp8 or int8 (default auto)",
    ),
    EngineFlag(
        "prefill-stall-ratio",
        "while answers decode, a step holds this many decode steps' time of prompt tokens; "
        "lower keeps answers streaming ('off': the whole step budget; default 1 on CPU, off "
        "on CUDA)",
        cloud_stall_ratio,
        serve_as="prefill-stall-ratio",
        serve_help=_SERVE_STALL_HELP,
    ),
)


def add_engine_flags(parser: argparse.ArgumentParser, flags: Sequence[EngineFlag]) -> None:
    """Add ``flags`` to a node command under their own names and defaults."""
    for f in flags:
        if f.action is not None:
            parser.add_argument(f"--{f.name}", dest=f.key, action=f.action, help=f.help)
        else:
            parser.add_argument(f"--{f.name}", type=f.type, default=f.default, help=f.help)


def add_serve_flags(parser: argparse.ArgumentParser, *tables: Sequence[EngineFlag]) -> None:
    """Add every flag of ``tables`` that ``serve`` offers, once per ``serve_as`` name, unset
    by default (the node's own default holds)."""
    seen: set[str] = set()
    for f in (f for table in tables for f in table):
        if f.serve_as is None or f.serve_as in seen:
            continue
        seen.add(f.serve_as)
        kind = f.serve_type or f.type
        parser.add_argument(f"--{f.serve_as}", type=kind, default=None, help=f.serve_help)


def serve_argv(flags: Sequence[EngineFlag], args: argparse.Namespace) -> list[str]:
    """The node command's flags for what ``serve`` was given of ``flags``."""
    argv: list[str] = []
    for f in flags:
        if f.serve_as is None:
            continue
        value = getattr(args, f.serve_key)
        if value is None:
            continue
        argv += [f"--{f.name}", ",".join(value) if isinstance(value, tuple) else str(value)]
    return argv


def add_node_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The flags every ``... serve`` node command shares (model, place, fleet store, drain)."""
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="store name (see: edgecloud models list) or Hugging Face folder path",
    )
    parser.add_argument(
        "--region", default="local", help="the region this node is in; routing prefers near nodes"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (non-loopback needs a node token)"
    )
    parser.add_argument("--port", type=port, default=default_port, help="port to listen on")
    parser.add_argument(
        "--node-id", default=None, help="the id gateways know it by (default: kind-host-port)"
    )
    parser.add_argument(
        "--public-url",
        default=None,
        help="URL gateways reach it at; set it behind NAT or a proxy (default: http://host:port, "
        "https:// with $EDGECLOUD_NODE_TLS)",
    )
    parser.add_argument(
        "--redis",
        dest="redis_url",
        default=None,
        help="fleet store to register in: redis://host:6379/0, redis+sentinel://host:26379,"
        ".../service or redis+cluster://host:6379,... (password: $EDGECLOUD_REDIS_PASSWORD)",
    )
    parser.add_argument(
        "--node-token",
        default=None,
        help=f"token requests must carry (X-Edgecloud-Node-Token); prefer ${NODE_TOKEN_ENV}, "
        "which keeps it out of the process list",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve a non-loopback host without a node token (trusted networks only)",
    )
    parser.add_argument(
        "--watts",
        type=watts,
        default=None,
        metavar="IDLE:LOAD",
        help="this machine's watts idle and under load, e.g. 4:15, where RAPL is unreadable",
    )
    add_drain_timeout(parser)


def add_drain_timeout(parser: argparse.ArgumentParser) -> None:
    d = ServerLimits().drain_timeout_s
    parser.add_argument(
        "--drain-timeout",
        type=nonneg_float,
        default=d,
        help=f"seconds in-flight requests may take to finish on SIGTERM/Ctrl-C (default {d:g})",
    )


def drain_limits(args: argparse.Namespace) -> ServerLimits:
    """The server limits of a command that offers only ``--drain-timeout``."""
    return ServerLimits(drain_timeout_s=args.drain_timeout)


def node_token_from_args(args: argparse.Namespace, prog: str) -> str | None:
    """The node token (flag, else environment), checked; exits with status 2 (and a message)
    when it is weak, or when the node would listen beyond loopback without one and without
    ``--insecure-no-auth``."""
    from gateway.secret_strength import check_node_token

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


def node_tls_from_env(prog: str) -> TLSFolder | None:
    """The node's TLS folder from ``$EDGECLOUD_NODE_TLS`` (None: unset, plain HTTP), checked;
    exits with status 2 (and a message naming the file) when it cannot be served with.

    An environment variable, not a flag: ``edge serve`` and ``cloud serve`` are at their flag
    budget, and the folder is set once per machine (systemd's environment file, a container's
    env), like the node token beside it."""
    from gateway.tls_folder import NODE_TLS_ENV, TLSFolderError, load_tls_folder

    folder = os.environ.get(NODE_TLS_ENV)
    if not folder:
        return None
    try:
        return load_tls_folder(folder, server=True)
    except TLSFolderError as exc:
        print(f"{prog}: error: ${NODE_TLS_ENV}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def check_redis_args(args: argparse.Namespace, prog: str) -> None:
    """Exit with status 2 (and a message) when ``--redis`` names no Redis deployment (see
    :mod:`routing.redis_connect`)."""
    if not args.redis_url:
        return
    from routing.redis_connect import parse_redis_url

    try:
        parse_redis_url(args.redis_url)
    except ValueError as exc:
        print(f"{prog}: error: --redis: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
