"""N gateway worker processes on one port, owned by this process (``--workers N``).

How they share the port: this process binds N listening sockets on it, one per worker, in
one ``SO_REUSEPORT`` group (Linux spreads new connections over them by a hash of the
connection's addresses), and hands each worker its own. Workers racing ``accept()`` on one
shared socket (uvicorn's and gunicorn's pre-fork) pile connections onto whichever worker wakes
first; a group spreads them evenly. Binding here, before any worker starts, makes a port in
use an error at once, and no worker ever binds (Linux lets only processes of the same user
join a group; the commands check the port is free first). Where ``SO_REUSEPORT`` does not
exist every worker gets the same socket. Server limits apply per worker (the connection cap
too: N workers hold N times as many connections).

What they share: node states come from the fleet store (each worker polls its configured
nodes itself, or reads the Redis fleet); limits, fair-share counts, stored responses and the
in-flight board (:mod:`routing.fleet.inflight`) go through Redis: the config's ``redis_url``,
else a private redis-server this process starts (:mod:`gateway.workers.private_redis`).

Lifecycles (one owner each):
- This process owns the workers and the private Redis, through two
  :class:`~routing.supervisor.Supervisor` (each child dies with it, however it dies).
- SIGTERM or SIGINT (or :meth:`WorkerPool.request_stop`): every worker gets SIGTERM at once
  and drains its own connections within ``drain_timeout_s``; then the private Redis stops.
- A worker that exits by itself (a crash, an OOM kill) is not restarted: the others are
  drained and stopped, and :meth:`WorkerPool.serve_until_stopped` returns 1, as ``serve``
  does when a node dies. A half-strength gateway is not left running unannounced; the
  process manager (systemd, Kubernetes) restarts the whole gateway.
- Each worker owns its connections: its drain, its streams' last words, its exit line.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from gateway.front.config import GatewayConfig
from gateway.server_limits import ServerLimits
from gateway.workers.private_redis import PrivateRedis, PrivateRedisError, start_private_redis
from gateway.workers.spec import WorkerInfo, WorkerSpec
from gateway.workers.worker import WORKER_FDS_ENV
from routing.supervisor import ChildExit, ChildSpec, Supervisor

READY_TIMEOUT_S = 60.0  # a worker imports the gateway and starts its app well within this
STOP_MARGIN_S = 10.0  # beyond the drain: the app's shutdown, then SIGKILL


def bind_group(host: str, port: int, count: int, backlog: int) -> list[socket.socket]:
    """``count`` listening sockets on ``host:port`` in one ``SO_REUSEPORT`` group (port 0:
    the first one's port), or one socket where the option does not exist."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    reuse_port = hasattr(socket, "SO_REUSEPORT")
    out: list[socket.socket] = []
    try:
        for _ in range(count if reuse_port else 1):
            s = socket.socket(family, socket.SOCK_STREAM)
            out.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host.strip("[]"), port))
            port = s.getsockname()[1]
            s.listen(backlog)
    except BaseException:
        for s in out:
            s.close()
        raise
    return out * count if not reuse_port else out


class WorkerPool:
    """The workers of one gateway (see the module's docstring for the invariants).

    ``on_stop_request(reason)`` is called once, when the stop begins (``serve`` then expects
    its nodes to exit). :meth:`serve_until_stopped` runs once, from the main thread."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        host: str,
        port: int,
        workers: int,
        limits: ServerLimits,
        on_stop_request: Callable[[str], None] | None = None,
    ) -> None:
        if workers < 2:
            raise ValueError("a pool has at least two workers (one is the plain gateway)")
        self.config = config
        self.host, self.port, self.count = host, port, workers
        self.limits = limits
        self._on_stop_request = on_stop_request
        self._stop = threading.Event()
        self._lock = threading.RLock()  # also taken in signal handlers
        self.stop_reason: str | None = None
        self.failed = False  # a worker or the private Redis exited, or never listened
        self.workers = Supervisor(on_unexpected_exit=self._died)
        self.helpers = Supervisor(on_unexpected_exit=self._died)  # the private Redis
        self.redis: PrivateRedis | None = None

    # -- stopping --------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Begin the stop (drain every worker); callable from any thread and from a signal
        handler, any number of times."""
        with self._lock:
            if self.stop_reason is not None:
                return
            self.stop_reason = reason
        self.workers.expect_exits()
        self.helpers.expect_exits()
        if self._on_stop_request is not None:
            self._on_stop_request(reason)
        self._stop.set()

    def _died(self, ended: ChildExit) -> None:  # a supervisor's watcher thread
        self.failed = True
        print(f"edgecloud gateway: error: {ended.describe()}; stopping", file=sys.stderr)
        self.request_stop(f"{ended.name} exited")

    def _on_signal(self, sig: int, _frame: object) -> None:
        self.request_stop(signal.Signals(sig).name)

    # -- running ---------------------------------------------------------------------------------

    def _start_worker(self, index: int, sock: socket.socket) -> int:
        """Start worker ``index`` on ``sock``; returns the read end of its ready pipe."""
        spec_r, spec_w = os.pipe()
        ready_r, ready_w = os.pipe()
        info = WorkerInfo(index, self.count, self.redis.url if self.redis else None)
        spec = WorkerSpec(self.config, self.host, self.port, self.limits, info)
        env = dict(os.environ)
        env[WORKER_FDS_ENV] = f"{sock.fileno()},{spec_r},{ready_w}"
        argv = [sys.executable, "-m", "gateway.workers.worker"]
        try:
            self.workers.start(
                ChildSpec(f"gateway worker {index}", argv, env, (sock.fileno(), spec_r, ready_w))
            )
        finally:
            os.close(spec_r)
            os.close(ready_w)
        with os.fdopen(spec_w, "wb") as pipe:
            pickle.dump(spec, pipe)
        return ready_r

    def _wait_ready(self, pipes: list[int]) -> bool:
        """Until every worker listens (True), or the stop begins or the time is up (False)."""
        pending = set(pipes)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while pending and not self._stop.is_set():
            if time.monotonic() > deadline:
                print(
                    f"edgecloud gateway: error: {len(pending)} worker(s) not listening after "
                    f"{READY_TIMEOUT_S:.0f} s; stopping",
                    file=sys.stderr,
                )
                self.failed = True
                return False
            readable, _, _ = select.select(list(pending), [], [], 0.1)
            for fd in readable:
                os.read(fd, 1)  # b"1" once it listens; b"" if it died (its exit is reported)
                pending.discard(fd)
        return not pending and not self._stop.is_set()

    def serve_until_stopped(self, on_ready: Callable[[], None] | None = None) -> int:
        """Start the workers, serve until a signal, :meth:`request_stop` or a worker's exit,
        stop everything once. Returns 0 after a requested stop, 1 when a worker (or the private
        Redis) exited by itself or never became ready. ``on_ready``: called once every worker
        listens."""
        sockets = bind_group(self.host, self.port, self.count, self.limits.backlog)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        pipes: list[int] = []
        try:
            if not self.config.redis_url:
                self.redis = start_private_redis(self.helpers)
            for index, sock in enumerate(sockets):
                if self._stop.is_set():
                    break
                pipes.append(self._start_worker(index, sock))
            for sock in {id(s): s for s in sockets}.values():
                sock.close()  # the workers hold them now: a worker's exit takes its own away
            if self._wait_ready(pipes) and on_ready is not None:
                on_ready()
            while not self._stop.wait(0.2):
                pass
        finally:
            for s in (signal.SIGINT, signal.SIGTERM):  # stopping is bounded: no second signal
                signal.signal(s, signal.SIG_IGN)
            try:
                self._stop_all(sockets, pipes)
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
        return 1 if self.failed else 0

    def _stop_all(self, sockets: list[socket.socket], pipes: list[int]) -> None:
        """Drain and stop the workers (all at once), then the private Redis; once."""
        self.request_stop(self.stop_reason or "stopped")
        for ended in self.workers.stop(term_timeout_s=self.limits.drain_timeout_s + STOP_MARGIN_S):
            if ended.how == "killed" or (ended.how == "exited" and ended.returncode != 0):
                print(ended.describe(), file=sys.stderr)  # a drained worker has said so itself
        for ended in self.helpers.stop(term_timeout_s=5.0):
            if ended.how == "killed":
                print(ended.describe(), file=sys.stderr)
        if self.redis is not None:
            self.redis.remove_folder()
        for sock in sockets:
            sock.close()
        for fd in pipes:
            with contextlib.suppress(OSError):
                os.close(fd)


def serve_with_workers(
    cfg: GatewayConfig,
    host: str,
    port: int,
    workers: int,
    limits: ServerLimits,
    ready_line: str,
    on_pool: Callable[[WorkerPool], None] | None = None,
    on_stop_request: Callable[[str], None] | None = None,
) -> int:
    """Serve ``cfg`` with ``workers`` processes (:class:`gateway.workers.pool.WorkerPool`)
    until SIGTERM/Ctrl-C or a worker's exit; ``on_pool`` is handed the pool before it starts
    (``serve`` stops it when a node dies). Returns the exit code (1: a worker failed)."""
    pool = WorkerPool(
        cfg, host=host, port=port, workers=workers, limits=limits, on_stop_request=on_stop_request
    )
    if on_pool is not None:
        on_pool(pool)
    try:
        return pool.serve_until_stopped(on_ready=lambda: print(ready_line, file=sys.stderr))
    except PrivateRedisError as exc:
        print(f"edgecloud: error: {exc}", file=sys.stderr)
        return 1
