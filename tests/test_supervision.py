"""Children die with their parent; the supervisor reports a dead child; SIGTERM drains.

Real processes, no mocks. The cheap tests use a small parent script that starts sleeper
children through :class:`routing.supervisor.Supervisor`; one test starts the real
``edgecloud serve`` on the tiny model and SIGTERMs it while a request streams.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.nodes import REPO, cli

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX process semantics")

# Parent and children share one stdout pipe: each line goes out in one write(2) (atomic below
# PIPE_BUF), where print() may split a line into several writes (PYTHONUNBUFFERED) and let
# another process's line land inside it.

# A child that arms its parent binding (as ``edgecloud`` does at start-up), says so, sleeps.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from routing.supervisor import bind_to_parent
    b = bind_to_parent(use_pdeathsig={pdeathsig}, grace_s=1.0)
    os.write(1, f"bound {{b.pdeathsig}} {{b.pipe_fd is not None}}\\n".encode())
    time.sleep({life})
    sys.exit({code})
    """
)

# A parent that starts children through the Supervisor, prints their pids, then waits for one
# to die unexpectedly (exit 1) or for SIGTERM (stop them, exit 0).
PARENT = textwrap.dedent(
    """
    import os, signal, sys, threading
    from routing.supervisor import ChildSpec, Supervisor
    def say(line): os.write(1, (line + "\\n").encode())
    died = threading.Event()
    sup = Supervisor(on_unexpected_exit=lambda e: (say(e.describe()), died.set()))
    signal.signal(signal.SIGTERM, lambda *_: died.set())
    for i, child in enumerate(sys.argv[1:]):
        c = sup.start(ChildSpec(f"child {i}", [sys.executable, "-c", child]))
        say(f"started child {i} pid {c.pid}")
    died.wait()
    for e in sup.stop(term_timeout_s=2.0):
        say(e.describe())
    assert sup.stop() == sup.stop()  # stopped once; later calls return the same result
    sys.exit(1 if sup.unexpected else 0)
    """
)


STARTED = re.compile(r"started child (\d+) pid (\d+)")
STOPPED = re.compile(r"stopped child \d+ \(pid (\d+)\) in [^\n]*\(signal SIGTERM\)")


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its new parent to reap it is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask ps
        out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
        return bool(out.stdout.strip()) and not out.stdout.strip().startswith("Z")


def _wait_gone(pid: int, timeout: float) -> float:
    t0 = time.monotonic()
    while _alive(pid):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"pid {pid} still running after {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def _child(pdeathsig: bool = True, life: float = 60, code: int = 0) -> str:
    return CHILD.format(pdeathsig=pdeathsig, life=life, code=code)


def _start_parent(*children: str) -> tuple[subprocess.Popen[str], list[int]]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, *children],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert parent.stdout is not None
    pids: dict[int, int] = {}
    seen = ""
    while len(pids) < len(children):  # the children's own lines may come first
        line = parent.stdout.readline()
        seen += line
        assert line, f"parent exited before starting its children: {seen!r}"
        for i, pid in STARTED.findall(line):
            pids[int(i)] = int(pid)
    return parent, [pids[i] for i in range(len(children))]


def _wait_bound(pid: int, timeout: float = 10.0) -> None:
    """Until the child has run bind_to_parent (its env no longer names the parent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                f.read()
            threads = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            return
        if len(threads) >= 2:  # the parent-watch thread has started
            return
        time.sleep(0.02)
    raise AssertionError(f"child {pid} never bound to its parent")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("pdeathsig", [True, False], ids=["pdeathsig", "pipe-only"])
def test_sigkilled_parent_takes_its_children_along(pdeathsig: bool) -> None:
    parent, pids = _start_parent(_child(pdeathsig), _child(pdeathsig))
    for pid in pids:
        _wait_bound(pid)
        assert _alive(pid)
    parent.kill()
    parent.wait()
    # The parent-death signal is immediate; the pipe's reader sees EOF at once too.
    gone = [_wait_gone(pid, timeout=5.0) for pid in pids]
    assert max(gone) < 2.0, gone


def test_child_dying_is_reported_and_the_rest_are_stopped() -> None:
    t0 = time.monotonic()
    parent, (sleeper, quitter) = _start_parent(_child(), _child(life=0.5, code=7))
    out, _ = parent.communicate(timeout=20)
    assert parent.returncode == 1, out
    assert out.count(f"child 1 (pid {quitter}) exited unexpectedly (exit code 7)") == 2, out
    # the sleeper has no SIGTERM handler: the supervisor's SIGTERM ends it
    assert f"stopped child 0 (pid {sleeper}) in " in out and "(signal SIGTERM)" in out, out
    assert not _alive(sleeper)
    assert time.monotonic() - t0 < 10


def test_sigterm_stops_children_once() -> None:
    parent, pids = _start_parent(_child(), _child())
    for pid in pids:
        _wait_bound(pid)
    parent.send_signal(signal.SIGTERM)
    out, _ = parent.communicate(timeout=20)
    assert parent.returncode == 0, out
    # each child stopped exactly once, by SIGTERM, and none reported as an unexpected exit
    stopped = sorted(int(pid) for pid in STOPPED.findall(out))
    assert stopped == sorted(pids), out
    assert "unexpectedly" not in out, out
    for pid in pids:
        assert not _alive(pid)


# --- the real ``edgecloud serve`` ------------------------------------------------------------


@pytest.fixture
def serve_proc(tiny_model_path: Path, tiny_home: dict[str, str], tmp_path: Path):
    port = free_port()
    edge_port, cloud_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        p = subprocess.Popen(
            cli(
                "serve",
                "--model",
                str(tiny_model_path),
                "--port",
                str(port),
                "--edge-port",
                str(edge_port),
                "--cloud-port",
                str(cloud_port),
                "--edge-variant",
                "fp32",
                "--edge-threads",
                "1",
                "--cloud-threads",
                "1",
                "--cloud-device",
                "cpu",
                "--drain-timeout",
                "20",
            ),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **tiny_home},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert p.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/v1/models", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield p, url, log
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_serve_sigterm_drains_the_request_then_stops_the_nodes(serve_proc) -> None:
    p, url, log = serve_proc
    body = {"model": "auto", "prompt": "hello", "max_tokens": 300, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: ")
        p.send_signal(signal.SIGTERM)
        t_signal = time.monotonic()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    finish = [json.loads(x[6:])["choices"] for x in rest[:-1] if x.startswith("data: {")]
    assert any(c and c[0].get("finish_reason") for c in finish), rest[-3:]
    assert p.wait(timeout=30) == 0, log.read_text()
    took = time.monotonic() - t_signal
    text = log.read_text()
    assert "stopped gateway in " in text and "1 request(s) in flight, all finished" in text, text
    pids = {}
    for line in text.splitlines():
        for name in ("edge node", "cloud node"):
            if line.startswith(f"stopped {name} (pid "):
                pids[name] = int(line.split("(pid ")[1].split(")")[0])
                assert line.endswith("(exit code 0)"), line  # the node drained and exited 0
    assert set(pids) == {"edge node", "cloud node"}, text
    for pid in pids.values():
        assert not _alive(pid)
    assert "Traceback" not in text, text
    assert took < 20, took


def test_serve_stops_with_an_error_when_a_node_dies(serve_proc) -> None:
    p, _url, log = serve_proc
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(p.pid)], capture_output=True, text=True
    ).stdout
    nodes = {
        kind: int(line.split()[0])
        for line in out.splitlines()
        for kind in ("edge", "cloud")
        if f"gateway.cli {kind} serve" in line
    }
    assert set(nodes) == {"edge", "cloud"}, out
    os.kill(nodes["edge"], signal.SIGKILL)
    t0 = time.monotonic()
    assert p.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 15
    text = log.read_text()
    assert f"error: edge node (pid {nodes['edge']}) exited unexpectedly (signal SIGKILL)" in text
    assert f"stopped cloud node (pid {nodes['cloud']}) in " in text, text
    assert not _alive(nodes["cloud"])
