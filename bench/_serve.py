"""Start the embedded default (``edgecloud serve``) for a benchmark and stop it afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port_block(n: int = 3) -> int:
    """A port ``p`` with ``p .. p + n - 1`` free now (``serve`` takes port, port+1, port+2)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p + n >= 65535:
            continue
        ok = True
        for q in range(p + 1, p + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise RuntimeError("no block of free ports")


@contextlib.contextmanager
def embedded_default(
    extra: list[str] | None = None, log_path: Path | None = None, timeout_s: float = 240.0
) -> Iterator[str]:
    """``edgecloud serve`` on free ports, with its cloud node (on the CPU where no CUDA device
    is visible) unless ``extra`` names ``--cloud-device``: these benchmarks study the two tiers,
    and ``serve`` alone runs the edge node alone without a GPU; yields the gateway's base URL
    once its nodes are in its view. Stops the whole process group on exit. Its output goes to ``log_path``, else to
    a temporary file whose last lines a failed start-up raises with."""
    # A benchmark stopped by SIGTERM (``timeout``) must still stop its fleet: let the signal
    # unwind through the ``finally`` below instead of ending the process on the spot.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    port = free_port_block()
    exe = Path(sys.executable).with_name("edgecloud")
    # without the console script (the package on PYTHONPATH, not installed): the module
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "gateway.cli"]
    from gateway.commands.serve import cuda_visible

    extra = list(extra or [])
    if "--cloud-device" not in extra:
        extra += ["--cloud-device", "cuda" if cuda_visible() else "cpu"]
    device = extra[extra.index("--cloud-device") + 1]
    want = 1 if device == "off" or (device == "auto" and not cuda_visible()) else 2
    cmd = [*launcher, "serve", "--port", str(port), *extra]
    out = open(log_path, "wb") if log_path else tempfile.TemporaryFile()  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"edgecloud serve exited with {proc.returncode}: {_tail(out, log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError, ValueError):
                nodes = httpx.get(base + "/admin/nodes", timeout=2.0).json().get("nodes", [])
                if len(nodes) >= want:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("edgecloud serve did not come up")
            time.sleep(0.5)
        yield base
    finally:
        stop_group(proc)
        out.close()
        signal.signal(signal.SIGTERM, previous)


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``proc``'s process group: SIGTERM, then SIGKILL after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(out: object, log_path: Path | None, n: int = 2000) -> str:
    """The last ``n`` characters the server wrote (to ``log_path`` or the temporary file)."""
    try:
        if log_path is not None:
            data = log_path.read_bytes()
        else:
            out.seek(0)  # type: ignore[attr-defined]
            data = out.read()  # type: ignore[attr-defined]
    except OSError as e:
        return f"(its output could not be read: {e})"
    return data[-n:].decode(errors="replace")
