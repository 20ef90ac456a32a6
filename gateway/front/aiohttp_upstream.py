"""A bare aiohttp ``ClientSession`` as the gateway's upstream client (for measurement).

:func:`gateway.proxy.send_upstream` normally sends plain-HTTP requests through the gateway's
own HTTP/1.1 pool (:mod:`gateway.front.http1`). With ``EDGECLOUD_UPSTREAM_CLIENT=aiohttp``
it sends them through one aiohttp session instead, with this adapter giving the proxy the
part of the response interface it uses (``status_code``, ``headers``, ``extensions``,
``read_chunk``, ``aread``, ``aclose``); ``bench/gateway_overhead.py`` measures both.
aiohttp's errors are mapped to httpx's (connect errors before the reply, read errors after).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import httpx
from multidict import CIMultiDictProxy


class AiohttpUpstream:
    __slots__ = ("_resp", "extensions", "headers", "status_code")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers: CIMultiDictProxy[str] = resp.headers  # case-insensitive get/items
        self.extensions: dict[str, Any] = {}

    async def read_chunk(self) -> bytes | None:
        try:
            data = await self._resp.content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise httpx.ReadError(str(exc)) from exc
        return data or None

    async def aread(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise httpx.ReadError(str(exc)) from exc

    async def aclose(self) -> None:
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class AiohttpSender:
    """One session, made on first use inside the running loop."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, limit: int) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> AiohttpUpstream:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit),
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
            )
        try:
            resp = await self._session.post(url, data=body, headers=headers)
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise httpx.ConnectError(str(exc)) from exc
        return AiohttpUpstream(resp)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
