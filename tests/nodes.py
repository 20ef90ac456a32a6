"""Starting real node and gateway processes on loopback for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


class Proc:
    """A child process serving HTTP on ``port``; ``stop()`` sends SIGINT and waits."""

    def __init__(
        self, args: list[str], port: int, log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 300.0, path: str = "/health") -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"process exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"not ready after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", *args]
