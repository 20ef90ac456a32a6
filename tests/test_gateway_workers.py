"""``edgecloud gateway --workers N`` (issue 51, item 1): N real gateway processes on one port in
front of a real node (the tiny model on a CPU cloud node), over real HTTP on loopback.

- Both workers answer on the one port, each seeing the node.
- A key's request limit holds exactly across workers, through the private redis-server the
  parent starts and through the operator's Redis (the session's private server).
- Rows in flight are shared: every worker counts the streams any worker has open.
- SIGTERM to the parent drains the streams of every worker; it exits 0.
- A wrong ``--workers`` is a usage error (exit 2) naming the flag.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.auth import generate_key, hash_key
from gateway.cli import main as cli_main
from tests.conftest import free_port
from tests.nodes import Proc, cli


@pytest.fixture(scope="module")
def node(tiny_model_path: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model on a CPU cloud node, registered in the session's Redis too."""
    port = free_port()
    args = cli(
        "cloud", "serve", "--model", str(tiny_model_path), "--port", str(port),
        "--region", "local", "--node-id", "cloud-w", "--device", "cpu", "--threads", "1",
        "--redis", redis_url,
    )  # fmt: skip
    p = Proc(args, port, tmp_path_factory.mktemp("node") / "node.log").wait_ready(240)
    p.model = tiny_model_path.name  # type: ignore[attr-defined]
    yield p
    p.stop()


def _pool(folder: Path, cfg: dict, workers: int = 2, *extra: str) -> Proc:
    port = free_port()
    path = folder / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = cli("gateway", "--config", str(path), "--port", str(port), "--workers", str(workers))
    p = Proc([*args, *extra], port, folder / "gateway.log")
    deadline = time.monotonic() + 60
    while "gateway workers listening" not in p.log.read_text():
        if p.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"pool did not start:\n{p.tail()}")
        time.sleep(0.1)
    return p


# a new connection for every request (the kernel picks a worker per connection)
FRESH = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30)


def _worker_of(url: str, path: str = "/admin/nodes") -> tuple[int, dict]:
    """One request on a new connection: (the pid of the worker that answered, its body)."""
    body = FRESH.get(url + path).json()
    return body["worker"]["pid"], body


def _each_worker(url: str, workers: int, path: str = "/admin/nodes") -> dict[int, dict]:
    """A body from every worker (new connections until each has answered)."""
    seen: dict[int, dict] = {}
    for _ in range(200):
        pid, body = _worker_of(url, path)
        seen[pid] = body
        if len(seen) == workers:
            return seen
    raise AssertionError(f"only workers {sorted(seen)} answered")


def _config(node: Proc) -> dict:
    """The node polled by each worker; no redis_url: the parent's private redis-server."""
    return {"nodes": [node.url], "virtual_models": {"auto": node.model}}  # type: ignore[attr-defined]


def _stream(
    url: str, max_tokens: int, started: threading.Event, out: list, leave: threading.Event
) -> None:
    body = {"model": "auto", "prompt": "Once", "max_tokens": max_tokens, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()
            if leave.is_set():  # the client goes away mid-stream
                break
    out.append(lines)


def _open_stream(
    url: str, max_tokens: int, out: list, leave: threading.Event | None = None
) -> threading.Thread:
    """A stream in a thread, once its first event has arrived; its lines go to ``out``; it
    is left unread once ``leave`` is set."""
    started = threading.Event()
    args = (url, max_tokens, started, out, leave or threading.Event())
    t = threading.Thread(target=_stream, args=args)
    t.start()
    assert started.wait(60), "a stream did not start"
    return t


@pytest.fixture(scope="module")
def pool(node: Proc, redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    """Two workers in front of the node, sharing the operator's Redis (the session's)."""
    cfg = {"redis_url": redis_url, "virtual_models": {"auto": node.model}}  # type: ignore[attr-defined]
    p = _pool(tmp_path_factory.mktemp("pool"), cfg)
    deadline = time.monotonic() + 15
    while not all(b["nodes"] for b in _each_worker(p.url, 2).values()):
        assert time.monotonic() < deadline, "the workers do not see the node in Redis"
        time.sleep(0.2)
    yield p
    assert p.stop(signal.SIGTERM) == 0, p.tail()


def test_two_workers_serve_one_port(pool: Proc) -> None:
    views = _each_worker(pool.url, 2)
    for body in views.values():
        assert [n["id"] for n in body["nodes"]] == ["cloud-w"]
        assert body["worker"]["of"] == 2
    assert sorted(b["worker"]["index"] for b in views.values()) == [0, 1]
    for _ in range(4):
        r = FRESH.post(
            pool.url + "/v1/completions", json={"model": "auto", "prompt": "Hi", "max_tokens": 3}
        )
        assert r.status_code == 200 and r.headers["x-edgecloud-node"] == "cloud-w"


LIMIT = 5  # requests per minute of the key the bare pool knows
KEY = generate_key()


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory):
    """Two workers with one API key (LIMIT requests a minute) and no node, sharing their
    parent's private redis-server; the last test to use it kills a worker."""
    salt = secrets.token_urlsafe(32)
    key = {"name": "k", "key_hash": hash_key(KEY, salt), "rpm": LIMIT}
    p = _pool(tmp_path_factory.mktemp("bare"), {"auth": {"salt": salt, "keys": [key]}})
    yield p
    p.stop(signal.SIGTERM)


def test_a_key_limit_is_exact_across_workers(bare: Proc) -> None:
    codes = []
    for _ in range(4 * LIMIT):  # a new connection each: spread over both workers
        r = FRESH.post(
            bare.url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={"model": "auto", "messages": [{"role": "user", "content": "x"}]},
        )
        codes.append(r.status_code)
    assert codes.count(429) == 3 * LIMIT, codes
    assert set(codes[:LIMIT]) == {503}, codes  # admitted, then no node to route to
    assert len(_each_worker(bare.url, 2, "/health")) == 2  # both were there to admit


def test_in_flight_rows_are_shared(pool: Proc) -> None:
    p = pool
    threads: list[threading.Thread] = []
    leave = threading.Event()
    try:
        threads = [_open_stream(p.url, 1500, [], leave) for _ in range(4)]
        deadline = time.monotonic() + 10
        while True:
            views = _each_worker(p.url, 2)
            counts = {pid: body["in_flight"]["cloud-w"] for pid, body in views.items()}
            totals = {pid: c["here"] + c["other_workers"] for pid, c in counts.items()}
            if set(totals.values()) == {4} or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert set(totals.values()) == {4}, counts  # each worker sees all four streams
        assert sum(c["here"] for c in counts.values()) == 4, counts
    finally:
        leave.set()
        for t in threads:
            t.join(60)


@pytest.fixture(scope="module")
def polled(node: Proc, tmp_path_factory: pytest.TempPathFactory):
    """Two workers polling the node themselves, rarely (every 120 s), sharing the private
    redis-server of their parent; a test may stop it."""
    cfg = {**_config(node), "poll_interval_s": 120}
    p = _pool(tmp_path_factory.mktemp("polled"), cfg, 2, "--drain-timeout", "60")
    yield p
    p.stop(signal.SIGTERM)


SYSTEM = " ".join(f"Rule {i}: answer politely and precisely." for i in range(40))  # ~300 tokens


def test_a_prefix_one_worker_sent_is_credited_by_every_worker(polled: Proc) -> None:
    def chat(user: str, **kw) -> dict:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        return {"model": "auto", "messages": messages, "max_tokens": 4, **kw}

    r = FRESH.post(polled.url + "/v1/chat/completions", json=chat("First?", temperature=0))
    assert r.status_code == 200, r.text
    # each on a new connection (the kernel spreads them over both workers); no worker polls
    # the node within 120 s, so one that did not send the request knows it from the board
    credited: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (len(credited) >= 10 and min(credited[-10:])):
        route = FRESH.post(polled.url + "/v1/route", json=chat("Another")).json()
        credited.append(route["cached_tokens"] >= 256)
    assert len(credited) >= 10 and all(credited[-10:]), credited


def test_sigterm_drains_the_streams_of_every_worker(polled: Proc) -> None:
    p = polled
    threads: list[threading.Thread] = []
    out: list[list[str]] = []
    for _ in range(12):  # until both workers hold a stream (each lasts a few seconds)
        threads.append(_open_stream(p.url, 200, out))
        views = _each_worker(p.url, 2)
        if all(b["in_flight"]["cloud-w"]["here"] for b in views.values()):
            break
    p.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert p.proc.wait(90) == 0, p.tail()
    log = p.log.read_text()
    drained = re.findall(r"stopped gateway worker \d \(pid \d+\) in [\d.]+ s \((.*)\)", log)
    assert len(drained) == 2, log
    # every worker had streams in flight at the signal, and let them all finish
    assert all(re.fullmatch(r"\d+ request\(s\) in flight, all finished", d) for d in drained)
    assert len(out) == len(threads)
    for lines in out:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert all("error" not in json.loads(x[6:]) for x in lines[:-1]), lines[-3:]


@pytest.mark.parametrize("command", ["gateway", "serve"])
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_a_wrong_workers_value_is_a_usage_error(
    command: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main([command, f"--workers={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --workers:" in err and "at least 1" in err, err


def test_a_worker_that_dies_stops_the_gateway_with_exit_1(bare: Proc) -> None:
    victim, survivor = sorted(_each_worker(bare.url, 2, "/health"))
    os.kill(victim, signal.SIGKILL)
    assert bare.proc.wait(60) == 1, bare.tail()
    log = bare.log.read_text()
    assert re.search(
        rf"gateway worker \d \(pid {victim}\) exited unexpectedly \(signal SIGKILL\)", log
    )
    assert re.search(rf"stopped gateway worker \d \(pid {survivor}\) in", log), log
