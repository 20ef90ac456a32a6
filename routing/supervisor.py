"""Child processes bound to their parent's life: started, watched and stopped by one owner.

Invariants:

* A child started by :class:`Supervisor` never outlives this process. Two mechanisms, both
  armed by :func:`bind_to_parent` in the child at start-up (``edgecloud`` calls it first thing):
  on Linux the parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``), and everywhere a
  pipe whose only write end lives in the parent, read by a thread in the child: it reads EOF
  when the parent dies, however it dies (SIGKILL included). Either sends the child SIGTERM
  (it drains and exits) and, :data:`ORPHAN_GRACE_S` later, the pipe thread ends the child
  outright. A parent that died before the child could arm the signal is caught by comparing
  ``os.getppid()`` with the pid the parent passed down.
* The parent-death signal follows the *thread* that forked the child: :meth:`Supervisor.start`
  must be called from a thread that lives as long as the process (the main thread).
* Each child is stopped exactly once, by :meth:`Supervisor.stop` (idempotent: later calls
  return the first call's result): SIGTERM to all, a deadline, then SIGKILL to any left.
* A child that exits while the supervisor is not stopping is an *unexpected exit*: reported
  once, to the ``on_unexpected_exit`` callback, from the watcher thread. After
  :meth:`Supervisor.expect_exits` (the whole service is shutting down, e.g. systemd sent SIGTERM
  to every process of the unit at once) a child's own exit is an ordinary one.
* Children run in their own process group, so a terminal's Ctrl-C reaches the parent only;
  the parent decides the order of shutdown (drain its own server first, then the children).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

log = logging.getLogger(__name__)

PARENT_PID_ENV = "EDGECLOUD_PARENT_PID"
PARENT_FD_ENV = "EDGECLOUD_PARENT_FD"
# How long an orphaned child may drain after SIGTERM before it is ended outright.
ORPHAN_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------------------------
# The child's side


@dataclass(frozen=True)
class ParentBinding:
    """How this process is tied to its parent (what :func:`bind_to_parent` armed)."""

    parent_pid: int
    pdeathsig: bool  # Linux parent-death signal armed
    pipe_fd: int | None  # the pipe watched by a thread, if the parent passed one


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread exits; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's symbols, libc's among them
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
            return False
    except (OSError, AttributeError) as exc:
        log.warning("prctl unavailable: %s", exc)
        return False
    return True


def _orphaned(grace_s: float) -> None:
    """The parent is gone: SIGTERM ourselves (drain), then end outright after ``grace_s``."""
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(70)  # EX_SOFTWARE: still running long after the parent died


def _watch_pipe(fd: int, grace_s: float) -> None:
    try:
        while os.read(fd, 1):  # the parent never writes; b"" is EOF: its write end closed
            pass
    except OSError:
        pass
    _orphaned(grace_s)


def bind_to_parent(
    environ: MutableMapping[str, str] | None = None,
    *,
    use_pdeathsig: bool = True,
    grace_s: float = ORPHAN_GRACE_S,
) -> ParentBinding | None:
    """In a child started by :class:`Supervisor`: arm the ways it dies with its parent.

    Reads (and removes, so grandchildren do not inherit them) :data:`PARENT_PID_ENV` and
    :data:`PARENT_FD_ENV`; returns None, doing nothing, in a process not started that way.
    Call it early, before any long start-up work, and from the main thread.
    """
    env = os.environ if environ is None else environ
    pid_text = env.pop(PARENT_PID_ENV, None)
    fd_text = env.pop(PARENT_FD_ENV, None)
    if pid_text is None:
        return None
    parent = int(pid_text)
    armed = use_pdeathsig and set_parent_death_signal(signal.SIGTERM)
    fd = int(fd_text) if fd_text else None
    if fd is not None:
        threading.Thread(
            target=_watch_pipe, args=(fd, grace_s), name="parent-watch", daemon=True
        ).start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        log.warning("parent %d is gone; exiting", parent)
        threading.Thread(target=_orphaned, args=(grace_s,), name="orphaned", daemon=True).start()
    return ParentBinding(parent, armed, fd)


# ---------------------------------------------------------------------------------------------
# The parent's side


@dataclass(frozen=True)
class ChildSpec:
    """What to run: ``argv`` with ``env`` (None: this process's environment), inheriting
    ``pass_fds`` (a listening socket, a pipe) beside the standard streams."""

    name: str  # for messages: "edge node"
    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    pass_fds: tuple[int, ...] = ()


@dataclass(frozen=True)
class ChildExit:
    """How a child ended. ``how``: ``exited`` by itself (before or after SIGTERM), ``killed``
    (SIGKILL after the deadline). ``seconds``: from the stop request (or, for an unexpected
    exit, from the child's start) to when its exit was seen."""

    name: str
    pid: int
    returncode: int
    how: Literal["unexpected", "exited", "killed"]
    seconds: float

    def describe(self) -> str:
        rc = self.returncode
        if rc >= 0:
            code = f"exit code {rc}"
        else:
            try:
                code = f"signal {signal.Signals(-rc).name}"
            except ValueError:
                code = f"signal {-rc}"
        if self.how == "unexpected":
            return f"{self.name} (pid {self.pid}) exited unexpectedly ({code})"
        verb = "killed" if self.how == "killed" else "stopped"
        return f"{verb} {self.name} (pid {self.pid}) in {self.seconds:.1f} s ({code})"


@dataclass
class Child:
    """A started child. Only the supervisor waits on ``proc``."""

    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    started_at: float
    pipe_w: int | None = None  # our end of the parent-death pipe
    exit: ChildExit | None = field(default=None)

    @property
    def pid(self) -> int:
        return self.proc.pid


class Supervisor:
    """Starts children bound to this process, watches them, stops them exactly once.

    ``on_unexpected_exit`` is called (once, from the watcher thread) with the first child that
    exits while the supervisor is not stopping; it must be thread-safe (setting a flag is).
    Use as a context manager, or call :meth:`stop` in a ``finally``.
    """

    def __init__(
        self,
        on_unexpected_exit: Callable[[ChildExit], None] | None = None,
        *,
        poll_interval_s: float = 0.1,
    ) -> None:
        self.children: list[Child] = []
        self._on_unexpected = on_unexpected_exit
        self._poll = poll_interval_s
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._expected = threading.Event()
        self._watcher: threading.Thread | None = None
        self._stopped: list[ChildExit] | None = None
        self.unexpected: ChildExit | None = None

    # -- starting ------------------------------------------------------------------------------

    def start(self, spec: ChildSpec) -> Child:
        """Start ``spec`` as a child bound to this process (see the module's invariants)."""
        if self._stopping.is_set():
            raise RuntimeError("supervisor is stopping")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start children from the main thread (the parent-death signal)")
        env = dict(os.environ if spec.env is None else spec.env)
        env[PARENT_PID_ENV] = str(os.getpid())
        pass_fds: tuple[int, ...] = ()
        r = w = None
        if os.name == "posix":
            r, w = os.pipe()  # both non-inheritable: only the child's copy of r is passed
            env[PARENT_FD_ENV] = str(r)
            pass_fds = (r,)
        try:
            proc = subprocess.Popen(
                list(spec.argv),
                env=env,
                stdin=subprocess.DEVNULL,
                pass_fds=(*pass_fds, *spec.pass_fds),
                process_group=0 if os.name == "posix" else None,
            )
        except BaseException:
            for fd in (r, w):
                if fd is not None:
                    os.close(fd)
            raise
        if r is not None:
            os.close(r)  # the child has its own copy
        child = Child(spec, proc, time.monotonic(), pipe_w=w)
        with self._lock:
            self.children.append(child)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="supervisor", daemon=True)
                self._watcher.start()
        return child

    # -- watching ------------------------------------------------------------------------------

    def expect_exits(self) -> None:
        """From now on a child exiting by itself is not an unexpected exit (thread-safe)."""
        self._expected.set()

    def _watch(self) -> None:
        while not self._stopping.wait(self._poll):
            with self._lock:
                children = list(self.children)
            for child in children:
                if child.exit is not None:
                    continue
                rc = child.proc.poll()
                if rc is None or self._stopping.is_set():
                    continue
                if self._expected.is_set():
                    continue  # stop() will record it
                ended = ChildExit(
                    child.spec.name,
                    child.pid,
                    rc,
                    "unexpected",
                    time.monotonic() - child.started_at,
                )
                child.exit = ended
                if self.unexpected is None:
                    self.unexpected = ended
                    if self._on_unexpected is not None:
                        self._on_unexpected(ended)

    # -- stopping ------------------------------------------------------------------------------

    def stop(self, term_timeout_s: float = 5.0, kill_timeout_s: float = 5.0) -> list[ChildExit]:
        """SIGTERM every child still running, wait up to ``term_timeout_s``, SIGKILL the rest.

        Runs once; later calls return the first call's result. Children that had already
        exited keep their ``unexpected`` record.
        """
        with self._lock:
            if self._stopped is not None:
                return self._stopped
            self._stopping.set()
            children = list(self.children)
        if self._watcher is not None:
            self._watcher.join()
        t0 = time.monotonic()
        for child in children:
            if child.exit is None and child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        self._reap(children, t0, t0 + term_timeout_s, "exited")
        for child in children:
            if child.exit is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
        self._reap(children, t0, time.monotonic() + kill_timeout_s, "killed")
        for child in children:
            if child.pipe_w is not None:
                os.close(child.pipe_w)
                child.pipe_w = None
        result = [c.exit for c in children if c.exit is not None]
        with self._lock:
            self._stopped = result
        return result

    @staticmethod
    def _reap(
        children: list[Child], t0: float, deadline: float, how: Literal["exited", "killed"]
    ) -> None:
        while True:
            pending = [c for c in children if c.exit is None]
            for child in pending:
                rc = child.proc.poll()
                if rc is not None:
                    child.exit = ChildExit(
                        child.spec.name, child.pid, rc, how, time.monotonic() - t0
                    )
            if all(c.exit is not None for c in children) or time.monotonic() >= deadline:
                return
            time.sleep(0.02)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
