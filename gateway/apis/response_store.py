"""Stored responses (``store: true``) for ``previous_response_id``, ``GET`` and ``DELETE``.

Two implementations of one interface: in Redis (every gateway replica sharing the fleet's Redis
sees every stored response; each key expires after the TTL) when the gateway has a
``redis_url``, else in this process (a single worker: bounded, oldest dropped first, same TTL).

Invariants:
- A response is stored with its owner (the API key's name, :attr:`KeyIdentity.key_id`); ``get``
  and ``delete`` by anyone else find nothing, exactly as for an id never stored (the routes
  answer 404 either way, so ids cannot be probed).
- What is stored is the response object as the client got it and the conversation that led to
  it as chat messages (its inputs, without ``instructions``, then its output), so the next turn
  sends only its new input.
- Keys are namespaced and versioned: ``edgecloud:v1:response:<id>``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel

from gateway.errors import APIError

if TYPE_CHECKING:
    from redis.asyncio import Redis

KEY_PREFIX = "edgecloud:v1:response:"
MAX_IN_PROCESS = 10_000


class StoredResponse(BaseModel):
    owner: str
    response: dict[str, Any]  # as the client got it
    messages: list[dict[str, Any]]  # the chat history through this response's output


class ResponseStore(Protocol):
    async def put(self, record: StoredResponse) -> None: ...

    async def get(self, response_id: str, owner: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str, owner: str) -> bool: ...


class InProcessResponseStore:
    """Responses in this process, oldest dropped past ``max_entries``, each for ``ttl_s``."""

    def __init__(self, ttl_s: float, max_entries: int = MAX_IN_PROCESS) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._items: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    async def put(self, record: StoredResponse) -> None:
        rid = str(record.response["id"])
        self._items[rid] = (time.monotonic() + self.ttl_s, record)
        self._items.move_to_end(rid)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        found = self._items.get(response_id)
        if found is None:
            return None
        expires, record = found
        if time.monotonic() >= expires:
            del self._items[response_id]
            return None
        return record if record.owner == owner else None

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:
            return False
        del self._items[response_id]
        return True


def _unavailable(exc: Exception) -> APIError:
    return APIError(
        503,
        f"The response store is unreachable right now ({type(exc).__name__}); please retry.",
        type_="server_error",
        code="store_unavailable",
        headers={"Retry-After": "1"},
    )


class RedisResponseStore:
    """Responses in Redis under ``edgecloud:v1:response:<id>``, each expiring after ``ttl_s``."""

    def __init__(self, client: Redis, ttl_s: float) -> None:
        self.client = client
        self.ttl_s = ttl_s

    async def put(self, record: StoredResponse) -> None:
        key = KEY_PREFIX + str(record.response["id"])
        try:
            await self.client.set(key, record.model_dump_json(), ex=max(1, int(self.ttl_s)))
        except Exception as exc:  # redis' errors, OSError: the store is down
            raise _unavailable(exc) from exc

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        try:
            raw = await self.client.get(KEY_PREFIX + response_id)
        except Exception as exc:
            raise _unavailable(exc) from exc
        if raw is None:
            return None
        record = StoredResponse.model_validate_json(raw)
        return record if record.owner == owner else None

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:
            return False
        try:
            return bool(await self.client.delete(KEY_PREFIX + response_id))
        except Exception as exc:
            raise _unavailable(exc) from exc


def make_response_store(redis: Redis | None, ttl_s: float) -> ResponseStore:
    """Redis when the gateway has one, else in process."""
    if redis is not None:
        return RedisResponseStore(redis, ttl_s)
    return InProcessResponseStore(ttl_s)
