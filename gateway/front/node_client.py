"""The gateway's one client to its nodes: POSTs through one typed transport, GETs through httpx.

Invariants:
- Every request to a node carries the node headers given at creation (the node token); a POST
  also asks for no content encoding, since its body is relayed raw.
- Upstream cookies are never kept: the client is shared by every caller of the gateway, so a
  cookie one node set for one caller must not travel with the next caller's request.
- POSTs (the proxy's hot path) go through one :class:`gateway.front.upstream.UpstreamTransport`,
  chosen in :func:`default_transport` alone: the gateway's own HTTP/1.1 pool for ``http://``
  and ``https://`` nodes (:class:`H1Transport`, faster than httpx in
  ``bench/gateway_overhead.py``), httpx's transport for any other URL. GETs (load, prefix
  events, tokenizer files) go through the httpx client.
- Both speak TLS with one ``ssl.SSLContext`` (:func:`gateway.tls_folder.client_context`): a
  node's certificate and host name are always verified, against the ``node_tls`` folder's CA
  when one is configured, and its client certificate is presented to nodes that ask (mTLS).
- No request leaves before :class:`gateway.front.plain_token_guard.PlainTokenGuard` allowed
  it: the node token is never sent over plain HTTP beyond loopback.
- Failures are httpx's exception types whichever transport sent the request.
"""

from __future__ import annotations

import http.cookiejar
import ssl
from collections.abc import Mapping
from typing import Any

import httpx

from gateway.front.http1_connection import TLS_CLOSE_HINT
from gateway.front.http1_pool import H1Pool
from gateway.front.plain_token_guard import PlainTokenGuard
from gateway.front.upstream import Upstream, UpstreamTransport
from gateway.node_token import NODE_TOKEN_HEADER
from gateway.tls_folder import TLSFolder, client_context


class HttpxTransport:
    """POSTs straight to an httpx transport (none of the client's per-request handling)."""

    def __init__(self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout) -> None:
        self._transport = transport
        self._timeout = timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}

    def _url(self, url: str) -> httpx.URL:
        u = self._urls.get(url)
        if u is None:
            if len(self._urls) > 4096:
                self._urls.clear()
            u = self._urls[url] = httpx.URL(url)
        return u

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Upstream:
        req = httpx.Request(
            "POST",
            self._url(url),
            content=body,
            headers=headers,
            extensions={"timeout": self._timeout},
        )
        return await self._transport.handle_async_request(req)

    async def aclose(self) -> None:
        """Nothing: the transport belongs to the httpx client, closed with it."""


class H1Transport:
    """Plain-HTTP URLs through the gateway's own HTTP/1.1 pool, any other through ``other``."""

    def __init__(self, pool: H1Pool, other: UpstreamTransport) -> None:
        self.pool = pool
        self.other = other

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Upstream:
        target = self.pool.target(url)
        if target is None:
            return await self.other.post(url, body, headers)
        return await self.pool.post(target, body, headers)

    async def aclose(self) -> None:
        await self.pool.aclose()
        await self.other.aclose()


def default_transport(
    fallback: HttpxTransport,
    connect_timeout_s: float,
    read_timeout_s: float,
    max_connections: int,
    keepalive_s: float,
    ssl_context: ssl.SSLContext | None = None,
) -> UpstreamTransport:
    """The transport every node POST takes (the one place it is chosen)."""
    pool = H1Pool(connect_timeout_s, read_timeout_s, max_connections, keepalive_s, ssl_context)
    return H1Transport(pool, fallback)


class NodeClient:
    """Requests to nodes: :meth:`post` through the transport, :meth:`get` through httpx;
    each only once ``guard`` allowed its URL."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        transport: UpstreamTransport,
        headers: Mapping[str, str],
        guard: PlainTokenGuard | None = None,
    ) -> None:
        self.http = http
        self.transport = transport
        self._post_headers = {"accept-encoding": "identity", **headers}
        if guard is None:
            has_token = any(k.lower() == NODE_TOKEN_HEADER.lower() for k in headers)
            guard = PlainTokenGuard(has_token=has_token, allow_plain=False)
        self.guard = guard

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Upstream:
        """POST ``body`` to ``url``; the response comes back unread (status and headers)."""
        self.guard.check(url)
        return await self.transport.post(url, body, {**self._post_headers, **headers})

    async def get(self, url: str, **kwargs: Any) -> httpx.Response:
        """A whole GET response (``kwargs`` as for ``httpx.AsyncClient.get``)."""
        self.guard.check(url)
        try:
            return await self.http.get(url, **kwargs)
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            if not url.startswith("https:"):
                raise
            raise type(exc)(f"the node closed the TLS connection: {exc} {TLS_CLOSE_HINT}") from exc

    @property
    def is_closed(self) -> bool:
        return self.http.is_closed

    async def aclose(self) -> None:
        await self.transport.aclose()
        await self.http.aclose()


class _NoCookies(http.cookiejar.CookieJar):
    """A cookie jar that keeps nothing."""

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        pass

    def extract_cookies(self, response: Any, request: Any) -> None:
        pass


def make_client(
    connect_timeout_s: float = 2.0,
    read_timeout_s: float = 600.0,
    max_connections: int = 2048,
    headers: Mapping[str, str] | None = None,
    *,
    tls: TLSFolder | None = None,
    guard: PlainTokenGuard | None = None,
) -> NodeClient:
    """One pooled keep-alive client for every node; ``headers`` go with every request.
    ``tls``: the folder whose CA verifies nodes and whose certificate is presented to them
    (None: the system's trust store, no client certificate). ``guard``: what may be sent in
    clear (default: the token, when ``headers`` carry one, only to loopback)."""
    keepalive_s = 30.0
    ctx = client_context(tls)
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections // 4,
        keepalive_expiry=keepalive_s,
    )
    timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
    base = httpx.AsyncHTTPTransport(limits=limits, verify=ctx)
    http = httpx.AsyncClient(
        transport=base, timeout=timeout, cookies=_NoCookies(), headers=dict(headers or {})
    )
    transport = default_transport(
        HttpxTransport(base, timeout),
        connect_timeout_s,
        read_timeout_s,
        max_connections,
        keepalive_s,
        ctx,
    )
    return NodeClient(http, transport, headers or {}, guard)
