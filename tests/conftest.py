"""Shared fixtures: a private redis-server for the session, tiny random models, the default model.

Tests never use the machine's shared Redis on 6379: ``redis_url`` starts a private server on a
free port with persistence off, and stops it at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# the shared data (MaxMind test databases, LLM traces): ``shared/data`` beside the checkout,
# or wherever EDGECLOUD_SHARED_DATA says; tests that need it skip without it
SHARED_DATA = Path(
    os.environ.get("EDGECLOUD_SHARED_DATA")
    or Path(__file__).resolve().parents[2] / "shared" / "data"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A private redis-server process; ``stop``/``start`` keep the same port (for outage tests)."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.exit(
                "redis-server is not installed. Install it with your system packages "
                "(Debian/Ubuntu: sudo apt-get install redis-server), or run ./scripts/test.sh, "
                "which installs it.",
                returncode=3,
            )
        self.exe = exe
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The imported default model (pulled into the user's store once, then reused)."""
    from routing.model_store import DEFAULT_MODEL, ModelNotFound, resolve

    try:
        return resolve(DEFAULT_MODEL).path
    except ModelNotFound:
        from cloud_engine.model.pull import pull

        return pull(DEFAULT_MODEL).path


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path) -> Path:
    """A tiny random Llama (2 layers, GQA) that shares the default model's tokenizer."""
    from cloud_engine.model.loader import save_random_model, tiny_config

    folder = tmp_path_factory.mktemp("tiny-llama")
    cfg = tiny_config(vocab_size=49152, max_position_embeddings=2048, eos_token_id=(2,))
    return save_random_model(folder, cfg, seed=1234, tokenizer_from=default_model_path)


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for a node serving the tiny model: its own edgecloud home, so the ONNX
    export of a model made for this session lands in the session's tmp dir, not in the
    user's cache (the tiny model's folder, hence its identity, is new every session)."""
    return {"EDGECLOUD_HOME": str(tmp_path_factory.mktemp("edgecloud-home"))}


def pytest_configure(config: pytest.Config) -> None:
    # Keep torch and ONNX Runtime from oversubscribing the small CI machine.
    os.environ.setdefault("OMP_NUM_THREADS", "2")


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch's intra-op threads set to ``n`` inside the block, restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """For modules running the tiny model in torch: it is dispatch-bound, so one intra-op thread
    is faster, and far faster on a busy 2-core machine."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def edge_home(tiny_home: dict[str, str]) -> Iterator[None]:
    """The tiny model's ONNX export goes to the session's edgecloud home (for edge engines a
    test builds in this process), not to the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in tiny_home.items():
            mp.setenv(k, v)
        yield
