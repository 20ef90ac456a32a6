"""The API key store: :class:`RedisKeyStore` looks keys up by hash in Redis
(``edgecloud:v1:apikey:{key_hash}``, one hash per key) so that keys can be added without a
gateway restart; :class:`KeyRecord` is a key's stored identity and limits (never the key
itself), and every store call is one round trip that raises :class:`KeyStoreUnavailable` when
Redis is down.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.fleet.store import KEY_PREFIX
from routing.redis_connect import RedisClient
from routing.redis_link import REDIS_ERRORS, redis_client


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """An API key's identity and limits, as stored (the key itself is never stored)."""

    name: str
    rpm: int | None = None
    tpm: int | None = None
    team: str | None = None  # keys of one team may share a cache scope (``cache_scope: team``)
    weight: float = 1.0  # fair share (``gateway.fair_share``)
    max_concurrent: int | None = None
    max_tokens_default: int | None = None
    max_tokens_limit: int | None = None


class KeyStoreUnavailable(ConnectionError):
    """The key store could not be reached."""


def _opt_int(raw: str | None) -> int | None:
    return int(raw) if raw not in (None, "") else None


class RedisKeyStore:
    """API keys by hash: ``edgecloud:v1:apikey:{key_hash}`` -> hash {name, rpm, tpm, team,
    weight, max_concurrent, max_tokens_default, max_tokens_limit} (empty: unset).

    Every method is one round trip and raises :class:`KeyStoreUnavailable` when Redis is down.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = KEY_PREFIX,
        timeout_s: float = 0.25,
        client: RedisClient | None = None,
    ) -> None:
        self.ns = namespace
        self.redis: RedisClient = client or redis_client(url, timeout_s=timeout_s)

    def key(self, key_hash: str) -> str:
        return f"{self.ns}apikey:{key_hash}"

    async def get(self, key_hash: str) -> KeyRecord | None:
        try:
            raw = await self.redis.hgetall(self.key(key_hash))
        except REDIS_ERRORS as exc:
            raise KeyStoreUnavailable(f"key store unreachable: {exc}") from exc
        if not raw or "name" not in raw:
            return None
        return KeyRecord(
            name=raw["name"],
            rpm=_opt_int(raw.get("rpm")),
            tpm=_opt_int(raw.get("tpm")),
            team=raw.get("team") or None,
            weight=float(raw.get("weight") or 1.0),
            max_concurrent=_opt_int(raw.get("max_concurrent")),
            max_tokens_default=_opt_int(raw.get("max_tokens_default")),
            max_tokens_limit=_opt_int(raw.get("max_tokens_limit")),
        )

    async def put(self, key_hash: str, record: KeyRecord) -> None:
        mapping = {
            "name": record.name,
            "rpm": record.rpm or "",
            "tpm": record.tpm or "",
            "team": record.team or "",
            "weight": repr(float(record.weight)),
            "max_concurrent": record.max_concurrent or "",
            "max_tokens_default": record.max_tokens_default or "",
            "max_tokens_limit": record.max_tokens_limit or "",
        }
        try:  # every field at once: one command on one key, so atomic on a cluster too
            await self.redis.hset(self.key(key_hash), mapping=mapping)
        except REDIS_ERRORS as exc:
            raise KeyStoreUnavailable(f"key store unreachable: {exc}") from exc

    async def delete(self, key_hash: str) -> bool:
        try:
            return bool(await self.redis.delete(self.key(key_hash)))
        except REDIS_ERRORS as exc:
            raise KeyStoreUnavailable(f"key store unreachable: {exc}") from exc

    async def close(self) -> None:
        await self.redis.aclose()
