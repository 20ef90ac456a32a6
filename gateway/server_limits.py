"""Limits every HTTP server the project starts runs under, and the flags that set them.

Standard library only (the ``edgecloud`` parser imports it); the server that enforces them is
``gateway.http_server``.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# File descriptors kept for everything but client connections (model files, logs, pipes,
# the gateway's pooled connections to its nodes grow with its clients: hence the halving).
_RESERVED_FDS = 64
_MAX_DEFAULT_CONNECTIONS = 16384


@dataclass(frozen=True)
class ServerLimits:
    """How long a client may take, how many may connect, how a stop drains.

    * ``header_timeout_s``: a request's headers must be complete this long after the
      connection opened (its first request) or after the request's first byte (later ones on a
      kept-alive connection); otherwise 408 (or a silent close if it sent nothing) and close.
    * ``body_timeout_s``: the longest pause between two pieces of a request body (a stall,
      not a total: a slow but moving upload is fine); otherwise 408 if no response has
      started, and close.
    * ``body_deadline_s``: the longest a whole request body may take from its headers on
      (a total, beside the stall timeout: a body trickled a byte at a time is cut here).
    * ``keep_alive_s``: an idle kept-alive connection is closed after this.
    * ``max_connections``: open client connections; one more is answered 503 and closed at
      once. None: half the open-file limit less a reserve (see :func:`default_max_connections`).
    * ``drain_timeout_s``: on SIGTERM/SIGINT, how long in-flight requests may run to completion
      (no new connections are accepted meanwhile); what is left is then cancelled.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    body_deadline_s: float = 60.0
    keep_alive_s: float = 5.0
    max_connections: int | None = None
    backlog: int = 2048
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "body_deadline_s", "keep_alive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")

    def connection_cap(self) -> int:
        return self.max_connections or default_max_connections()


def raise_open_file_limit(target: int = 65536) -> tuple[int, int]:
    """Raise this process's soft open-file limit towards its hard limit (at most ``target``).

    Returns the (soft, hard) limits in force afterwards; a no-op where ``resource`` is missing.
    """
    try:
        import resource
    except ImportError:  # Windows
        return (0, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.debug("could not raise the open-file limit: %s", exc)
    return soft, hard


def default_max_connections() -> int:
    """Half of (the soft open-file limit less a reserve), at least 8, at most 16384."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except ImportError:
        return 1024
    if soft == resource.RLIM_INFINITY:
        return _MAX_DEFAULT_CONNECTIONS
    return max(8, min(_MAX_DEFAULT_CONNECTIONS, (soft - _RESERVED_FDS) // 2))


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every command that serves HTTP shares (see :class:`ServerLimits`)."""
    d = ServerLimits()
    g = parser.add_argument_group("HTTP server limits")
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout_s,
        help="on SIGTERM/Ctrl-C, seconds in-flight requests may take to finish (default "
        f"{d.drain_timeout_s:g})",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout_s,
        help=f"seconds a client has to send its request headers (default {d.header_timeout_s:g})",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        help=f"seconds a request body may stall between two pieces (default {d.body_timeout_s:g})",
    )
    g.add_argument(
        "--body-deadline",
        type=float,
        default=d.body_deadline_s,
        help="seconds a whole request body may take, however it trickles (default "
        f"{d.body_deadline_s:g})",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open client connections at most (default: from the open-file limit)",
    )


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        body_deadline_s=args.body_deadline,
        max_connections=args.max_connections,
        drain_timeout_s=args.drain_timeout,
    )
