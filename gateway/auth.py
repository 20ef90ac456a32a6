"""API keys checked on every request; the admin key is a separate one.

Key storage and hashing are in :mod:`gateway.api_keys`, the config section in
:mod:`gateway.auth_config`, weak-secret checks in :mod:`gateway.secret_strength`, the node
token in :mod:`gateway.node_token`, failed-auth throttling in :mod:`gateway.auth_throttle` and
rate-limit charging in :mod:`gateway.key_limits`.

Invariants:
- The presented key's digest (``hash_key(key, salt)``) is looked up by value and then compared
  with :func:`hmac.compare_digest`; timing can only reveal digests, which cannot be computed
  without the salt. Keys are never stored or logged.
- Authentication is on when ``auth.enabled`` says so, or (when it is unset) as soon as any key
  is configured or Redis keys are enabled. With it off every request gets the ``anonymous``
  identity with the default limits: the embedded default, open on loopback.
- A missing or wrong key is a 401 with an OpenAI-shaped body (``code: invalid_api_key``) and
  ``WWW-Authenticate: Bearer``; the key is never echoed. If the Redis key store is unreachable,
  keys seen recently keep working from the cache; an unknown key gets a 503, never a 401 (its
  owner did nothing wrong) and never a 500.
- Admin endpoints need one of ``admin_keys``; a user key is not an admin key. With no admin key
  configured the admin API answers 403 while authentication is on; while it is off, it is
  served to *local* callers only (:func:`is_local`: a loopback peer, and no
  ``X-Forwarded-For``/``Forwarded`` header, so a reverse proxy on the same host does not make
  the world local), others get 403.
- Redis lookups are cached per key hash for ``cache_ttl_s`` (unknown keys for
  ``negative_cache_ttl_s``), in a bounded LRU, so a flood of bad keys cannot flood Redis.
"""

from __future__ import annotations

import hmac
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from starlette.types import Scope

from gateway.api_keys import generate_key, hash_key
from gateway.auth_config import AuthConfig
from gateway.auth_throttle import FailedAuthThrottle, is_auth_failure
from gateway.errors import APIError
from gateway.key_limits import enforce_rate_limit, rate_limit_headers
from gateway.key_store import KeyRecord, KeyStoreUnavailable
from gateway.ratelimit import Limits

# Kept importable from here (documented: ``from gateway.auth import generate_key, hash_key``).
__all__ = [
    "AuthConfig",
    "Authenticator",
    "KeyIdentity",
    "bearer_token",
    "enforce_rate_limit",
    "generate_key",
    "hash_key",
    "invalid_api_key",
    "is_local",
    "rate_limit_headers",
]


# ---- identity ----
@dataclass(frozen=True, slots=True)
class KeyIdentity:
    """Who is calling: ``key_id`` names the rate-limit bucket (the key's name); ``team``
    the group of keys it belongs to (None: its own); ``weight`` and ``max_concurrent`` its
    fair-share terms (:mod:`gateway.fair_share`); ``max_tokens_default`` the ``max_tokens``
    its requests get when they name none, ``max_tokens_limit`` the most they may ask for."""

    name: str
    limits: Limits = field(default_factory=Limits)
    source: str = "config"  # config | redis | anonymous | admin
    admin: bool = False
    team: str | None = None
    weight: float = 1.0
    max_concurrent: int | None = None
    max_tokens_default: int | None = None
    max_tokens_limit: int | None = None

    @property
    def key_id(self) -> str:
        return self.name


class KeyLookup(Protocol):
    """A store of keys by hash (``gateway.key_store.RedisKeyStore`` fits)."""

    async def get(self, key_hash: str) -> KeyRecord | None: ...


def invalid_api_key(message: str) -> APIError:
    return APIError(
        401,
        message,
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def bearer_token(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (scheme case-insensitive), or None."""
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


_FORWARDED = (b"x-forwarded-for", b"forwarded", b"x-real-ip")


def is_local(scope: Scope) -> bool:
    """True when the request comes from this machine itself: its socket peer is a loopback
    address and it carries no forwarding header (a proxy on the same host forwards others'
    requests; a client adding such a header only loses the privilege, never gains it)."""
    client = scope.get("client")
    if not client:
        return False
    try:
        if not ipaddress.ip_address(client[0]).is_loopback:
            return False
    except ValueError:
        return False
    return not any(name in _FORWARDED for name, _ in scope.get("headers") or ())


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    return client[0] if client else ""


class Authenticator:
    """Checks API keys. Use the instance as a FastAPI dependency for user routes
    (``Depends(auth)``) and :meth:`require_admin` for admin routes.
    """

    def __init__(
        self,
        config: AuthConfig,
        key_store: KeyLookup | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        client_of: Callable[[Scope], str] | None = None,
    ) -> None:
        self.config = config
        self.throttle = FailedAuthThrottle(config.failed_auth_per_minute, clock=clock)
        self._client_of = client_of or _peer
        self.enabled = config.is_enabled
        self._salt = config.salt.get_secret_value()
        self._store = key_store if config.redis_keys else None
        self._clock = clock
        default = Limits(config.default_rpm, config.default_tpm)
        self.anonymous = KeyIdentity("anonymous", default, source="anonymous")
        self._keys: dict[str, tuple[str, KeyIdentity]] = {
            k.key_hash: (
                k.key_hash,
                KeyIdentity(
                    k.name,
                    Limits(
                        k.rpm if k.rpm is not None else config.default_rpm,
                        k.tpm if k.tpm is not None else config.default_tpm,
                    ),
                    team=k.team,
                    weight=k.weight,
                    max_concurrent=k.max_concurrent,
                    max_tokens_default=k.max_tokens_default,
                    max_tokens_limit=k.max_tokens_limit,
                ),
            )
            for k in config.keys
        }
        self._admin: dict[str, tuple[str, KeyIdentity]] = {
            k.key_hash: (k.key_hash, KeyIdentity(k.name, Limits(), source="admin", admin=True))
            for k in config.admin_keys
        }
        # key hash -> (expires at, identity or None for "unknown")
        self._cache: OrderedDict[str, tuple[float, KeyIdentity | None]] = OrderedDict()
        self.store_errors = 0

    # ---- lookups -----------------------------------------------------------------------------
    @staticmethod
    def _match(table: dict[str, tuple[str, KeyIdentity]], digest: str) -> KeyIdentity | None:
        found = table.get(digest)
        if found is None:
            return None
        stored, ident = found
        return ident if hmac.compare_digest(stored, digest) else None

    def _cache_put(self, digest: str, ident: KeyIdentity | None) -> None:
        ttl = self.config.cache_ttl_s if ident else self.config.negative_cache_ttl_s
        self._cache[digest] = (self._clock() + ttl, ident)
        self._cache.move_to_end(digest)
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)

    async def _from_store(self, digest: str) -> KeyIdentity | None:
        assert self._store is not None
        cached = self._cache.get(digest)
        now = self._clock()
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            rec = await self._store.get(digest)
        except KeyStoreUnavailable as exc:
            self.store_errors += 1
            if cached is not None and cached[1] is not None:
                return cached[1]  # stale but known good: keep serving it
            raise APIError(
                503,
                "The API key could not be checked right now; please retry.",
                type_="server_error",
                code="auth_unavailable",
                headers={"Retry-After": "1"},
            ) from exc
        ident = None
        if rec is not None:
            ident = KeyIdentity(
                rec.name,
                Limits(
                    rec.rpm if rec.rpm is not None else self.config.default_rpm,
                    rec.tpm if rec.tpm is not None else self.config.default_tpm,
                ),
                source="redis",
                team=rec.team,
                weight=rec.weight,
                max_concurrent=rec.max_concurrent,
                max_tokens_default=rec.max_tokens_default,
                max_tokens_limit=rec.max_tokens_limit,
            )
        self._cache_put(digest, ident)
        return ident

    async def identify(self, token: str | None) -> KeyIdentity:
        """The identity for a presented key; raises the 401 (or 503) :class:`APIError`."""
        if not self.enabled:
            return self.anonymous
        if token is None:
            raise invalid_api_key(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
            )
        digest = hash_key(token, self._salt)
        ident = self._match(self._keys, digest)
        if ident is None and self._store is not None:
            ident = await self._from_store(digest)
        if ident is None:
            raise invalid_api_key("Incorrect API key provided.")
        return ident

    async def identify_admin(self, token: str | None, *, local: bool = False) -> KeyIdentity:
        """The admin identity for a presented key; 401 for any other key, 403 if no admin key
        is configured while authentication is on, or (auth off) for a caller not ``local``."""
        if not self._admin:
            if not self.enabled:
                if local:
                    return KeyIdentity("anonymous-admin", Limits(), source="anonymous", admin=True)
                raise APIError(
                    403,
                    "With authentication off the admin API is served on loopback only.",
                    type_="permission_error",
                    code="admin_loopback_only",
                )
            raise APIError(
                403,
                "The admin API is disabled: configure auth.admin_keys.",
                type_="permission_error",
                code="admin_disabled",
            )
        if token is None:
            raise invalid_api_key("This endpoint needs the admin key.")
        ident = self._match(self._admin, hash_key(token, self._salt))
        if ident is None:
            raise invalid_api_key("Incorrect admin key provided.")
        return ident

    # ---- FastAPI dependencies ----------------------------------------------------------------
    async def __call__(self, request: Request) -> KeyIdentity:
        """The caller's identity; a client address past its failed checks gets a 429 first
        (:mod:`gateway.auth_throttle`), and every 401 counts against it."""
        if not self.enabled:
            return self.anonymous
        addr = self._client_of(request.scope)
        self.throttle.check(addr)
        try:
            return await self.identify(bearer_token(request))
        except APIError as exc:
            if is_auth_failure(exc):
                self.throttle.failed(addr)
            raise

    async def require_admin(self, request: Request) -> KeyIdentity:
        """The caller's admin identity, throttled as :meth:`__call__` is."""
        addr = self._client_of(request.scope)
        self.throttle.check(addr)
        try:
            return await self.identify_admin(bearer_token(request), local=is_local(request.scope))
        except APIError as exc:
            if is_auth_failure(exc):
                self.throttle.failed(addr)
            raise

    async def admin_or_none(self, request: Request) -> KeyIdentity | None:
        """The caller's admin identity if it has one (never raises, counts no failure: a
        user key here is not a wrong key): an admin key, or, with authentication off and no
        admin key configured, a local caller."""
        try:
            return await self.identify_admin(bearer_token(request), local=is_local(request.scope))
        except APIError:
            return None
