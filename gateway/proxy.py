"""Sending one request to nodes: retry before the first byte; reading SSE event by event.

Invariants:
- A connect error, a timeout, a 5xx or a 429 *before the first byte* is retried on the next
  candidate (bounded, with jittered backoff); a 4xx other than 429 is the client's and is passed
  through unchanged.
- A stream is opened only once its first event arrived (``Opened.first_event``); after that
  the relay (``gateway.front.relay``) owns it: it resumes a broken stream or ends it with an
  SSE error event and ``[DONE]``, never a silent truncation.
- An open that is cancelled (the client left) closes the upstream response it had, which
  cancels the request on the node.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import httpx

from gateway.front import fastjson
from gateway.front.node_client import NodeClient
from gateway.front.upstream import StreamedUpstream, Upstream  # the node response's interface
from gateway.node_headers import HEADERS_AT_FIRST_TOKEN

RETRYABLE_STATUS = {429, 500, 502, 503, 504}
HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
    "date",
    "server",
    HEADERS_AT_FIRST_TOKEN,  # between a node and the gateway only
}


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
    response: Upstream
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


class SSEReader:
    """Complete SSE events (each ending in a blank line) from a response's body, read by read.

    :meth:`next_events` returns what one read completed: the complete events as one piece of
    bytes and how many they are (never none), so that a relay can forward together what arrived
    together (no event waits for a later one); at the end, a last incomplete event (if the body
    ended with a non-blank one) counts as one, then None. A blank line ends an event (scanning
    left to right); what only has to be forwarded is not split (:func:`split_events` does).
    """

    __slots__ = ("_buf", "_read")

    def __init__(self, resp: Upstream) -> None:
        self._buf = b""
        read = getattr(resp, "read_chunk", None)
        if read is None:  # an httpx response
            chunks = cast(StreamedUpstream, resp).aiter_raw()
            read = functools.partial(anext, chunks, None)
        self._read: Callable[[], Awaitable[bytes | None]] = read

    async def next_events(self) -> tuple[bytes, int] | None:
        while True:
            chunk = await self._read()
            buf = self._buf
            if chunk is None:
                self._buf = b""
                return (buf, 1) if buf.strip() else None
            buf = buf + chunk if buf else chunk
            parts = buf.split(b"\n\n")
            if len(parts) == 1:
                self._buf = buf
                continue
            rest = parts[-1]
            self._buf = rest
            return (buf[: len(buf) - len(rest)] if rest else buf), len(parts) - 1


def split_events(data: bytes) -> list[bytes]:
    """The events of what :meth:`SSEReader.next_events` returned."""
    if not data.endswith(b"\n\n"):  # the last, incomplete event
        return [data]
    return [p + b"\n\n" for p in data.split(b"\n\n")[:-1]]


def usage_of(event: bytes) -> dict[str, Any] | None:
    """The usage object of a final usage chunk (``choices: []``), else None."""
    if b'"usage"' not in event or not event.startswith(b"data: {"):
        return None
    try:
        obj = fastjson.loads(event[6:])[0]
    except ValueError:
        return None
    u = obj.get("usage")
    return u if isinstance(u, dict) and not obj.get("choices") else None


def sse_error(message: str, code: str = "upstream_error") -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


async def open_first(
    client: NodeClient,
    candidates: Sequence[tuple[str, str]],  # (node_id, url)
    path: str,
    body: bytes,
    headers: dict[str, str],
    stream: bool,
    *,
    max_attempts: int = 3,
    backoff_s: float = 0.05,
    on_failure: Callable[[str], None] = lambda _n: None,
    on_dispatch: Callable[[str], Mapping[str, str] | None] = lambda _n: None,
    is_allowed: Callable[[str], bool] = lambda _n: True,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> Opened:
    """Try candidates in order until one answers without a retryable failure.
    ``on_dispatch`` counts each send and may add headers for that node's request."""
    attempts: list[Attempt] = []
    last_status, last_body, retry_after = None, b"", None
    for index, (node_id, url) in enumerate(candidates):
        if len(attempts) >= max_attempts:
            break
        if not is_allowed(node_id):
            continue
        if attempts:
            await sleep(backoff_s * (2 ** (len(attempts) - 1)) * (0.5 + random.random()))
        extra = on_dispatch(node_id)
        att = Attempt(node_id)
        attempts.append(att)
        sent_at = time.perf_counter()
        try:
            resp = await client.post(
                url.rstrip("/") + path, body, {**headers, **extra} if extra else headers
            )
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
        reader = SSEReader(resp)
        try:
            first = await reader.next_events()
            if first is None:
                raise StopAsyncIteration
        except (StopAsyncIteration, httpx.TransportError, OSError) as exc:
            att.error = f"stream broke before the first byte: {exc!r}"
            await resp.aclose()
            on_failure(node_id)
            continue
        except BaseException:  # cancelled (the client left): the node cancels the request
            await resp.aclose()
            raise
        resp.extensions["edgecloud_batches"] = reader
        resp.extensions["edgecloud_first_batch"] = first
        return Opened(node_id, index, resp, split_events(first[0])[0], attempts, sent_at)
    raise Exhausted(attempts, last_status, last_body, retry_after)


async def _read_quietly(resp: Upstream) -> bytes:
    try:
        return await resp.aread()
    except (httpx.TransportError, OSError):
        return b""
    finally:
        await resp.aclose()


def passthrough_headers(resp: Upstream) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
