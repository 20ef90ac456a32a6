"""Header and body read timeouts, the connection cap and quiet disconnects, over real sockets.

One real ``edgecloud gateway`` process (no nodes: every path tested here ends before routing)
with 1 s timeouts and a cap of 8 connections; raw sockets play the slow or vanishing clients.
"""

from __future__ import annotations

import select
import signal
import socket
import time
from collections.abc import Iterator

import pytest

from tests.conftest import free_port
from tests.nodes import Proc, cli

TIMEOUT_S = 1.0
CAP = 8
CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    logs = tmp_path_factory.mktemp("gw-timeouts")
    cfg = logs / "gw.yaml"
    cfg.write_text("nodes: []\n")
    port = free_port()
    args = cli(
        "gateway",
        "--config",
        str(cfg),
        "--port",
        str(port),
        "--header-timeout",
        str(TIMEOUT_S),
        "--body-timeout",
        str(TIMEOUT_S),
        "--max-connections",
        str(CAP),
    )
    p = Proc(args, port, logs / "gw.log").wait_ready(timeout=60)
    yield p
    t0 = time.monotonic()
    assert p.stop(signal.SIGTERM) == 0, p.tail()  # drains (nothing in flight) and exits 0
    assert time.monotonic() - t0 < 5
    assert "stopped gateway in " in p.log.read_text()


def _connect(p: Proc) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    s.settimeout(5)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


def _read_response(s: socket.socket) -> bytes:
    """One response with a Content-Length body, head and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = s.recv(4096)
        assert chunk, data
        body += chunk
    return head + b"\r\n\r\n" + body


def _log(p: Proc) -> str:
    return p.tail(200_000)


def test_silent_connection_is_closed(gateway: Proc) -> None:
    with _connect(gateway) as s:
        t0 = time.monotonic()
        assert _read_until_closed(s) == b""  # nothing was asked: closed without a response
        took = time.monotonic() - t0
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + 1.0, took


def test_trickled_headers_get_408_at_the_deadline(gateway: Proc) -> None:
    with _connect(gateway) as s:
        t0 = time.monotonic()
        s.sendall(CHAT + b"X-Slow: ")
        # one byte every 0.2 s until the server answers: progress does not extend the deadline
        while not select.select([s], [], [], 0.2)[0] and time.monotonic() - t0 < 5:
            s.sendall(b"z")
        data = _read_until_closed(s)
        took = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b"connection: close" in data.lower()
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + 1.0, took


def test_stalled_body_gets_408(gateway: Proc) -> None:
    with _connect(gateway) as s:
        s.sendall(CHAT + b"Content-Length: 200\r\n\r\n" + b'{"model": "x", ')
        t0 = time.monotonic()
        data = _read_until_closed(s)
        took = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S + 1.0, took


def test_slow_but_moving_body_is_served(gateway: Proc) -> None:
    body = b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}'
    with _connect(gateway) as s:
        s.sendall(CHAT + b"Content-Length: %d\r\n\r\n" % len(body))
        t0 = time.monotonic()
        for i in range(0, len(body), 20):  # 4 pieces, 0.6 s apart: 1.8 s in all, no 1 s stall
            time.sleep(0.6)
            s.sendall(body[i : i + 20])
        head = s.recv(4096)
        took = time.monotonic() - t0
    assert took > 1.5 * TIMEOUT_S
    status = int(head.split(b" ", 2)[1])
    assert status != 408 and 400 <= status < 600, head  # answered (no such model / no node)


def test_kept_alive_connection_may_idle_past_the_header_timeout(gateway: Proc) -> None:
    with _connect(gateway) as s:
        for _ in range(2):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            response = _read_response(s)
            assert response.startswith(b"HTTP/1.1 200 "), response
            time.sleep(1.5 * TIMEOUT_S)  # idle: uvicorn's keep-alive (5 s) applies, not ours


def test_mid_body_disconnect_logs_no_traceback(gateway: Proc) -> None:
    before = len(_log(gateway))
    for _ in range(3):
        with _connect(gateway) as s:
            s.sendall(CHAT + b"Content-Length: 500\r\n\r\n" + b'{"model": "x", "mess')
            time.sleep(0.1)  # the app is now waiting for the rest of the body
    time.sleep(0.3)
    with _connect(gateway) as s:  # the server is still healthy
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert _read_until_closed(s).startswith(b"HTTP/1.1 200 ")
    new = _log(gateway)[before:]
    assert "Traceback" not in new and "Exception in ASGI" not in new, new
    assert "unhandled error" not in new, new


def test_connection_cap_answers_503(gateway: Proc) -> None:
    time.sleep(0.2)  # earlier tests' connections are closed by now
    held = [_connect(gateway) for _ in range(CAP)]
    try:
        time.sleep(0.1)
        with _connect(gateway) as extra:
            data = _read_until_closed(extra)
        assert data.startswith(b"HTTP/1.1 503 "), data
        assert b"retry-after: 1" in data.lower()
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    with _connect(gateway) as s:  # below the cap again: served
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert _read_until_closed(s).startswith(b"HTTP/1.1 200 ")


def test_limits_reject_nonsense() -> None:
    from gateway.server_limits import ServerLimits

    with pytest.raises(ValueError):
        ServerLimits(header_timeout_s=0)
    with pytest.raises(ValueError):
        ServerLimits(max_connections=0)
    assert ServerLimits(max_connections=5).connection_cap() == 5
    assert ServerLimits().connection_cap() >= 8
