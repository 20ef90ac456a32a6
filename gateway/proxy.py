"""Forwarding one request to nodes: retry before the first byte, relay SSE event by event.

Invariants:
- A connect error, a timeout, a 5xx or a 429 *before the first byte* is retried on the next
  candidate (bounded, with jittered backoff); a 4xx other than 429 is the client's and is passed
  through unchanged.
- Once the first byte has gone to the client, nothing is retried: if the upstream breaks, the
  client gets an SSE error event and ``[DONE]``, never a silent truncation.
- Each SSE event is forwarded as soon as it is complete (no buffering beyond one event).
- Closing the client side (disconnect) closes the upstream response, which cancels the request
  on the node.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

try:  # the aiohttp transport is 3.5x faster under concurrency (see the measured notes)
    from httpx_aiohttp import AiohttpTransport
except ImportError:  # pragma: no cover - optional speed-up
    AiohttpTransport = None  # type: ignore[assignment,misc]

RETRYABLE_STATUS = {429, 500, 502, 503, 504}
HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
    "date",
    "server",
}


def make_client(
    connect_timeout_s: float = 2.0, read_timeout_s: float = 600.0, max_connections: int = 2048
) -> httpx.AsyncClient:
    """One pooled keep-alive client shared by every node."""
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections // 4,
        keepalive_expiry=30.0,
    )
    timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
    transport = AiohttpTransport(limits=limits) if AiohttpTransport is not None else None
    return httpx.AsyncClient(transport=transport, limits=limits, timeout=timeout)


@dataclass
class Attempt:
    """One try on one node; ``error`` is set when it failed before the first byte."""

    node_id: str
    status: int | None = None
    error: str | None = None


@dataclass
class Opened:
    """An upstream response that produced its status and (for streams) a first event."""

    node_id: str
    index: int  # position in the candidate list
    response: httpx.Response
    first_event: bytes | None  # streams only
    attempts: list[Attempt]
    sent_at: float


@dataclass
class Exhausted(Exception):
    """Every candidate failed before the first byte."""

    attempts: list[Attempt]
    last_status: int | None = None
    last_body: bytes = b""
    retry_after: str | None = None


@dataclass
class StreamTotals:
    """Filled in while relaying a stream: what the upstream reported and when."""

    first_event_at: float | None = None
    usage: dict[str, Any] | None = None
    events: int = 0
    broken: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Split a byte stream into complete SSE events (each ending in a blank line)."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while True:
            i = buf.find(b"\n\n")
            if i < 0:
                break
            yield buf[: i + 2]
            buf = buf[i + 2 :]
    if buf.strip():
        yield buf


def usage_of(event: bytes) -> dict[str, Any] | None:
    """The usage object of a final usage chunk (``choices: []``), else None."""
    if b'"usage"' not in event or not event.startswith(b"data: {"):
        return None
    try:
        obj = json.loads(event[6:])
    except ValueError:
        return None
    u = obj.get("usage")
    return u if isinstance(u, dict) and not obj.get("choices") else None


def sse_error(message: str, code: str = "upstream_error") -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


async def open_first(
    client: httpx.AsyncClient,
    candidates: Sequence[tuple[str, str]],  # (node_id, url)
    path: str,
    body: bytes,
    headers: dict[str, str],
    stream: bool,
    *,
    max_attempts: int = 3,
    backoff_s: float = 0.05,
    on_failure: Callable[[str], None] = lambda _n: None,
    on_dispatch: Callable[[str], None] = lambda _n: None,
    is_allowed: Callable[[str], bool] = lambda _n: True,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> Opened:
    """Try candidates in order until one answers without a retryable failure."""
    attempts: list[Attempt] = []
    last_status, last_body, retry_after = None, b"", None
    for index, (node_id, url) in enumerate(candidates):
        if len(attempts) >= max_attempts:
            break
        if not is_allowed(node_id):
            continue
        if attempts:
            await sleep(backoff_s * (2 ** (len(attempts) - 1)) * (0.5 + random.random()))
        on_dispatch(node_id)
        att = Attempt(node_id)
        attempts.append(att)
        sent_at = time.perf_counter()
        try:
            req = client.build_request(
                "POST", url.rstrip("/") + path, content=body, headers=headers
            )
            resp = await client.send(req, stream=True)
        except (httpx.TransportError, OSError) as exc:
            att.error = f"{type(exc).__name__}: {exc}"
            on_failure(node_id)
            continue
        att.status = resp.status_code
        if resp.status_code in RETRYABLE_STATUS:
            last_status, last_body = resp.status_code, await _read_quietly(resp)
            retry_after = resp.headers.get("retry-after")
            att.error = f"HTTP {resp.status_code}"
            if resp.status_code >= 500:
                on_failure(node_id)
            continue
        if not stream or resp.status_code != 200:
            return Opened(node_id, index, resp, None, attempts, sent_at)
        events = sse_events(resp.aiter_raw())
        try:
            first = await anext(events)
        except (StopAsyncIteration, httpx.TransportError, OSError) as exc:
            att.error = f"stream broke before the first byte: {exc!r}"
            await resp.aclose()
            on_failure(node_id)
            continue
        resp.extensions["edgecloud_events"] = events
        return Opened(node_id, index, resp, first, attempts, sent_at)
    raise Exhausted(attempts, last_status, last_body, retry_after)


async def _read_quietly(resp: httpx.Response) -> bytes:
    try:
        return await resp.aread()
    except (httpx.TransportError, OSError):
        return b""
    finally:
        await resp.aclose()


async def relay_stream(
    opened: Opened, totals: StreamTotals, forward_usage: bool
) -> AsyncIterator[bytes]:
    """Relay the upstream SSE events; a usage chunk is kept out when the client did not ask."""
    events: AsyncIterator[bytes] = opened.response.extensions["edgecloud_events"]
    resp = opened.response
    try:
        pending = [opened.first_event] if opened.first_event is not None else []
        totals.first_event_at = time.perf_counter()
        done = False
        while True:
            if pending:
                ev = pending.pop()
            else:
                try:
                    ev = await anext(events)
                except StopAsyncIteration:
                    break
            totals.events += 1
            u = usage_of(ev)
            if u is not None:
                totals.usage = u
                if not forward_usage:
                    continue
            if ev.startswith(b"data: [DONE]"):
                done = True
            yield ev
        if not done:
            totals.broken = "upstream closed the stream before [DONE]"
            yield sse_error("the node closed the stream before it finished")
    except (httpx.TransportError, OSError) as exc:
        totals.broken = f"{type(exc).__name__}: {exc}"
        yield sse_error(f"the node failed mid-stream ({type(exc).__name__})")
    finally:
        await resp.aclose()


def passthrough_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
