"""One gateway worker: ``python -m gateway.workers.worker``, started by
:class:`gateway.workers.pool.WorkerPool`, never by hand.

It inherits three file descriptors, named in ``$EDGECLOUD_WORKER_FDS``: its listening socket,
a pipe it reads its :class:`~gateway.workers.spec.WorkerSpec` from, and a pipe it writes one
byte to once it listens. It serves the gateway on that socket until SIGTERM (its parent's, or
the parent's death: :func:`routing.supervisor.bind_to_parent`), drains its own connections
within the drain timeout, and prints how it stopped. Exit codes: 0 after a drain, 2 for a
configuration its app refuses (a bad geo database), 3 when the app fails to start (uvicorn's).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys

WORKER_FDS_ENV = "EDGECLOUD_WORKER_FDS"


def _configure_logging() -> None:
    from routing.progress import VERBOSE_ENV

    verbose = os.environ.get(VERBOSE_ENV) == "1"
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:  # one line per node poll is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)


def main() -> int:
    from routing.supervisor import bind_to_parent

    bind_to_parent()
    _configure_logging()
    sock_fd, spec_fd, ready_fd = (int(x) for x in os.environ.pop(WORKER_FDS_ENV).split(","))
    with os.fdopen(spec_fd, "rb") as pipe:
        spec = pickle.load(pipe)  # from our parent only: the pipe's write end is its alone

    from gateway.front.app import create_gateway_app
    from gateway.geo import GeoDatabaseError
    from gateway.http_server import DrainingServer
    from gateway.workers.spec import WorkerSpec

    assert isinstance(spec, WorkerSpec)
    name = f"gateway worker {spec.info.index} (pid {os.getpid()})"
    ready = os.fdopen(ready_fd, "wb", buffering=0)

    def started() -> None:
        ready.write(b"1")
        ready.close()

    try:
        app = create_gateway_app(spec.config, worker=spec.info)
    except GeoDatabaseError as exc:
        print(f"edgecloud {name}: error: {exc}", file=sys.stderr)
        return 2
    server = DrainingServer(
        app,
        host=spec.host,
        port=spec.port,
        limits=spec.limits,
        proxy_headers=False,
        on_started=started,
    )
    result = server.serve_until_stopped(sockets=[socket.socket(fileno=sock_fd)])
    if not server.started:
        print(f"edgecloud {name}: error: the gateway app failed to start", file=sys.stderr)
        return 3
    print(result.describe(name), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
