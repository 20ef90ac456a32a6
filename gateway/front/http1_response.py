"""Responses of the gateway's HTTP/1.1 client: :class:`H1Headers` and :class:`H1Response`,
the part of ``httpx.Response`` the proxy uses (``status_code``, ``headers.get``/``items`` with
httpx's header semantics, ``extensions``, ``read_chunk``, ``aiter_raw``, ``aread``, ``aclose``).
The body is fed in transfer-decoded by its :class:`gateway.front.http1_connection.H1Connection`;
only ``aread`` content-decodes, exactly as httpx does. A response gives its connection back to the
pool only once read to its end; closed early or dropped unread, it aborts the connection (the
node then cancels the request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, ItemsView, Iterator, KeysView
from typing import TYPE_CHECKING, Any, TypeVar, overload

import httpx

if TYPE_CHECKING:
    from gateway.front.http1_connection import H1Connection

_ENCODINGS = ("ascii", "utf-8")

_D = TypeVar("_D")


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
    """One response being received on one connection (see the module's docstring); failures
    reach it as httpx's exception types."""

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

    def __init__(self, conn: H1Connection, status_code: int, headers: H1Headers) -> None:
        self._conn: H1Connection | None = conn
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
