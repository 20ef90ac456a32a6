"""One kept-alive HTTP/1.1 connection to a node: :class:`H1Connection`, an asyncio protocol
parsing replies with httptools (the parser uvicorn uses), at most one request in flight. Failures
reach the request or its reply as httpx's types: ``ReadTimeout`` when the node is silent for the
read timeout (not while reading is paused for a slow reader, and afresh from when it resumes),
``ReadError`` or ``RemoteProtocolError`` when the connection breaks or the reply is malformed.
Reading pauses once ``HIGH_WATER`` bytes of a reply are buffered unread (the node is
back-pressured, memory stays bounded). A connection goes back to the pool only after its reply
was read to the end and the node keeps it alive; one the node closed, or that received bytes
nobody asked for, is never reused.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import TYPE_CHECKING

import httptools
import httpx

from gateway.front.http1_response import H1Headers, H1Response

if TYPE_CHECKING:
    from gateway.front.http1_pool import H1Pool

HIGH_WATER = 256 * 1024

TLS_CLOSE_HINT = (
    "(a node that requires a client certificate does so when the gateway presents none it "
    "trusts: node_tls's cert.pem and key.pem)"
)


ConnKey = tuple[str, int, bool]  # host, port, TLS


class H1Connection(asyncio.Protocol):
    """One kept-alive connection to one node: at most one request in flight."""

    def __init__(self, pool: H1Pool, key: ConnKey) -> None:
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


def _closed_why(conn: H1Connection, exc: Exception | None) -> str:
    """Why a connection the node closed failed its request (for the error and the logs)."""
    why = f": {exc}" if exc else ""
    if conn.key[2] and conn.requests <= 1 and not conn._got_bytes:
        return f"the node closed the TLS connection before answering{why} {TLS_CLOSE_HINT}"
    return f"the node closed the connection{why}"
