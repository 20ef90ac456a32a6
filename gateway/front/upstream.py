"""The typed seam between the gateway's proxy and the clients that reach its nodes.

:class:`UpstreamTransport` is what sends a node request (POST a body, get the response back
unread); :mod:`gateway.front.node_client` picks its one implementation. Two clients produce
the responses: the gateway's own HTTP/1.1 pool for plain-HTTP nodes
(:class:`gateway.front.http1_response.H1Response`) and httpx for any other URL
(``httpx.Response``). This module names exactly the part of them that callers use, so that a type
checker (and ``tests/test_http1.py``, with ``isinstance`` on these runtime-checkable protocols)
holds both to it:

- ``status_code``, ``headers`` (:class:`UpstreamHeaders`: case-insensitive ``get``, ``[]``,
  ``in``, ``items``), ``extensions`` (a mutable mapping: :func:`gateway.proxy.open_first` keeps
  the stream's SSE reader and first batch there);
- ``aread()`` (the whole body, content-decoded) and ``aclose()`` (closing a response not read
  to its end closes its connection, which cancels the request on the node);
- the body read as it arrives, transfer-decoded: ``read_chunk()`` (:class:`ChunkedUpstream`:
  the gateway's pool) or ``aiter_raw()`` (:class:`StreamedUpstream`: httpx).
  :class:`gateway.proxy.SSEReader` prefers ``read_chunk`` where there is one.

Failures are httpx's exception types (``httpx.TransportError`` subclasses) whatever the client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, MutableMapping
from typing import Any, Protocol, TypeAlias, overload, runtime_checkable


@runtime_checkable
class UpstreamHeaders(Protocol):
    """A response's headers: names are case-insensitive; a repeated header reads as its values
    joined with ``", "`` (httpx's semantics)."""

    @overload
    def get(self, key: str, /) -> str | None: ...
    @overload
    def get(self, key: str, default: str, /) -> str: ...

    def __getitem__(self, key: str, /) -> str: ...

    def __contains__(self, key: object, /) -> bool: ...

    def items(self) -> Iterable[tuple[str, str]]: ...


@runtime_checkable
class UpstreamResponse(Protocol):
    """What every upstream response has (see the module's docstring)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> UpstreamHeaders: ...

    @property
    def extensions(self) -> MutableMapping[str, Any]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class ChunkedUpstream(UpstreamResponse, Protocol):
    """A response whose body is read with ``read_chunk``: what arrived since the last call
    (waiting for something), or None at the end."""

    async def read_chunk(self) -> bytes | None: ...


@runtime_checkable
class StreamedUpstream(UpstreamResponse, Protocol):
    """A response whose body is read with ``aiter_raw`` (httpx's)."""

    def aiter_raw(self) -> AsyncIterator[bytes]: ...


Upstream: TypeAlias = ChunkedUpstream | StreamedUpstream
"""A node's response, opened (status and headers read, body not yet)."""


@runtime_checkable
class UpstreamTransport(Protocol):
    """Sends requests to nodes (see the module's docstring)."""

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Upstream:
        """POST ``body`` to ``url`` with exactly ``headers``; the response unread."""
        ...

    async def aclose(self) -> None:
        """Close every connection it keeps."""
        ...
