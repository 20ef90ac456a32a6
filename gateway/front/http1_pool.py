"""The gateway's own HTTP/1.1 client to its nodes: :class:`H1Pool` POSTs a body on a kept-alive
connection and returns the response once its headers arrived, body unread; nothing of a general
client (redirects, cookies, auth, proxies). It takes ``http://`` URLs, and ``https://`` ones when
given an ``ssl.SSLContext`` (which verifies the node's certificate and host name, and may present
a client certificate); :meth:`H1Pool.target` returns None for others. Connections are pooled per
(host, port, TLS), at most ``max_connections`` open at once (callers wait for one to free up),
idle ones dropped after ``keepalive_expiry`` seconds (checked when one is taken). A failure before
the request is sent, a failed TLS handshake included, is ``ConnectError``/``ConnectTimeout``; a
kept-alive connection that dies before any byte of the reply is retried once on a new one, while
a new one the node closes before the request is written fails the request at once. Closing the
pool aborts every connection: replies in flight fail with ``ReadError``, a caller waiting for a
connection (or any later one) gets ``ConnectError``.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from urllib.parse import urlsplit

import httpx

from gateway.front.http1_connection import ConnKey, H1Connection
from gateway.front.http1_response import H1Response


class _Target:
    """A parsed ``http(s)://host:port/path`` and the bytes that start a request to it."""

    __slots__ = ("head", "key")

    def __init__(self, host: str, port: int, path: bytes, tls: bool = False) -> None:
        self.key: ConnKey = (host, port, tls)
        host_header = f"[{host}]" if ":" in host else host
        if port != (443 if tls else 80):
            host_header += f":{port}"
        self.head = b"POST " + path + b" HTTP/1.1\r\nhost: " + host_header.encode("idna") + b"\r\n"


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
        self._idle: dict[ConnKey, list[H1Connection]] = {}
        self._open: set[H1Connection] = set()
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
    def _take_idle(self, key: ConnKey) -> H1Connection | None:
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

    def _put_idle(self, conn: H1Connection) -> None:
        if self.closed:
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        self._wake_waiter()

    def _forget(self, conn: H1Connection) -> None:
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
        oldest: H1Connection | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest.idle_since):
                oldest = conns[0]
        if oldest is None:
            return False
        oldest.abort()
        return True

    async def _acquire(self, key: ConnKey) -> tuple[H1Connection, bool]:
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

    async def _connect(self, key: ConnKey) -> H1Connection:
        self._opening += 1
        try:
            conn = H1Connection(self, key)
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
