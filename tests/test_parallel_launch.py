"""``edgecloud cloud serve --tp/--pp``: rank processes started by the node, answers like one
process through the openai SDK, NodeState reporting tp/pp/devices, and a dead rank taking
the whole node down (every PID gone) within 10 s."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.nodes import Proc, cli


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> float:
    t0 = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"still alive after {timeout}s: {[p for p in pids if alive(p)]}")
        time.sleep(0.05)
    return time.monotonic() - t0


def node(model: str, logs: Path, name: str, *extra: str) -> Proc:
    port = free_port()
    args = cli("cloud", "serve", "--model", model, "--port", str(port), "--device", "cpu")
    args += ["--threads", "1", "--kv-budget-mb", "32", "--node-id", name, *extra]
    return Proc(args, port, logs / f"{name}.log").wait_ready()


def ask(p: Proc, model: str) -> str:
    client = openai.OpenAI(base_url=p.url + "/v1", api_key="none")
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    return r.choices[0].message.content or ""


def test_sigkill_of_one_rank_takes_the_node_down(tiny_model_path: Path, tmp_path: Path) -> None:
    p = node(str(tiny_model_path), tmp_path, "tp2-kill", "--tp", "2")
    state = httpx.get(p.url + "/load").json()
    assert (state["tp"], state["pp"], state["devices"]) == (2, 1, ["cpu", "cpu"])
    ranks = children(p.proc.pid)
    assert len(ranks) == 1
    os.kill(ranks[0], signal.SIGKILL)
    took = wait_gone([p.proc.pid, *ranks], timeout=10.0)
    p.proc.wait(timeout=1)
    with pytest.raises(httpx.HTTPError):
        httpx.get(p.url + "/health", timeout=1.0)
    assert p.proc.returncode == 75, p.tail()
    assert took < 10.0


@pytest.mark.slow  # two default-model nodes: about a minute on the shared 2-core machine
@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_serve_parallel_answers_like_one_process(
    default_model_path: Path, tmp_path: Path, layout: tuple[str, str]
) -> None:
    model = "smollm2-135m-instruct"
    one = node(model, tmp_path, "one")
    try:
        want = ask(one, model)
    finally:
        one.stop(signal.SIGTERM)
    par = node(model, tmp_path, "par", *layout)
    ranks = children(par.proc.pid)
    assert len(ranks) == 1
    state = httpx.get(par.url + "/load").json()
    assert (state["tp"] * state["pp"], len(state["devices"])) == (2, 2)
    assert ask(par, model) == want
    assert par.stop(signal.SIGTERM) == 0, par.tail()  # SIGTERM stops every rank, cleanly
    wait_gone(ranks, timeout=10.0)


@pytest.mark.slow  # two tiny nodes and torchrun's own start-up: about 40 s on the shared machine
def test_torchrun_world_serves_like_one_process(tiny_model_path: Path, tmp_path: Path) -> None:
    """The same ``edgecloud cloud serve --tp 2`` command under ``torchrun`` on one host: rank 0
    serves the Node API, rank 1 runs the worker loop; SIGTERM to torchrun stops both."""
    import shutil
    import sys

    model = str(tiny_model_path)
    one = node(model, tmp_path, "one")
    try:
        want = ask(one, tiny_model_path.name)
    finally:
        one.stop(signal.SIGTERM)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    port = free_port()
    args = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "gateway.cli"]
    args += ["cloud", "serve", "--model", model, "--port", str(port), "--device", "cpu"]
    args += ["--threads", "1", "--kv-budget-mb", "32", "--tp", "2"]
    p = Proc(args, port, tmp_path / "torchrun.log").wait_ready()
    try:
        ranks = children(p.proc.pid)
        assert len(ranks) == 2
        state = httpx.get(p.url + "/load").json()
        assert (state["tp"], state["pp"]) == (2, 1)
        assert ask(p, tiny_model_path.name) == want
    finally:
        p.stop(signal.SIGTERM, timeout=30.0)
    wait_gone(ranks, timeout=10.0)


def test_the_worker_gets_the_drivers_batch_and_graph_shapes() -> None:
    """Every rank sizes its block tables and captures its decode graphs from the same
    configuration: what the driver's command line set reaches the worker processes."""
    import torch

    from cloud_engine.config import EngineConfig
    from cloud_engine.parallel import worker
    from cloud_engine.parallel.dist import ParallelConfig
    from cloud_engine.parallel.launch import worker_argv

    cfg = EngineConfig(
        device="cuda", dtype=torch.bfloat16, threads=2, kv_memory_bytes=1 << 30,
        max_kv_blocks=900, max_running=48, max_context=2048, max_graph_batch=32,
        cuda_graphs=False, fused_shards=True,
    )  # fmt: skip
    argv = worker_argv("/m", ParallelConfig(2, 1), 1, "tcp://127.0.0.1:1", cfg, 10.0)
    got = worker.config_from_args(worker.parser().parse_args(argv[3:]))
    assert got == cfg
    plain = EngineConfig(device="cpu")
    argv = worker_argv("/m", ParallelConfig(2, 1), 1, "tcp://127.0.0.1:1", plain, 10.0)
    assert worker.config_from_args(worker.parser().parse_args(argv[3:])) == plain
