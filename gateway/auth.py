"""API keys: hashed at rest, checked on every request; the admin key is a separate one.

Invariants:
- Keys are never stored or logged, only ``hash_key(key, salt)``: ``hmac-sha256:<hex>``, an
  HMAC-SHA256 of the key under a per-deployment secret salt. Keys made by :func:`generate_key`
  carry 256 random bits, so a fast keyed hash is as strong as a slow one, and keeps the check
  at a few microseconds on the hot path. The presented key's digest is looked up by value and
  then compared with :func:`hmac.compare_digest`; timing can only reveal digests, which cannot
  be computed without the salt.
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
- Weak secrets are refused when the config is loaded: with authentication on and any key
  configured, the salt must have at least :data:`MIN_SECRET_CHARS` characters, and no key (user
  or admin) may be one of :data:`WEAK_KEYS` (checked by hashing them with the salt; the keys
  themselves are never in the config).
- Node token (gateway -> nodes): nodes given one (``--node-token``/``$EDGECLOUD_NODE_TOKEN``)
  answer 401 to any request without it in ``X-Edgecloud-Node-Token`` (or ``Authorization:
  Bearer``), except ``GET /health`` (liveness); compared with :func:`secrets.compare_digest`,
  never logged (:class:`NodeTokenMiddleware`).
- Redis lookups are cached per key hash for ``cache_ttl_s`` (unknown keys for
  ``negative_cache_ttl_s``), in a bounded LRU, so a flood of bad keys cannot flood Redis.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.auth_throttle import FailedAuthThrottle, is_auth_failure
from gateway.errors import APIError, too_many_requests
from gateway.ratelimit import KeyRecord, KeyStoreUnavailable, Limits, RateDecision, RateLimiter

KEY_PREFIX = "sk-ec-"
HASH_SCHEME = "hmac-sha256"
_HASH_RE = re.compile(rf"^{HASH_SCHEME}:[0-9a-f]{{64}}$")

MIN_SECRET_CHARS = 16
# Keys refused whatever the salt (the config holds hashes only: these are hashed and compared).
WEAK_KEYS: tuple[str, ...] = (
    "", "admin", "administrator", "root", "password", "passw0rd", "secret", "changeme",
    "change-me", "default", "test", "testing", "demo", "key", "apikey", "api-key", "api_key",
    "token", "letmein", "qwerty", "guest", "user", "1234", "12345", "123456", "12345678",
    "123456789", "0000", "sk-", KEY_PREFIX, "sk-ec-test", "sk-test", "none", "null",
)  # fmt: skip
NODE_TOKEN_ENV = "EDGECLOUD_NODE_TOKEN"
NODE_TOKEN_HEADER = "x-edgecloud-node-token"


def generate_key() -> str:
    """A new API key: ``sk-ec-`` and 43 URL-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str, salt: str) -> str:
    """The stored form of ``key`` under this deployment's ``salt`` (``hmac-sha256:<hex>``)."""
    digest = hmac.new(salt.encode(), key.encode(), hashlib.sha256).hexdigest()
    return f"{HASH_SCHEME}:{digest}"


def _valid_hash(v: str) -> str:
    v = v.strip().lower()
    if not _HASH_RE.match(v):
        raise ValueError(f"key_hash must look like '{HASH_SCHEME}:<64 hex digits>' (see hash_key)")
    return v


# ---- config ------------------------------------------------------------------------------------
class ApiKeyEntry(BaseModel):
    """One user key in the config: ``{name, key_hash, rpm, tpm, team}`` (limits: None =
    default; ``team``: keys sharing a cache scope under ``cache_scope: team``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    key_hash: str
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    team: str | None = Field(default=None, min_length=1)

    @field_validator("key_hash")
    @classmethod
    def _check_hash(cls, v: str) -> str:
        return _valid_hash(v)


class AdminKeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    key_hash: str

    @field_validator("key_hash")
    @classmethod
    def _check_hash(cls, v: str) -> str:
        return _valid_hash(v)


class AuthConfig(BaseModel):
    """The ``auth`` section of the gateway config.

    Example::

        auth:
          salt: "a long random per-deployment secret"
          default_rpm: 600
          keys:
            - {name: alice, key_hash: "hmac-sha256:3f...", rpm: 60, tpm: 100000}
          admin_keys:
            - {name: ops, key_hash: "hmac-sha256:9a..."}
          redis_keys: true
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = Field(default=None, description="unset: on iff any key is configured")
    salt: SecretStr = Field(default=SecretStr(""), description="per-deployment secret")
    keys: list[ApiKeyEntry] = Field(default_factory=list)
    admin_keys: list[AdminKeyEntry] = Field(default_factory=list)
    redis_keys: bool = Field(default=False, description="also accept keys from the Redis store")
    default_rpm: int | None = Field(default=None, ge=1, description="for keys naming none")
    default_tpm: int | None = Field(default=None, ge=1)
    cache_ttl_s: float = Field(default=30.0, ge=0)
    negative_cache_ttl_s: float = Field(default=5.0, ge=0)
    cache_size: int = Field(default=10_000, ge=1)
    failed_auth_per_minute: int = Field(
        default=30,
        ge=1,
        description="failed key checks one client address may make a minute (a burst of "
        "this many); past it the address gets 429 before its key is checked",
    )

    @model_validator(mode="after")
    def _unique(self) -> AuthConfig:
        names = [k.name for k in self.keys]
        if len(names) != len(set(names)):
            raise ValueError("auth.keys: names must be unique (they name the rate-limit buckets)")
        hashes = [k.key_hash for k in self.keys] + [k.key_hash for k in self.admin_keys]
        if len(hashes) != len(set(hashes)):
            raise ValueError("auth: the same key_hash appears twice")
        return self

    @model_validator(mode="after")
    def _strong(self) -> AuthConfig:
        """Weak secrets are refused (see the module invariants)."""
        if not self.is_enabled or not (self.keys or self.admin_keys or self.redis_keys):
            return self
        salt = self.salt.get_secret_value()
        if len(salt) < MIN_SECRET_CHARS:
            raise ValueError(
                f"auth.salt must have at least {MIN_SECRET_CHARS} characters (got {len(salt)}): "
                "use a long random secret, e.g. python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))'"
            )
        weak = {hash_key(w, salt): w for w in WEAK_KEYS}
        for section, entries in (("keys", self.keys), ("admin_keys", self.admin_keys)):
            for k in entries:
                if k.key_hash in weak:
                    raise ValueError(
                        f"auth.{section}: key {k.name!r} is a well-known weak key; make one "
                        "with gateway.auth.generate_key()"
                    )
        return self

    @property
    def is_enabled(self) -> bool:
        if self.enabled is not None:
            return self.enabled
        return bool(self.keys or self.admin_keys or self.redis_keys)


# ---- identity ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KeyIdentity:
    """Who is calling: ``key_id`` names the rate-limit bucket (the key's name); ``team``
    the group of keys it belongs to (None: its own)."""

    name: str
    limits: Limits = field(default_factory=Limits)
    source: str = "config"  # config | redis | anonymous | admin
    admin: bool = False
    team: str | None = None

    @property
    def key_id(self) -> str:
        return self.name


class KeyLookup(Protocol):
    """A store of keys by hash (``gateway.ratelimit.RedisKeyStore`` fits)."""

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


def check_node_token(token: str) -> str:
    """The token, if strong enough to share between gateway and nodes; else ValueError."""
    if len(token) < MIN_SECRET_CHARS or token.lower() in WEAK_KEYS:
        raise ValueError(
            f"the node token must have at least {MIN_SECRET_CHARS} characters and not be a "
            "well-known word (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
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


class NodeTokenMiddleware:
    """ASGI middleware of a node: every HTTP request but ``GET /health`` must carry the node
    token (``X-Edgecloud-Node-Token: <token>`` or ``Authorization: Bearer <token>``), else it
    gets an OpenAI-shaped 401 (``code: invalid_node_token``). Constant-time comparison; the
    token is never logged or echoed."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._token = check_node_token(token).encode()
        self._bearer = b"bearer " + self._token

    def _ok(self, scope: Scope) -> bool:
        ok = False
        for name, value in scope.get("headers") or ():
            if name == NODE_TOKEN_HEADER.encode():
                ok |= secrets.compare_digest(value, self._token)
            elif name == b"authorization":
                v = value.strip()
                ok |= secrets.compare_digest(v[:7].lower() + v[7:], self._bearer)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or (scope.get("method") == "GET" and scope.get("path") == "/health")
            or self._ok(scope)
        ):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {
                "error": {
                    "message": "This node needs the node token (X-Edgecloud-Node-Token).",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_node_token",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


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


# ---- limits ------------------------------------------------------------------------------------
async def enforce_rate_limit(
    limiter: RateLimiter,
    identity: KeyIdentity,
    tokens: int,
    on_limited: Callable[[str], None] | None = None,
) -> RateDecision:
    """Charge the identity's buckets for one request of ``tokens`` estimated tokens.

    Returns the decision (keep it for ``limiter.settle``) or raises the 429 :class:`APIError`
    with ``Retry-After``; ``on_limited(limited_by)`` is called first (a metrics counter).
    """
    decision = await limiter.acquire(identity.key_id, identity.limits, tokens)
    if decision.allowed:
        return decision
    why = decision.limited_by or "requests"
    if on_limited is not None:
        on_limited(why)
    lim = identity.limits
    if why == "too_large":
        msg = (
            f"Request too large: it needs up to {tokens} tokens (prompt + max_tokens), above "
            f"this key's limit of {lim.tpm} tokens per minute. Lower max_tokens or the prompt."
        )
    elif why == "tokens":
        msg = f"Rate limit reached: {lim.tpm} tokens per minute for this key."
    else:
        msg = f"Rate limit reached: {lim.rpm} requests per minute for this key."
    err = too_many_requests(
        f"{msg} Retry after {decision.retry_after_s:.1f} s.", decision.retry_after_s
    )
    err.headers.update(rate_limit_headers(decision))
    raise err


def rate_limit_headers(decision: RateDecision) -> dict[str, str]:
    """OpenAI-style ``x-ratelimit-*`` headers for the limits a decision saw."""
    out: dict[str, str] = {}
    lim = decision.limits
    if lim.rpm is not None and decision.remaining_requests is not None:
        out["x-ratelimit-limit-requests"] = str(lim.rpm)
        out["x-ratelimit-remaining-requests"] = str(max(0, int(decision.remaining_requests)))
    if lim.tpm is not None and decision.remaining_tokens is not None:
        out["x-ratelimit-limit-tokens"] = str(lim.tpm)
        out["x-ratelimit-remaining-tokens"] = str(max(0, int(decision.remaining_tokens)))
    return out
