"""A small HTTP/1.1 client for the gateway's hot path: POST a body to a node, relay the answer.

The gateway sends every request to a node on a kept-alive connection and needs nothing of a
general client (redirects, cookies, auth, proxies, content decoding of streams). This client
speaks just what the gateway needs, on asyncio protocols with the httptools parser (the one
uvicorn uses), over TCP or TLS (asyncio's, with the pool's ``ssl.SSLContext``), as the
transport :mod:`gateway.front.node_client` chooses for nodes, and keeps the contract the
gateway relies on:

- :class:`H1Response` answers the part of ``httpx.Response`` the proxy uses (``status_code``,
  ``headers.get``/``items`` with httpx's header semantics, ``extensions``, ``aread``, ``aiter_raw``,
  ``aclose``); ``aread`` decodes a content-encoding exactly as httpx does.
- Failures are httpx's exception types: ``ConnectError``/``ConnectTimeout`` before the request
  is sent (a TLS handshake that fails, e.g. a certificate not signed by the trusted CA,
  included), ``ReadTimeout`` when the node is silent for the read timeout, ``ReadError`` or
  ``RemoteProtocolError`` when the connection breaks or the reply is malformed.
- A connection goes back to the pool only after its response was read to the end and the node
  keeps it alive; closing a response early closes its connection (the node then cancels the
  request). A kept-alive connection the node closed is never reused; one that dies before any
  byte of the reply is retried once on a new connection. A new connection the node closes
  before the request is written (a node requiring a client certificate the gateway did not
  present closes it right after the TLS handshake) fails the request at once.
- At most ``max_connections`` connections are open at once (callers wait for one to free up);
  idle ones are dropped after ``keepalive_expiry`` seconds (checked when one is taken).
- Closing the pool aborts every connection: a request or reply still in flight fails with
  ``ReadError``, a caller waiting for a connection (or any later one) gets ``ConnectError``.
- ``ReadTimeout`` counts the node's silence only: not while reading is paused for a slow
  reader (below), and afresh from when it resumes.
- While a streamed reply is read more slowly than the node sends it, reading pauses once
  ``HIGH_WATER`` bytes are buffered (the node is back-pressured, memory stays bounded).

``http://`` URLs are handled, and ``https://`` ones when the pool has an SSL context (which
verifies the node's certificate and host name, and may present a client certificate);
:meth:`H1Pool.target` returns None for others. Connections are pooled per (host, port, TLS).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import weakref
from collections.abc import AsyncIterator, ItemsView, Iterator, KeysView
from typing import Any, TypeVar, overload
from urllib.parse import urlsplit

import httptools
import httpx

HIGH_WATER = 256 * 1024

_ENCODINGS = ("ascii", "utf-8")

_D = TypeVar("_D")

TLS_CLOSE_HINT = (
    "(a node that requires a client certificate does so when the gateway presents none it "
    "trusts: node_tls's cert.pem and key.pem)"
)


_Key = tuple[str, int, bool]  # host, port, TLS


class _Target:
    """A parsed ``http(s)://host:port/path`` and the bytes that start a request to it."""

    __slots__ = ("head", "key")

    def __init__(self, host: str, port: int, path: bytes, tls: bool = False) -> None:
        self.key: _Key = (host, port, tls)
        host_header = f"[{host}]" if ":" in host else host
        if port != (443 if tls else 80):
            host_header += f":{port}"
        self.head = b"POST " + path + b" HTTP/1.1\r\nhost: " + host_header.encode("idna") + b"\r\n"


class H1Headers:
    """Response headers with ``httpx.Headers`` semantics for ``get`` and ``items``: names are
    case-insensitive (lower-cased in ``items``), repeated headers are joined with ``", "``, and
    bytes are decoded as ascii, else utf-8, else latin-1 (one choice for the whole set)."""

    __slots__ = ("_dict", "raw")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self._dict: dict[str, str] | None = None

    def _merged(self) -> dict[str, str]:
        d = self._dict
        if d is None:
            enc = "iso-8859-1"
            for candidate in _ENCODINGS:
                try:
                    for k, v in self.raw:
                        k.decode(candidate)
                        v.decode(candidate)
                except UnicodeDecodeError:
                    continue
                enc = candidate
                break
            d = {}
            for k, v in self.raw:
                key, value = k.decode(enc).lower(), v.decode(enc)
                prev = d.get(key)
                d[key] = value if prev is None else f"{prev}, {value}"
            self._dict = d
        return d

    @overload
    def get(self, key: str, /) -> str | None: ...
    @overload
    def get(self, key: str, default: _D, /) -> str | _D: ...

    def get(self, key: str, default: Any = None) -> Any:
        return self._merged().get(key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return self._merged()[key.lower()]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._merged()

    def items(self) -> ItemsView[str, str]:
        return self._merged().items()

    def keys(self) -> KeysView[str]:
        return self._merged().keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self._merged())

    def __len__(self) -> int:
        return len(self._merged())


class H1Response:
    """One response being received on one connection (see the module's docstring)."""

    __slots__ = (
        "__weakref__",
        "_chunks",
        "_conn",
        "_content",
        "_done",
        "_error",
        "_waiter",
        "buffered",
        "extensions",
        "headers",
        "status_code",
    )

    def __init__(self, conn: _Conn, status_code: int, headers: H1Headers) -> None:
        self._conn: _Conn | None = conn
        self.status_code = status_code
        self.headers = headers
        self.extensions: dict[str, Any] = {}
        self._chunks: list[bytes] = []
        self.buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._content: bytes | None = None

    # ---- fed by the connection -----------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if not self._done and self._error is None:
            self._error = exc
            self._wake()

    # ---- read by the proxy ---------------------------------------------------------------------
    async def _wait(self) -> None:
        self._waiter = w = asyncio.get_running_loop().create_future()
        try:
            await w
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return data

    async def read_chunk(self) -> bytes | None:
        """What arrived of the body since the last call (transfer-decoded, not content-decoded;
        waits for something), or None at its end."""
        while True:
            if self._chunks:
                return self._take()
            if self._done:
                self._finished()
                return None
            if self._error is not None:
                self._discard()
                raise self._error
            await self._wait()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (transfer-decoded, not content-decoded), read by read."""
        while (chunk := await self.read_chunk()) is not None:
            yield chunk

    async def aread(self) -> bytes:
        """The whole body, content-decoded as httpx does (a node asked for identity seldom
        sends anything else)."""
        if self._content is not None:
            return self._content
        parts: list[bytes] = []
        while (chunk := await self.read_chunk()) is not None:
            parts.append(chunk)
        raw = parts[0] if len(parts) == 1 else b"".join(parts)
        encoding = self.headers.get("content-encoding")
        if encoding and encoding.strip().lower() != "identity":
            decoded = httpx.Response(self.status_code, headers=self.headers.raw, content=raw)
            raw = decoded.content
        self._content = raw
        return raw

    def _finished(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.release()

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    async def aclose(self) -> None:
        if self._done:
            self._finished()
        else:
            self._discard()

    def __del__(self) -> None:  # a response dropped unread must not hold its connection
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.abort()


class _Conn(asyncio.Protocol):
    """One kept-alive connection to one node: at most one request in flight."""

    def __init__(self, pool: H1Pool, key: _Key) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        # the response being received; weak, so that one dropped unread frees the connection
        self._resp: weakref.ref[H1Response] | None = None
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head: asyncio.Future[H1Response] | None = None
        self._got_bytes = False
        self._complete = False
        self._keep_alive = False
        self._timer: asyncio.TimerHandle | None = None
        self._last_io = 0.0
        self._close_delimited = False
        self.lost_why = "the connection was closed by the gateway"
        self.requests = 0  # started on this connection

    # ---- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    @property
    def response(self) -> H1Response | None:
        ref = self._resp
        return ref() if ref is not None else None

    def data_received(self, data: bytes) -> None:
        if self._complete or (self._head is None and self._resp is None):
            self.abort()  # bytes nobody asked for: the connection cannot be trusted any more
            return
        self._got_bytes = True
        self._last_io = self.pool.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broken(httpx.RemoteProtocolError("the node switched protocols"))
            return
        except httptools.HttpParserError as exc:
            self._broken(httpx.RemoteProtocolError(f"malformed reply from the node: {exc}"))
            return
        resp = self.response
        if resp is not None and (resp._chunks or resp._done):
            resp._wake()
            if resp.buffered > HIGH_WATER and not self.paused and not resp._done:
                self.paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]

    def eof_received(self) -> bool | None:
        self._lost(None)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)

    # ---- httptools callbacks -------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self._raw_headers = []
            return
        resp = H1Response(self, status, H1Headers(self._raw_headers))
        self._raw_headers = []
        self._resp = weakref.ref(resp)
        self._close_delimited = not any(
            k.lower() in (b"content-length", b"transfer-encoding") for k, _ in resp.headers.raw
        )
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_result(resp)

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is not None:
            resp._chunks.append(body)
            resp.buffered += len(body)

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is None:  # completed an interim answer
            return
        self._complete = True
        self._keep_alive = self.parser.should_keep_alive()
        self._stop_timer()
        resp._done = True

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self, data: bytes, head: asyncio.Future[H1Response]) -> None:
        if self.closed:  # the node closed it after it opened, before this request
            head.set_exception(httpx.RemoteProtocolError(self.lost_why))
            return
        self.requests += 1
        self._head = head
        self._resp = None
        self._raw_headers = []
        self._got_bytes = False
        self._complete = False
        self._keep_alive = False
        self._last_io = self.pool.loop.time()
        self._timer = self.pool.loop.call_later(self.pool.read_timeout_s, self._on_timer)
        self.transport.write(data)  # type: ignore[union-attr]

    def _on_timer(self) -> None:
        self._timer = None
        if self.closed or self._complete:
            return
        loop = self.pool.loop
        if self.paused:  # we are the slow side: the node is not silent, it is held back
            self._timer = loop.call_later(self.pool.read_timeout_s, self._on_timer)
            return
        left = self._last_io + self.pool.read_timeout_s - loop.time()
        if left > 0:  # data came meanwhile (or the timer fired a little early)
            self._timer = loop.call_later(left, self._on_timer)
            return
        self._broken(httpx.ReadTimeout("timed out waiting for the node"))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self._last_io = self.pool.loop.time()  # the node's silence counts from now
            self.transport.resume_reading()  # type: ignore[union-attr]

    def _lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self.lost_why = _closed_why(self, exc)
        self._stop_timer()
        resp = self.response
        if resp is not None and not resp._done and self._close_delimited:
            resp._done = True  # a body delimited by the connection's end is complete now
            resp._wake()
        else:
            why = f": {exc}" if exc else ""
            err: httpx.TransportError = httpx.RemoteProtocolError(self.lost_why)
            if resp is not None:
                err = httpx.ReadError(f"the node closed the connection mid-reply{why}")
            self._fail(err)
        if self.transport is not None:
            self.transport.close()
        self.pool._forget(self)

    def _broken(self, exc: BaseException) -> None:
        self._fail(exc)
        self.abort()

    def _fail(self, exc: BaseException) -> None:
        head = self._head
        if head is not None and not head.done():
            head.set_exception(exc)
        if self.response is not None:
            self.response._fail(exc)

    def release(self) -> None:
        """The response was read to its end: keep the connection for the next request."""
        if self.closed or not self._complete or not self._keep_alive:
            self.abort()
            return
        self._resp = None
        self._head = None
        self.pool._put_idle(self)

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._stop_timer()
            # whoever still waits on this connection (its request, or a reader of its reply
            # when the pool closes) learns now: connection_lost will find it closed already
            self._fail(httpx.ReadError("the connection was closed by the gateway"))
            if self.transport is not None:
                self.transport.abort()
            self.pool._forget(self)


def _closed_why(conn: _Conn, exc: Exception | None) -> str:
    """Why a connection the node closed failed its request (for the error and the logs)."""
    why = f": {exc}" if exc else ""
    if conn.key[2] and conn.requests <= 1 and not conn._got_bytes:
        return f"the node closed the TLS connection before answering{why} {TLS_CLOSE_HINT}"
    return f"the node closed the connection{why}"


class H1Pool:
    """Kept-alive connections per (host, port), at most ``max_connections`` open in all."""

    def __init__(
        self,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 600.0,
        max_connections: int = 2048,
        keepalive_expiry: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.ssl_context = ssl_context  # None: https:// URLs are not handled here
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self._targets: dict[str, _Target | None] = {}
        self._idle: dict[_Key, list[_Conn]] = {}
        self._open: set[_Conn] = set()
        self._opening = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def target(self, url: str) -> _Target | None:
        """The parsed target of ``url``, or None when this client does not handle it."""
        try:
            return self._targets[url]
        except KeyError:
            pass
        t = None
        try:
            u = urlsplit(url)
            tls = u.scheme == "https" and self.ssl_context is not None
            plain = u.scheme == "http"
            if (plain or tls) and u.hostname and not u.username and not u.password:
                path = (u.path or "/") + (f"?{u.query}" if u.query else "")
                t = _Target(u.hostname, u.port or (443 if tls else 80), path.encode("ascii"), tls)
        except (ValueError, UnicodeError):
            t = None
        if len(self._targets) > 4096:
            self._targets.clear()
        self._targets[url] = t
        return t

    # ---- connections ---------------------------------------------------------------------------
    def _take_idle(self, key: _Key) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = self.loop.time()
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if now - conn.idle_since > self.keepalive_expiry:
                conn.abort()
                continue
            return conn
        return None

    def _put_idle(self, conn: _Conn) -> None:
        if self.closed:
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        self._wake_waiter()

    def _forget(self, conn: _Conn) -> None:
        if conn in self._open:
            self._open.discard(conn)
            idle = self._idle.get(conn.key)
            if idle and conn in idle:
                idle.remove(conn)
            self._wake_waiter()

    def _wake_waiter(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def _drop_oldest_idle(self) -> bool:
        oldest: _Conn | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest.idle_since):
                oldest = conns[0]
        if oldest is None:
            return False
        oldest.abort()
        return True

    async def _acquire(self, key: _Key) -> tuple[_Conn, bool]:
        """A connection to ``key`` and whether it is a kept-alive one (else new), waiting
        while ``max_connections`` are open and none of them is idle."""
        while True:
            if self.closed:
                raise httpx.ConnectError("the client is closed")
            conn = self._take_idle(key)
            if conn is not None:
                return conn, True
            if len(self._open) + self._opening < self.max_connections:
                return await self._connect(key), False
            if self._drop_oldest_idle():
                continue
            w = self.loop.create_future()
            self._waiters.append(w)
            try:
                await w
            except BaseException:
                if w.done() and not w.cancelled():
                    self._wake_waiter()  # woken, then cancelled: hand the wake-up on
                else:
                    w.cancel()
                raise

    async def _connect(self, key: _Key) -> _Conn:
        self._opening += 1
        try:
            conn = _Conn(self, key)
            host, port, tls = key
            ctx = self.ssl_context if tls else None
            try:
                await asyncio.wait_for(
                    self.loop.create_connection(
                        lambda: conn, host, port, ssl=ctx, server_hostname=host if ctx else None
                    ),
                    self.connect_timeout_s,
                )
            except TimeoutError:
                raise httpx.ConnectTimeout(
                    f"no connection to {host}:{port} within {self.connect_timeout_s} s"
                ) from None
            except ssl.SSLError as exc:  # an OSError too: the handshake failed
                raise httpx.ConnectError(f"TLS handshake with {host}:{port} failed: {exc}") from exc
            except OSError as exc:
                raise httpx.ConnectError(str(exc)) from exc
            if self.closed:  # closed while connecting
                conn.abort()
                raise httpx.ConnectError("the client is closed")
            self._open.add(conn)
            return conn
        finally:
            self._opening -= 1

    # ---- requests ------------------------------------------------------------------------------
    async def post(self, target: _Target, body: bytes, headers: dict[str, str]) -> H1Response:
        """Send a POST and return once the status line and headers arrived (body unread)."""
        if self.closed:
            raise httpx.ConnectError("the client is closed")
        head = [target.head]
        for k, v in headers.items():
            head.append(f"{k}: {v}\r\n".encode("latin-1"))
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        data = b"".join(head) + body
        for attempt in (0, 1):
            conn, reused = await self._acquire(target.key)
            fut: asyncio.Future[H1Response] = self.loop.create_future()
            conn.start(data, fut)
            try:
                return await fut
            except (httpx.ReadError, httpx.RemoteProtocolError):
                conn.abort()
                # a kept-alive connection the node had just closed: safe to send once more
                if attempt == 0 and reused and not conn._got_bytes:
                    continue
                raise
            except BaseException:
                conn.abort()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        self.closed = True
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
        for w in self._waiters:  # they wake to find the pool closed (ConnectError)
            if not w.done():
                w.set_result(None)
        self._waiters.clear()
