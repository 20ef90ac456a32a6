"""The one way the project serves HTTP: uvicorn, with read timeouts, a connection cap and a drain.

Every server (the gateway, the edge and cloud nodes) runs through :class:`DrainingServer`,
under a :class:`~gateway.server_limits.ServerLimits`. What uvicorn does not do by itself, and
this module adds:

* **Header and body read timeouts.** uvicorn's only read timer is ``timeout_keep_alive``,
  armed *after* a response: a connection that never sends, or sends its headers byte by byte,
  is held forever. :class:`GuardedHttpToolsProtocol` (uvicorn's httptools protocol plus one
  timer) closes a connection whose headers are not complete ``header_timeout_s`` after it
  opened (or after its next request's first byte), and one whose body stalls for
  ``body_timeout_s`` or is not complete ``body_deadline_s`` after its headers (a total: a
  body trickled a byte at a time is cut), with a 408 when no response has started. Time during which uvicorn
  itself has paused reading (flow control, a pipelined request waiting its turn, a client
  waiting for ``100 Continue``) never counts against the client.
* **No ``server`` header.** Replies do not name the server software (uvicorn's default).
* **A connection cap.** Past ``max_connections`` open connections a new one gets a 503 and is
  closed at once, so a flood cannot exhaust the open-file limit (which is raised to the hard
  limit first).
* **Quiet client disconnects.** A client that goes away mid-body ends its request with
  Starlette's ``ClientDisconnect``; that is not a server error, so it is logged at debug, not
  as a traceback (:class:`ServedApp`, and :class:`DisconnectNoiseFilter` on the app's error
  logger).
* **HTTPS when given a TLS folder** (:mod:`gateway.tls_folder`): uvicorn's TLS with the
  folder's certificate and key, client certificates required when it has a CA bundle.
* **A drain that the caller finishes.** On SIGTERM or SIGINT the server stops accepting, lets
  in-flight requests finish for up to ``drain_timeout_s``, cancels the rest (a stream cut so
  ends with its API's error event naming the reason, and its end: :mod:`gateway.drain_word`,
  never a truncated body), runs the app's
  shutdown and *returns* a :class:`ServeResult` (uvicorn would re-raise the signal, killing
  the process before the caller could stop its children). Another thread stops it with
  :meth:`DrainingServer.request_stop`. ``on_started`` is called once it listens (a
  gateway worker tells its parent so).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import uvicorn
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.drain_word import drain_message, drain_words
from gateway.server_limits import ServerLimits, raise_open_file_limit
from gateway.tls_folder import TLSFolder

log = logging.getLogger(__name__)

# Loggers that log a request's exception with its traceback (the apps' 500 handler).
APP_ERROR_LOGGERS = ("gateway.errors",)


def _response(status: str, text: str, extra: bytes = b"") -> bytes:
    body = text.encode()
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


_REQUEST_TIMEOUT = _response(
    "408 Request Timeout", "Request timeout: the request was not sent in time.\n"
)
_TOO_MANY = _response("503 Service Unavailable", "Too many connections.\n", b"retry-after: 1\r\n")

_IDLE, _HEADERS, _BODY = 0, 1, 2


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body read timeouts and a connection cap.

    One timer per connection, in one of three phases: *headers* (armed when the connection
    opens, or at a later request's first byte; an absolute deadline, so trickled bytes do not
    extend it), *body* (re-armed by every piece of body that arrives: a stall timer), *idle*
    (no timer of ours; uvicorn's keep-alive timer applies). In the body phase the timer is
    also capped by the body's total deadline (``body_deadline_s`` from its headers), so a body
    trickled a byte at a time is cut there; time the server spends not reading (flow control)
    moves the deadline on. Subclassed per server by
    :func:`protocol_for`, which sets the class attributes.
    """

    limits: ClassVar[ServerLimits] = ServerLimits()
    max_connections: ClassVar[int] = 1024
    _last_cap_warning: ClassVar[float] = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._phase = _IDLE
        self._begun = False  # a byte of the current request has arrived
        self._rejected = False
        self._body_deadline = 0.0  # loop time by which the current body must be complete

    # -- connection ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._rejected = True
            self.transport = transport
            transport.write(_TOO_MANY)
            transport.close()
            now = time.monotonic()
            if now - GuardedHttpToolsProtocol._last_cap_warning > 10.0:
                GuardedHttpToolsProtocol._last_cap_warning = now
                log.warning(
                    "connection limit (%d) reached: refusing new connections with 503",
                    self.max_connections,
                )
            return
        super().connection_made(transport)
        self._phase = _HEADERS
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if not self._rejected:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        super().data_received(data)
        if self._phase == _BODY and not self.transport.is_closing():
            left = self._body_deadline - self.loop.time()
            self._arm(max(0.0, min(self.limits.body_timeout_s, left)))

    # -- parser callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begun = True
        if self._phase == _IDLE:
            self._phase = _HEADERS
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._cancel()
        self._phase = _BODY
        self._body_deadline = self.loop.time() + self.limits.body_deadline_s
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel()
        self._phase = _IDLE
        self._begun = False
        super().on_message_complete()

    # -- the timer -------------------------------------------------------------------------------

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(delay, self._timed_out)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or transport.is_closing() or self._phase == _IDLE:
            return
        cycle = self.cycle if self._phase == _BODY else None
        previous = self.cycle if self._phase == _HEADERS else None
        waiting_on_us = (
            (self.flow is not None and self.flow.read_paused)
            or (cycle is not None and cycle.waiting_for_100_continue)
            # a pipelined request's headers while the previous response is still being sent
            or (previous is not None and not previous.response_complete)
        )
        if waiting_on_us:  # we are not reading, or not ready to answer: not the client's stall
            delay = (
                self.limits.header_timeout_s
                if self._phase == _HEADERS
                else self.limits.body_timeout_s
            )
            self._body_deadline += delay  # nor the client's time
            self._arm(delay)
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        if self._phase == _HEADERS:
            log.debug("closing %s: no complete request headers in time", client)
            if self._begun:
                transport.write(_REQUEST_TIMEOUT)
        else:
            log.debug("closing %s: request body stalled or past its deadline", client)
            if cycle is not None and not cycle.response_started:
                cycle.disconnected = True  # the app's receive() now says http.disconnect
                cycle.message_event.set()
                transport.write(_REQUEST_TIMEOUT)
        transport.close()


def protocol_for(limits: ServerLimits) -> type[GuardedHttpToolsProtocol]:
    """A :class:`GuardedHttpToolsProtocol` subclass enforcing ``limits``."""
    attrs = {"limits": limits, "max_connections": limits.connection_cap()}
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), attrs)


def _only_disconnects(exc: BaseException) -> bool:
    if isinstance(exc, ClientDisconnect):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_disconnects(e) for e in exc.exceptions)
    return False


class DisconnectNoiseFilter(logging.Filter):
    """Drops log records whose exception is a client disconnect (not a server error)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or not _only_disconnects(exc)


_noise_filter = DisconnectNoiseFilter()


def quiet_client_disconnects() -> None:
    """Install :class:`DisconnectNoiseFilter` on the apps' error loggers (idempotent)."""
    for name in APP_ERROR_LOGGERS:
        logger = logging.getLogger(name)
        if _noise_filter not in logger.filters:
            logger.addFilter(_noise_filter)


class _Stream:
    """What one request's response has sent so far (for the drain's last words)."""

    __slots__ = ("ended", "mid_event", "sse", "started")

    def __init__(self) -> None:
        self.started = self.sse = self.ended = self.mid_event = False

    def saw(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            for name, value in message.get("headers") or ():
                if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                    self.sse = True
        elif message["type"] == "http.response.body":
            body = message.get("body") or b""
            if body:
                self.mid_event = not body.endswith(b"\n\n")
            if not message.get("more_body", False):
                self.ended = True


class ServedApp:
    """The ASGI app as served: counts requests in flight and those cut off by the drain
    deadline; a request ended by its client's disconnect ends quietly.

    A server-sent-event stream cut at the drain deadline (its task cancelled while
    ``draining``) is not left truncated: it gets :func:`gateway.drain_word.drain_words` (its
    API's error event naming ``stop_reason``, and its end) and its body is ended cleanly; it
    counts in ``cancelled`` and in ``worded``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.active = 0
        self.cancelled = 0
        self.worded = 0
        self.draining = False
        self.stop_reason: str | None = None
        self.drain_s = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.active += 1
        stream = _Stream()

        async def watched(message: Message) -> None:
            stream.saw(message)
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            if not self.draining:
                raise
            self.cancelled += 1
            if not (stream.sse and stream.started and not stream.ended):
                raise
            await self._last_words(scope, send, stream)
        except BaseException as exc:
            if not _only_disconnects(exc):
                raise
            log.debug("client disconnected before its request was read: %s", scope.get("path"))
        finally:
            self.active -= 1

    async def _last_words(self, scope: Scope, send: Send, stream: _Stream) -> None:
        """End a cut stream with its error event and end (the request is over: its task was
        cancelled to stop it, and it has stopped; nothing is re-raised)."""
        words = drain_words(
            scope.get("path", ""),
            drain_message(self.stop_reason, self.drain_s),
            mid_event=stream.mid_event,
        )
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": words, "more_body": False})
            self.worded += 1


@dataclass(frozen=True)
class ServeResult:
    """How a server stopped. ``reason``: the signal's name, :meth:`DrainingServer.request_stop`'s
    reason, or None (it stopped by itself). ``in_flight``: requests running when the stop began;
    ``cancelled``: those cut off at the drain deadline, ``worded`` of which were streams ended
    with an error event (:mod:`gateway.drain_word`). ``seconds``: from the stop request to the
    server's return (drain and the app's shutdown)."""

    reason: str | None
    in_flight: int
    cancelled: int
    seconds: float
    worded: int = 0

    def describe(self, what: str) -> str:
        if self.in_flight == 0:
            drained = "no requests in flight"
        elif self.cancelled == 0:
            drained = f"{self.in_flight} request(s) in flight, all finished"
        else:
            drained = (
                f"{self.in_flight} request(s) in flight, {self.cancelled} cancelled at the drain "
                f"deadline ({self.worded} stream(s) ended with an error event)"
            )
        return f"stopped {what} in {self.seconds:.1f} s ({drained})"


class DrainingServer(uvicorn.Server):
    """uvicorn's server under :class:`ServerLimits`, which returns after a signal (see module).

    Invariant: :meth:`serve_until_stopped` runs the server once; the app's lifespan shutdown
    has run when it returns (unless the app failed to start: uvicorn then exits with 3).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str,
        port: int,
        limits: ServerLimits,
        proxy_headers: bool = True,
        log_level: str = "warning",
        on_stop_request: Callable[[str], None] | None = None,
        on_started: Callable[[], None] | None = None,
        tls: TLSFolder | None = None,
    ) -> None:
        raise_open_file_limit()
        quiet_client_disconnects()
        self.limits = limits
        self.served = ServedApp(app)
        self._on_stop_request = on_stop_request
        self._on_started = on_started
        self.stop_reason: str | None = None
        self._stop_at: float | None = None
        self._in_flight = 0
        config = uvicorn.Config(
            self.served,
            host=host,
            port=port,
            http=protocol_for(limits),
            ws="none",
            log_level=log_level,
            proxy_headers=proxy_headers,
            timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
            timeout_graceful_shutdown=limits.drain_timeout_s,  # type: ignore[arg-type]
            backlog=limits.backlog,
            server_header=False,  # replies do not name the server software
            **(tls.server_options() if tls is not None else {}),
        )
        super().__init__(config)

    def _note_stop(self, reason: str) -> None:
        if self._stop_at is None:
            self._stop_at = time.monotonic()
            self.stop_reason = reason
            if self._on_stop_request is not None:
                self._on_stop_request(reason)

    def request_stop(self, reason: str) -> None:
        """Begin the drain, as a signal would; callable from any thread."""
        self._note_stop(reason)
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._note_stop(signal.Signals(sig).name)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM start the drain; unlike uvicorn's, the signal is not raised again
        afterwards: the caller decides what follows (stop its children, exit 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_started is not None:
            self._on_started()

    async def shutdown(self, sockets: Any = None) -> None:
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        self._in_flight = self.served.active
        self.served.stop_reason = self.stop_reason
        self.served.drain_s = self.limits.drain_timeout_s
        self.served.draining = True
        await super().shutdown(sockets=sockets)

    def serve_until_stopped(self, sockets: list[socket.socket] | None = None) -> ServeResult:
        """Serve (on ``sockets`` when given, already listening; else bind host and port) until
        a signal or :meth:`request_stop`, drain, and say how it stopped."""
        self.run(sockets=sockets)
        end = time.monotonic()
        return ServeResult(
            reason=self.stop_reason,
            in_flight=self._in_flight,
            cancelled=self.served.cancelled,
            seconds=end - (self._stop_at if self._stop_at is not None else end),
            worded=self.served.worded,
        )


def serve(
    app: ASGIApp,
    *,
    host: str,
    port: int,
    limits: ServerLimits,
    proxy_headers: bool = True,
    log_level: str = "warning",
    tls: TLSFolder | None = None,
) -> ServeResult:
    """Serve ``app`` until SIGTERM/SIGINT, drain, return how it stopped (over HTTPS with
    ``tls``)."""
    server = DrainingServer(
        app,
        host=host,
        port=port,
        limits=limits,
        proxy_headers=proxy_headers,
        log_level=log_level,
        tls=tls,
    )
    return server.serve_until_stopped()
