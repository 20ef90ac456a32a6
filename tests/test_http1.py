"""The gateway's HTTP/1.1 client (gateway.front.http1_pool, http1_connection, http1_response) and
the node client's transports (gateway.front.node_client) against real servers on loopback.

Most servers here are asyncio sockets scripted byte by byte (:class:`Raw` counts the TCP
connections it accepted); one test runs a uvicorn app. Every failure is checked for the httpx
exception type the module's docstring promises, and the response types are checked against the
typed interface of gateway.front.upstream.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from gateway.front.http1_connection import HIGH_WATER
from gateway.front.http1_pool import H1Pool
from gateway.front.http1_response import H1Headers, H1Response
from gateway.front.node_client import H1Transport, HttpxTransport, make_client
from gateway.front.upstream import (
    ChunkedUpstream,
    StreamedUpstream,
    UpstreamHeaders,
    UpstreamResponse,
    UpstreamTransport,
)
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Raw:
    """A loopback server whose n-th accepted connection runs ``handler(reader, writer, n)``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.accepts = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body) as read by read_request
        self.server: asyncio.Server | None = None
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Raw:
        self.server = await asyncio.start_server(self._on, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.wait_closed()

    def url(self, path: str = "/v1/chat/completions") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _on(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.accepts += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            await self.handler(r, w, self.accepts)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # (cancelled by __aexit__: asyncio's own callback must not see it raised)
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]
            w.close()

    async def read_request(self, r: asyncio.StreamReader) -> tuple[bytes, bytes]:
        head = await r.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await r.readexactly(length)
        self.requests.append((head, body))
        return head, body


def reply(body: bytes = b"ok", status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


async def serve_forever(raw: Raw, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Answer every request on the connection with its own body (kept alive)."""
    while True:
        _, body = await raw.read_request(r)
        w.write(reply(body))
        await w.drain()


@pytest.fixture
async def pool() -> AsyncIterator[H1Pool]:
    p = H1Pool(connect_timeout_s=1.0, read_timeout_s=3.0)
    yield p
    await p.aclose()


async def post(pool: H1Pool, url: str, body: bytes = b"{}", **headers: str) -> H1Response:
    target = pool.target(url)
    assert target is not None
    return await pool.post(target, body, headers)


# ---- the typed interface -----------------------------------------------------------------------


async def test_responses_of_both_transports_satisfy_the_upstream_protocol() -> None:
    """The node client's two transports (its HTTP/1.1 pool for http://, httpx otherwise) send
    the node headers and return responses of the typed interface."""
    raw = Raw(lambda r, w, n: serve_forever(raw, r, w))
    async with raw:
        client = make_client(1.0, 3.0, 4, headers={"authorization": "Bearer node-token"})
        assert isinstance(client.transport, UpstreamTransport)
        assert isinstance(client.transport, H1Transport)  # the one chosen for every node
        try:
            h1 = await client.post(raw.url(), b"a", {"x-extra": "1"})
            assert isinstance(h1, H1Response)
            assert isinstance(h1, ChunkedUpstream) and isinstance(h1, StreamedUpstream)
            assert isinstance(h1.headers, UpstreamHeaders)
            assert await h1.aread() == b"a"
            hx_transport = client.transport.other
            assert isinstance(hx_transport, HttpxTransport)
            hx = await hx_transport.post(raw.url(), b"b", {"accept-encoding": "identity"})
            assert isinstance(hx, httpx.Response)
            assert isinstance(hx, StreamedUpstream) and not isinstance(hx, ChunkedUpstream)
            assert isinstance(hx, UpstreamResponse) and isinstance(hx.headers, UpstreamHeaders)
            assert await hx.aread() == b"b"
            await hx.aclose()
        finally:
            await client.aclose()
        head = raw.requests[0][0].lower()
        assert b"authorization: bearer node-token" in head and b"x-extra: 1" in head, head
        assert b"accept-encoding: identity" in head, head


async def test_urls_the_pool_does_not_take_go_through_httpx() -> None:
    """An https:// URL is not the pool's: httpx's transport connects (to a server that hangs up
    at once, so its TLS handshake fails with httpx's ConnectError)."""

    async def hang_up(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        return None

    raw = Raw(hang_up)
    async with raw:
        client = make_client(1.0, 3.0, 4)
        try:
            with pytest.raises(httpx.ConnectError):
                await client.post(f"https://127.0.0.1:{raw.port}/v1/completions", b"{}", {})
        finally:
            await client.aclose()
        assert raw.accepts == 1


# ---- bodies --------------------------------------------------------------------------------------


async def test_content_length_body_and_the_request_sent(pool: H1Pool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        _, body = await raw.read_request(r)
        w.write(reply(b"echo:" + body, b"201 Created", b"content-type: application/json\r\n"))
        await w.drain()
        await r.read()

    raw = Raw(handler)
    async with raw:
        resp = await post(pool, raw.url("/v1/x?a=1"), b'{"k": 1}', authorization="Bearer t")
        assert resp.status_code == 201
        assert resp.headers["content-type"] == "application/json"
        assert await resp.aread() == b'echo:{"k": 1}'
        assert await resp.aread() == b'echo:{"k": 1}'  # kept
        await resp.aclose()
        head, body = raw.requests[0]
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/x?a=1 HTTP/1.1"
        assert f"host: 127.0.0.1:{raw.port}".encode() in lines
        assert b"authorization: Bearer t" in lines
        assert b"content-length: 8" in lines
        assert body == b'{"k": 1}'


async def test_chunked_body_arrives_chunk_by_chunk_as_sent(pool: H1Pool) -> None:
    sent = [b"data: 1\n\n", b"data: 22\n\n", b"data: [DONE]\n\n"]
    got_one = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            await raw.read_request(r)
            w.write(CHUNKED_HEAD)
            for data in sent:
                got_one.clear()
                w.write(chunk(data))
                await w.drain()
                await got_one.wait()  # the next chunk only once the client read this one
            w.write(b"0\r\n\r\n")
            await w.drain()

    raw = Raw(handler)
    async with raw:
        for use_iter in (False, True):
            resp = await post(pool, raw.url())
            assert resp.status_code == 200
            assert resp.headers.get("transfer-encoding") == "chunked"
            got = []
            if use_iter:
                async for data in resp.aiter_raw():
                    got.append(data)
                    got_one.set()
            else:
                while (data := await resp.read_chunk()) is not None:
                    got.append(data)
                    got_one.set()
                assert await resp.read_chunk() is None
            assert got == sent  # one read per chunk sent: nothing waited for a later one
            await resp.aclose()
        assert raw.accepts == 1


async def test_body_delimited_by_the_connection_end(pool: H1Pool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await raw.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npart one, ")
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(b"part two")
        await w.drain()

    raw = Raw(handler)
    async with raw:
        resp = await post(pool, raw.url())
        assert await resp.aread() == b"part one, part two"
        resp2 = await post(pool, raw.url())  # that connection was not kept
        assert await resp2.aread() == b"part one, part two"
        assert raw.accepts == 2


async def test_aread_decodes_gzip_but_raw_reads_do_not(pool: H1Pool) -> None:
    body = b'{"text": "' + b"x" * 1000 + b'"}'
    packed = gzip.compress(body)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            await raw.read_request(r)
            w.write(reply(packed, extra=b"content-encoding: gzip\r\n"))
            await w.drain()

    raw = Raw(handler)
    async with raw:
        resp = await post(pool, raw.url())
        assert await resp.aread() == body
        resp = await post(pool, raw.url())
        parts = [c async for c in resp.aiter_raw()]
        assert b"".join(parts) == packed
        assert raw.accepts == 1


async def test_interim_100_continue_is_skipped(pool: H1Pool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await raw.read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n" + reply(b"final"))
        await w.drain()
        await r.read()

    raw = Raw(handler)
    async with raw:
        resp = await post(pool, raw.url())
        assert resp.status_code == 200
        assert await resp.aread() == b"final"


# ---- headers -------------------------------------------------------------------------------------


async def test_headers_case_insensitive_and_repeated_ones_merged_as_httpx_does(
    pool: H1Pool,
) -> None:
    extra = (
        b"X-Edgecloud-Cached-Tokens: 12\r\nVary: accept\r\nvary: origin\r\nX-Name: caf\xc3\xa9\r\n"
    )

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await raw.read_request(r)
        w.write(reply(b"{}", extra=extra))
        await w.drain()
        await r.read()

    raw = Raw(handler)
    async with raw:
        resp = await post(pool, raw.url())
        h = resp.headers
        assert h.get("x-edgecloud-cached-tokens") == "12"
        assert h["X-EDGECLOUD-CACHED-TOKENS"] == "12"
        assert "x-Edgecloud-cached-tokens" in h and "missing" not in h and 3 not in h
        assert h.get("vary") == "accept, origin"
        assert h.get("x-name") == "café"  # not ascii: utf-8
        assert h.get("missing") is None and h.get("missing", "d") == "d"
        with pytest.raises(KeyError):
            h["missing"]
        assert dict(h.items()) == {
            "content-length": "2",
            "x-edgecloud-cached-tokens": "12",
            "vary": "accept, origin",
            "x-name": "café",
        }
        hx = httpx.Headers(h.raw)  # the same raw headers read by httpx
        assert dict(hx.items()) == dict(h.items())
        assert len(h) == 4 and set(h) == set(h.keys())
        await resp.aclose()


def test_headers_fall_back_to_latin1_for_the_whole_set() -> None:
    h = H1Headers([(b"X-A", b"plain"), (b"X-B", b"\xe9t\xe9")])  # not utf-8
    assert h.get("x-b") == "été" and h["x-a"] == "plain"
    assert h.get("x-b") == httpx.Headers([(b"X-B", b"\xe9t\xe9")]).get("x-b")


# ---- keep-alive and reconnecting ---------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection(pool: H1Pool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        i = 0
        while True:
            _, body = await raw.read_request(r)
            if i % 2:  # alternate content-length and chunked replies
                w.write(CHUNKED_HEAD + chunk(body) + b"0\r\n\r\n")
            else:
                w.write(reply(body))
            await w.drain()
            i += 1

    raw = Raw(handler)
    async with raw:
        for i in range(6):
            resp = await post(pool, raw.url(), b"req%d" % i)
            assert await resp.aread() == b"req%d" % i
            await resp.aclose()
        assert raw.accepts == 1
        assert len(raw.requests) == 6


async def test_server_closing_after_its_reply_gets_a_new_connection_each_time(
    pool: H1Pool,
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        _, body = await raw.read_request(r)
        w.write(reply(body, extra=b"connection: close\r\n"))
        await w.drain()  # then closed by Raw

    raw = Raw(handler)
    async with raw:
        for i in range(3):
            resp = await post(pool, raw.url(), b"r%d" % i)
            assert await resp.aread() == b"r%d" % i
        assert raw.accepts == 3


async def test_idle_connection_closed_by_the_server_is_not_reused(pool: H1Pool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        _, body = await raw.read_request(r)
        w.write(reply(body))  # kept alive, as far as the headers say ...
        await w.drain()
        await asyncio.sleep(0.02)  # ... but closed while idle

    raw = Raw(handler)
    async with raw:
        resp = await post(pool, raw.url(), b"one")
        assert await resp.aread() == b"one"
        await asyncio.sleep(0.2)  # the close arrives while the connection is idle
        resp = await post(pool, raw.url(), b"two")
        assert await resp.aread() == b"two"
        assert raw.accepts == 2
        assert [body for _, body in raw.requests] == [b"one", b"two"]  # nothing sent twice


async def test_kept_alive_connection_closed_before_any_reply_byte_is_retried_once(
    pool: H1Pool,
) -> None:
    """The race the module promises to cover: the node closed a kept-alive connection just as
    the next request went out on it, and answered nothing: the request is sent once more, on a
    new connection (the node can have done nothing with it)."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            _, body = await raw.read_request(r)
            w.write(reply(body))
            await w.drain()
            await raw.read_request(r)  # the second request: read, then closed unanswered
            return
        await serve_forever(raw, r, w)

    raw = Raw(handler)
    async with raw:
        resp = await post(pool, raw.url(), b"one")
        assert await resp.aread() == b"one"
        resp = await post(pool, raw.url(), b"two")
        assert await resp.aread() == b"two"
        assert raw.accepts == 2
        assert [body for _, body in raw.requests] == [b"one", b"two", b"two"]


async def test_new_connection_closed_before_any_reply_byte_is_not_retried(pool: H1Pool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await raw.read_request(r)  # then closed unanswered

    raw = Raw(handler)
    async with raw:
        with pytest.raises(httpx.RemoteProtocolError):
            await post(pool, raw.url())
        assert raw.accepts == 1


async def test_reused_connection_broken_after_part_of_a_reply_is_not_retried(
    pool: H1Pool,
) -> None:
    """Once the node sent something the request may have done work: no second try."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        _, body = await raw.read_request(r)
        w.write(reply(body))
        await w.drain()
        await raw.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-")  # half a head, then closed
        await w.drain()

    raw = Raw(handler)
    async with raw:
        resp = await post(pool, raw.url(), b"one")
        assert await resp.aread() == b"one"
        with pytest.raises(httpx.RemoteProtocolError):
            await post(pool, raw.url(), b"two")
        assert raw.accepts == 1


async def test_uvicorn_app_streams_and_keeps_the_connection(pool: H1Pool) -> None:
    from tests.nodes import Served

    peers: set[tuple[str, int]] = set()

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        peers.add(tuple(scope["client"]))
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(3):
            await send({"type": "http.response.body", "body": body + b"%d" % i, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b""})

    served = await asyncio.to_thread(Served, app)
    try:
        for n in range(3):
            resp = await post(pool, served.url + "/x", b"n%d:" % n)
            assert resp.headers.get("transfer-encoding") == "chunked"
            parts = [c async for c in resp.aiter_raw()]
            assert b"".join(parts) == b"n%d:0n%d:1n%d:2" % (n, n, n)
            assert len(parts) >= 2  # streamed, not buffered to the end
        assert len(peers) == 1  # one client port: one kept-alive connection
    finally:
        await asyncio.to_thread(served.stop)


# ---- failures --------------------------------------------------------------------------------------


async def test_connect_refused_is_connect_error(pool: H1Pool) -> None:
    with pytest.raises(httpx.ConnectError):
        await post(pool, f"http://127.0.0.1:{free_port()}/x")


async def test_connect_timeout() -> None:
    """A listener whose backlog is full: the kernel drops the SYN, the connect hangs."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    port = lsock.getsockname()[1]
    fill: list[socket.socket] = []
    try:
        for _ in range(8):
            s = socket.socket()
            s.settimeout(0.2)
            fill.append(s)
            try:
                s.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.skip("the kernel accepted every connection: no way to make one hang")
        p = H1Pool(connect_timeout_s=0.2)
        try:
            t = time.monotonic()
            with pytest.raises(httpx.ConnectTimeout):
                await post(p, f"http://127.0.0.1:{port}/x")
            assert time.monotonic() - t < 2.0
            assert p._opening == 0 and not p._open
        finally:
            await p.aclose()
    finally:
        for s in fill:
            s.close()
        lsock.close()


async def test_read_timeout_before_the_head_and_mid_body() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await raw.read_request(r)
        if n == 2:
            w.write(CHUNKED_HEAD + chunk(b"first"))
            await w.drain()
        await asyncio.sleep(5)  # then silent

    raw = Raw(handler)
    p = H1Pool(read_timeout_s=0.3)
    try:
        async with raw:
            t = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                await post(p, raw.url())
            assert 0.25 < time.monotonic() - t < 1.0  # the timeout asked for, not a second more
            resp = await post(p, raw.url())
            assert await resp.read_chunk() == b"first"
            t = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                await resp.read_chunk()
            assert time.monotonic() - t < 1.0
            assert not p._open
    finally:
        await p.aclose()


async def test_no_read_timeout_for_a_slow_reader_nor_just_after_it_resumes() -> None:
    """Reading pauses above HIGH_WATER while the gateway's client is slower than the node; that
    is no silence of the node, and after resuming the node's silence counts from then."""
    burst = HIGH_WATER + 1000  # just over: all of it arrives, reading pauses, nothing pending

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await raw.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (burst + 3))
        w.write(b"x" * burst)
        await w.drain()
        await asyncio.sleep(1.8)  # 0.3 s after the reader resumed
        w.write(b"end")
        await w.drain()
        await r.read()

    raw = Raw(handler)
    p = H1Pool(read_timeout_s=0.6)
    try:
        async with raw:
            resp = await post(p, raw.url())
            await asyncio.sleep(1.5)  # the slow reader: 2.5 timeouts without reading
            conn = resp._conn
            assert conn is not None and conn.paused
            assert resp.buffered >= HIGH_WATER
            body = await resp.aread()
            assert len(body) == burst + 3 and body.endswith(b"end")
    finally:
        await p.aclose()


async def test_server_dying_mid_body_is_read_error(pool: H1Pool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await raw.read_request(r)
        if n == 1:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
        else:
            w.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await w.drain()  # then closed

    raw = Raw(handler)
    async with raw:
        resp = await post(pool, raw.url())
        with pytest.raises(httpx.ReadError):
            await resp.aread()
        resp = await post(pool, raw.url())
        assert await resp.read_chunk() == b"data: 1\n\n"
        with pytest.raises(httpx.ReadError):
            await resp.read_chunk()
        await resp.aclose()
        assert not pool._open and not any(pool._idle.values())


async def test_malformed_reply_is_remote_protocol_error(pool: H1Pool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await raw.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n")
        await w.drain()
        await r.read()

    raw = Raw(handler)
    async with raw:
        with pytest.raises(httpx.RemoteProtocolError):
            await post(pool, raw.url())
        assert not pool._open


async def test_bytes_after_a_complete_reply_drop_the_connection(pool: H1Pool) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            _, body = await raw.read_request(r)
            w.write(reply(body))
            await w.drain()
            if n == 1:
                await asyncio.sleep(0.02)
                w.write(b"HTTP/1.1 200 OK\r\n")  # unasked for: the connection is not trusted

    raw = Raw(handler)
    async with raw:
        resp = await post(pool, raw.url(), b"a")
        assert await resp.aread() == b"a"
        await asyncio.sleep(0.1)
        resp = await post(pool, raw.url(), b"b")
        assert await resp.aread() == b"b"
        assert raw.accepts == 2


# ---- the pool ---------------------------------------------------------------------------------------


def _held_server() -> tuple[Raw, dict[str, object]]:
    """A server that answers each request once ``state['go']`` is set; tracks concurrency."""
    state: dict[str, object] = {"go": asyncio.Event(), "now": 0, "max": 0}

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            _, body = await raw.read_request(r)
            state["now"] = int(state["now"]) + 1  # type: ignore[call-overload]
            state["max"] = max(int(state["max"]), int(state["now"]))  # type: ignore[call-overload]
            await state["go"].wait()  # type: ignore[attr-defined]
            state["now"] = int(state["now"]) - 1  # type: ignore[call-overload]
            w.write(reply(body))
            await w.drain()

    raw = Raw(handler)
    return raw, state


async def test_max_connections_bounds_open_connections_and_callers_wait() -> None:
    raw, state = _held_server()
    p = H1Pool(max_connections=2)

    async def one(i: int) -> bytes:
        resp = await post(p, raw.url(), b"%d" % i)
        return await resp.aread()

    try:
        async with raw:
            tasks = [asyncio.create_task(one(i)) for i in range(6)]
            await asyncio.sleep(0.2)
            assert len(p._open) == 2 and len(p._waiters) == 4
            assert state["now"] == 2
            state["go"].set()  # type: ignore[attr-defined]
            got = await asyncio.wait_for(asyncio.gather(*tasks), 5)
            assert sorted(got) == [b"%d" % i for i in range(6)]
            assert state["max"] == 2
            assert raw.accepts == 2  # the waiters took the freed, kept-alive connections
    finally:
        await p.aclose()


async def test_a_waiter_woken_then_cancelled_hands_the_connection_on() -> None:
    raw, state = _held_server()
    p = H1Pool(max_connections=1)
    try:
        async with raw:
            first = asyncio.create_task(post(p, raw.url(), b"first"))
            await asyncio.sleep(0.05)
            w1 = asyncio.create_task(post(p, raw.url(), b"w1"))
            w2 = asyncio.create_task(post(p, raw.url(), b"w2"))
            await asyncio.sleep(0.05)
            assert len(p._waiters) == 2
            state["go"].set()  # type: ignore[attr-defined]
            resp = await first
            assert await resp.read_chunk() == b"first"
            # the last read releases the connection and wakes w1, which is cancelled at once
            assert await resp.read_chunk() is None
            w1.cancel()
            resp2 = await asyncio.wait_for(w2, 2)  # woken in w1's place, not stranded
            assert await resp2.aread() == b"w2"
            with pytest.raises(asyncio.CancelledError):
                await w1
            assert raw.accepts == 1
    finally:
        await p.aclose()


async def test_an_idle_connection_to_another_node_is_dropped_for_a_waiter() -> None:
    raw_a = Raw(lambda r, w, n: serve_forever(raw_a, r, w))
    raw_b = Raw(lambda r, w, n: serve_forever(raw_b, r, w))
    p = H1Pool(max_connections=1)
    try:
        async with raw_a, raw_b:
            resp = await post(p, raw_a.url(), b"a")
            assert await resp.aread() == b"a"
            resp = await post(p, raw_b.url(), b"b")  # A's idle connection makes room
            assert await resp.aread() == b"b"
            assert len(p._open) == 1 and raw_a.accepts == raw_b.accepts == 1
    finally:
        await p.aclose()


async def test_pool_close_aborts_connections_and_fails_everyone_waiting() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await raw.read_request(r)
        if n == 1:
            w.write(CHUNKED_HEAD + chunk(b"part"))
            await w.drain()
        await r.read()  # never more; returns once the client's side is closed
        closed.append(n)

    closed: list[int] = []
    raw = Raw(handler)
    p = H1Pool(max_connections=2, read_timeout_s=30)
    try:
        async with raw:
            streaming = await post(p, raw.url())
            assert await streaming.read_chunk() == b"part"
            reader = asyncio.create_task(streaming.read_chunk())
            head_pending = asyncio.create_task(post(p, raw.url()))
            waiter = asyncio.create_task(post(p, raw.url()))
            await asyncio.sleep(0.1)
            assert len(p._open) == 2 and len(p._waiters) == 1
            await p.aclose()
            with pytest.raises(httpx.ReadError):
                await asyncio.wait_for(reader, 1)
            with pytest.raises(httpx.ReadError):
                await asyncio.wait_for(head_pending, 1)
            with pytest.raises(httpx.ConnectError):  # not CancelledError: its task was not
                await asyncio.wait_for(waiter, 1)
            with pytest.raises(httpx.ConnectError):
                await post(p, raw.url())
            assert not p._open
            for _ in range(50):
                if len(closed) == 2:
                    break
                await asyncio.sleep(0.02)
            assert sorted(closed) == [1, 2]  # the server saw both connections end
    finally:
        await p.aclose()


async def test_a_reply_read_to_its_end_releases_its_connection(pool: H1Pool) -> None:
    raw = Raw(lambda r, w, n: serve_forever(raw, r, w))
    async with raw:
        resp = await post(pool, raw.url(), b"x")
        assert await resp.aread() == b"x"
        await resp.aclose()
        assert len(pool._open) == 1 and len(pool._idle[("127.0.0.1", raw.port, False)]) == 1


async def test_a_reply_closed_or_dropped_unread_frees_its_connection() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while True:
            _, body = await raw.read_request(r)
            w.write(CHUNKED_HEAD + chunk(body))  # never finished
            await w.drain()

    raw = Raw(handler)
    p = H1Pool(max_connections=1)
    try:
        async with raw:
            resp = await post(p, raw.url(), b"closed")
            assert await resp.read_chunk() == b"closed"
            await resp.aclose()  # early: the connection goes (the node cancels the request)
            assert not p._open
            resp = await post(p, raw.url(), b"dropped")
            assert len(p._open) == 1
            del resp  # dropped unread
            # (the loop's wake-up of this task still holds the future that carried the
            # response until the task next yields)
            await asyncio.sleep(0)
            assert not p._open
            resp = await asyncio.wait_for(post(p, raw.url(), b"third"), 2)
            assert await resp.read_chunk() == b"third"
            assert raw.accepts == 3  # none of those connections was reused
    finally:
        await p.aclose()


async def test_idle_connections_expire() -> None:
    raw = Raw(lambda r, w, n: serve_forever(raw, r, w))
    p = H1Pool(keepalive_expiry=0.1)
    try:
        async with raw:
            resp = await post(p, raw.url(), b"a")
            assert await resp.aread() == b"a"
            resp = await post(p, raw.url(), b"b")
            assert await resp.aread() == b"b"
            assert raw.accepts == 1
            await asyncio.sleep(0.2)
            resp = await post(p, raw.url(), b"c")
            assert await resp.aread() == b"c"
            assert raw.accepts == 2 and len(p._open) == 1
    finally:
        await p.aclose()


def test_target_handles_plain_http_and_https_with_a_context() -> None:
    p = H1Pool()
    t = p.target("http://node.local:8001/v1/completions?x=1")
    assert t is not None and t.key == ("node.local", 8001, False)
    assert t.head == b"POST /v1/completions?x=1 HTTP/1.1\r\nhost: node.local:8001\r\n"
    t = p.target("http://[::1]/")
    assert t is not None and t.key == ("::1", 80, False)
    assert t.head.endswith(b"host: [::1]\r\n")
    assert p.target("https://node.local/x") is None  # no SSL context: not handled here
    tls = H1Pool(ssl_context=ssl.create_default_context())
    t = tls.target("https://node.local/x")
    assert t is not None and t.key == ("node.local", 443, True)
    assert t.head.endswith(b"host: node.local\r\n")
    assert p.target("http://user:pw@node.local/x") is None
    assert p.target("http:///nohost") is None
