"""API keys (hashed, 401/403 OpenAI-shaped) and per-key rate limits in Redis and in-process."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI
from redis.asyncio import Redis

from gateway.auth import (
    AuthConfig,
    Authenticator,
    KeyIdentity,
    enforce_rate_limit,
    generate_key,
    hash_key,
    rate_limit_headers,
)
from gateway.errors import install_error_handlers
from gateway.key_store import KeyRecord, KeyStoreUnavailable, RedisKeyStore
from gateway.ratelimit import (
    InProcessRateLimiter,
    Limits,
    RateLimiter,
    RedisRateLimiter,
)

SALT = "test-deployment-salt"
ALICE = generate_key()
BOB = generate_key()
ADMIN = generate_key()


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def auth_config(**kw: Any) -> AuthConfig:
    base: dict[str, Any] = {
        "salt": SALT,
        "keys": [
            {"name": "alice", "key_hash": hash_key(ALICE, SALT), "rpm": 2, "tpm": 1000},
            {"name": "bob", "key_hash": hash_key(BOB, SALT)},
        ],
        "admin_keys": [{"name": "ops", "key_hash": hash_key(ADMIN, SALT)}],
        "default_rpm": 100,
    }
    base.update(kw)
    return AuthConfig.model_validate(base)


def make_app(auth: Authenticator, limiter: RateLimiter | None = None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    limiter = limiter or InProcessRateLimiter()

    @app.get("/v1/whoami")
    async def whoami(who: KeyIdentity = Depends(auth)) -> dict[str, Any]:
        return {"name": who.name, "rpm": who.limits.rpm, "tpm": who.limits.tpm}

    @app.post("/v1/spend/{tokens}")
    async def spend(tokens: int, who: KeyIdentity = Depends(auth)) -> dict[str, Any]:
        decision = await enforce_rate_limit(limiter, who, tokens)
        return {"ok": True, "headers": rate_limit_headers(decision)}

    @app.get("/admin/nodes")
    async def admin(who: KeyIdentity = Depends(auth.require_admin)) -> dict[str, str]:
        return {"admin": who.name}

    return app


@pytest.fixture
async def client_for() -> AsyncIterator[Callable[[FastAPI], httpx.AsyncClient]]:
    clients: list[httpx.AsyncClient] = []

    def make(app: FastAPI) -> httpx.AsyncClient:
        c = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.aclose()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- keys --------------------------------------------------------------------------------------
def test_hash_and_generate() -> None:
    k = generate_key()
    assert k.startswith("sk-ec-") and len(k) == 6 + 43
    assert generate_key() != k
    h = hash_key(k, SALT)
    assert h == hash_key(k, SALT)
    assert h.startswith("hmac-sha256:") and len(h) == len("hmac-sha256:") + 64
    assert hash_key(k, "another-salt") != h
    assert k not in h


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="key_hash must look like"):
        AuthConfig.model_validate({"keys": [{"name": "a", "key_hash": "plaintext-key"}]})
    dup = {"name": "a", "key_hash": hash_key("x", SALT)}
    with pytest.raises(ValueError, match="names must be unique"):
        AuthConfig.model_validate({"keys": [dup, {**dup, "key_hash": hash_key("y", SALT)}]})
    assert AuthConfig().is_enabled is False
    assert auth_config().is_enabled is True
    assert auth_config(enabled=False).is_enabled is False
    assert "test-deployment-salt" not in repr(auth_config())


async def test_missing_bad_and_good_keys(
    client_for: Callable[[FastAPI], httpx.AsyncClient],
) -> None:
    client = client_for(make_app(Authenticator(auth_config())))
    for headers in ({}, bearer("sk-ec-wrong"), {"Authorization": f"Basic {ALICE}"}, bearer("")):
        resp = await client.get("/v1/whoami", headers=headers)
        assert resp.status_code == 401, headers
        err = resp.json()["error"]
        assert err["code"] == "invalid_api_key"
        assert err["type"] == "invalid_request_error"
        assert resp.headers["www-authenticate"] == "Bearer"
        assert "sk-ec-wrong" not in resp.text
    resp = await client.get("/v1/whoami", headers=bearer(ALICE))
    assert resp.status_code == 200
    assert resp.json() == {"name": "alice", "rpm": 2, "tpm": 1000}
    resp = await client.get("/v1/whoami", headers={"authorization": f"bearer  {BOB} "})
    assert resp.json() == {"name": "bob", "rpm": 100, "tpm": None}  # default limits


async def test_admin_key_is_separate(client_for: Callable[[FastAPI], httpx.AsyncClient]) -> None:
    client = client_for(make_app(Authenticator(auth_config())))
    assert (await client.get("/admin/nodes")).status_code == 401
    resp = await client.get("/admin/nodes", headers=bearer(ALICE))
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    resp = await client.get("/admin/nodes", headers=bearer(ADMIN))
    assert resp.status_code == 200 and resp.json() == {"admin": "ops"}
    # The admin key is not a user key.
    assert (await client.get("/v1/whoami", headers=bearer(ADMIN))).status_code == 401
    # Keys configured but no admin key: the admin API is off.
    no_admin = client_for(make_app(Authenticator(auth_config(admin_keys=[]))))
    resp = await no_admin.get("/admin/nodes", headers=bearer(ALICE))
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "admin_disabled"


async def test_auth_disabled_is_open(client_for: Callable[[FastAPI], httpx.AsyncClient]) -> None:
    client = client_for(make_app(Authenticator(AuthConfig(default_tpm=5000))))
    resp = await client.get("/v1/whoami")
    assert resp.json() == {"name": "anonymous", "rpm": None, "tpm": 5000}
    assert (await client.get("/v1/whoami", headers=bearer("anything"))).status_code == 200
    assert (await client.get("/admin/nodes")).status_code == 200


async def test_keys_from_redis_with_cache(
    redis_url: str, client_for: Callable[[FastAPI], httpx.AsyncClient]
) -> None:
    ns = f"edgecloud:test-{uuid.uuid4().hex[:8]}:"
    store = RedisKeyStore(redis_url, namespace=ns)
    carol = generate_key()
    digest = hash_key(carol, SALT)
    await store.put(digest, KeyRecord("carol", rpm=7))
    assert await store.get(digest) == KeyRecord("carol", rpm=7, tpm=None)
    clock = FakeClock()
    auth = Authenticator(auth_config(redis_keys=True, cache_ttl_s=30), store, clock=clock)
    client = client_for(make_app(auth))
    resp = await client.get("/v1/whoami", headers=bearer(carol))
    assert resp.json() == {"name": "carol", "rpm": 7, "tpm": None}
    assert (await client.get("/v1/whoami", headers=bearer(ALICE))).status_code == 200
    assert (await client.get("/v1/whoami", headers=bearer("sk-ec-nope"))).status_code == 401
    # Revoked in Redis: still cached for cache_ttl_s, then refused.
    assert await store.delete(digest)
    assert (await client.get("/v1/whoami", headers=bearer(carol))).status_code == 200
    clock.t += 31
    assert (await client.get("/v1/whoami", headers=bearer(carol))).status_code == 401
    await store.close()


class DownStore:
    def __init__(self) -> None:
        self.record: KeyRecord | None = KeyRecord("dave")
        self.down = False

    async def get(self, key_hash: str) -> KeyRecord | None:
        if self.down:
            raise KeyStoreUnavailable("connection refused")
        return self.record


async def test_key_store_outage(client_for: Callable[[FastAPI], httpx.AsyncClient]) -> None:
    clock, store = FakeClock(), DownStore()
    auth = Authenticator(auth_config(redis_keys=True), store, clock=clock)
    client = client_for(make_app(auth))
    dave = generate_key()
    assert (await client.get("/v1/whoami", headers=bearer(dave))).status_code == 200
    store.down = True
    clock.t += 3600  # the cache entry is stale, but known good: keep serving it
    assert (await client.get("/v1/whoami", headers=bearer(dave))).json()["name"] == "dave"
    resp = await client.get("/v1/whoami", headers=bearer(generate_key()))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "auth_unavailable"
    # Config keys never need the store.
    assert (await client.get("/v1/whoami", headers=bearer(ALICE))).status_code == 200
    assert auth.store_errors == 2


# ---- rate limits: both implementations --------------------------------------------------------
@pytest.fixture(params=["memory", "redis"])
async def limiter_factory(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Callable[[], RateLimiter]]:
    made: list[RateLimiter] = []
    shared = InProcessRateLimiter()  # "two instances" in-process means the same process state

    def make() -> RateLimiter:
        if request.param == "memory":
            return shared
        redis_url = request.getfixturevalue("redis_url")
        lim = RedisRateLimiter(redis_url)
        made.append(lim)
        return lim

    yield make
    for lim in made:
        await lim.close()


def new_key() -> str:
    return f"k-{uuid.uuid4().hex[:12]}"


async def test_requests_per_minute(limiter_factory: Callable[[], RateLimiter]) -> None:
    lim, key, limits = limiter_factory(), new_key(), Limits(rpm=3)
    for _ in range(3):
        d = await lim.acquire(key, limits, 50)
        assert d.allowed and d.retry_after_s == 0
    refused = await lim.acquire(key, limits, 50)
    assert not refused.allowed
    assert refused.limited_by == "requests"
    assert 19.0 < refused.retry_after_s <= 20.0  # one request refills in 60/3 s
    assert refused.charged_tokens == 0
    assert refused.remaining_requests is not None and refused.remaining_requests < 1
    # Another key has its own bucket.
    assert (await lim.acquire(new_key(), limits, 50)).allowed


async def test_two_instances_share_the_budget(limiter_factory: Callable[[], RateLimiter]) -> None:
    a, b, key, limits = limiter_factory(), limiter_factory(), new_key(), Limits(rpm=4)
    assert (await a.acquire(key, limits, 1)).allowed
    assert (await b.acquire(key, limits, 1)).allowed
    assert (await a.acquire(key, limits, 1)).allowed
    assert (await b.acquire(key, limits, 1)).allowed
    assert not (await a.acquire(key, limits, 1)).allowed
    assert not (await b.acquire(key, limits, 1)).allowed


async def test_tokens_per_minute_settle_and_refund(
    limiter_factory: Callable[[], RateLimiter],
) -> None:
    lim, key, limits = limiter_factory(), new_key(), Limits(rpm=100, tpm=1000)
    first = await lim.acquire(key, limits, 600)
    assert first.allowed and first.charged_tokens == 600
    assert first.remaining_tokens == pytest.approx(400, abs=1)
    second = await lim.acquire(key, limits, 600)
    assert not second.allowed and second.limited_by == "tokens"
    assert 11.5 < second.retry_after_s <= 12.1  # 200 tokens at 1000/min
    # The first request used only 100 tokens: 500 come back, and 600 fit again.
    await lim.settle(first, 100)
    third = await lim.acquire(key, limits, 600)
    assert third.allowed
    # Using more than estimated charges the difference: the bucket goes into debt.
    await lim.settle(third, 1300)
    fourth = await lim.acquire(key, limits, 1)
    assert not fourth.allowed and fourth.limited_by == "tokens"
    assert fourth.remaining_tokens is not None and fourth.remaining_tokens < 0
    # A request larger than a minute's budget can never fit.
    big = await lim.acquire(new_key(), limits, 1001)
    assert not big.allowed and big.limited_by == "too_large" and big.retry_after_s > 0
    # refund gives back the request and all its tokens.
    k2, small = new_key(), Limits(rpm=1, tpm=500)
    d = await lim.acquire(k2, small, 500)
    assert d.allowed
    assert not (await lim.acquire(k2, small, 1)).allowed
    await lim.refund(d)
    assert (await lim.acquire(k2, small, 500)).allowed


async def test_unlimited_needs_no_bucket(limiter_factory: Callable[[], RateLimiter]) -> None:
    lim = limiter_factory()
    for _ in range(50):
        d = await lim.acquire("free", Limits(), 10**6)
        assert d.allowed and d.backend == "none"


async def test_redis_bucket_key_and_expiry(redis_url: str) -> None:
    lim, key = RedisRateLimiter(redis_url), new_key()
    d = await lim.acquire(key, Limits(rpm=10, tpm=600), 300)
    assert d.allowed and d.backend == "redis" and not d.degraded
    r = Redis.from_url(redis_url, decode_responses=True)
    bucket = f"edgecloud:v1:rl:{key}"
    fields = await r.hgetall(bucket)
    assert float(fields["r"]) == pytest.approx(9, abs=0.01)
    assert float(fields["t"]) == pytest.approx(300, abs=1)
    ttl = await r.pttl(bucket)
    assert 29_000 < ttl <= 31_000  # half the tokens bucket refills in 30 s (+1 s margin)
    await r.aclose()
    await lim.close()


async def test_in_process_refills_with_time() -> None:
    clock = FakeClock()
    lim, limits = InProcessRateLimiter(clock=clock), Limits(rpm=3, tpm=300)
    for _ in range(3):
        assert (await lim.acquire("k", limits, 10)).allowed
    refused = await lim.acquire("k", limits, 10)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(20, abs=0.01)
    clock.t += 19.9
    assert not (await lim.acquire("k", limits, 10)).allowed
    clock.t += 0.2
    assert (await lim.acquire("k", limits, 10)).allowed
    clock.t += 3600
    d = await lim.acquire("k", limits, 0)
    assert d.remaining_requests == pytest.approx(2) and d.remaining_tokens == pytest.approx(300)


# ---- Redis unreachable: fail open to in-process, then recover ---------------------------------
async def test_redis_down_fails_open_then_recovers(redis_server: Any, redis_url: str) -> None:
    errors: list[BaseException] = []
    lim = RedisRateLimiter(redis_url, retry_interval_s=0.0, on_error=errors.append)
    key, limits = new_key(), Limits(rpm=2)
    assert (await lim.acquire(key, limits, 1)).backend == "redis"
    redis_server.stop()
    try:
        d = await lim.acquire(key, limits, 1)
        assert d.allowed and d.degraded and d.backend == "local"
        health = lim.health()
        assert health["healthy"] is False and health["degraded"] is True
        assert health["errors_total"] >= 1 and errors
        # The in-process fallback still limits, from the level Redis last reported (1 of 2
        # left before the outage: the one request above took it, so the next is refused).
        refused = await lim.acquire(key, limits, 1)
        assert not refused.allowed and refused.degraded
        await lim.settle(d, 0)  # settles against the fallback that charged it
    finally:
        redis_server.start()
    for _ in range(20):  # the client reconnects by itself
        d = await lim.acquire(new_key(), limits, 1)
        if d.backend == "redis":
            break
        await asyncio.sleep(0.05)
    assert d.backend == "redis" and not d.degraded
    assert lim.health()["healthy"] is True
    await lim.close()


async def test_unreachable_redis_never_blocks() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nothing listens on it
    lim = RedisRateLimiter(f"redis://127.0.0.1:{port}/0", retry_interval_s=60)
    d = await lim.acquire("k", Limits(rpm=1), 1)
    assert d.allowed and d.degraded
    assert not (await lim.acquire("k", Limits(rpm=1), 1)).allowed  # fallback, no new connect
    assert lim.health()["errors_total"] == 1
    await lim.close()


# ---- 429 through an app ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_429_with_retry_after(
    backend: str,
    request: pytest.FixtureRequest,
    client_for: Callable[[FastAPI], httpx.AsyncClient],
) -> None:
    if backend == "redis":
        redis_url = request.getfixturevalue("redis_url")
        ns = f"edgecloud:test-{uuid.uuid4().hex[:8]}:"
        limiter: RateLimiter = RedisRateLimiter(redis_url, namespace=ns)
    else:
        limiter = InProcessRateLimiter()
    client = client_for(make_app(Authenticator(auth_config()), limiter))
    ok = await client.post("/v1/spend/100", headers=bearer(ALICE))
    assert ok.status_code == 200
    assert ok.json()["headers"]["x-ratelimit-remaining-requests"] == "1"
    too_big = await client.post("/v1/spend/5000", headers=bearer(ALICE))
    assert too_big.status_code == 429 and "too large" in too_big.json()["error"]["message"]
    assert (await client.post("/v1/spend/100", headers=bearer(ALICE))).status_code == 200
    resp = await client.post("/v1/spend/100", headers=bearer(ALICE))  # 3rd in a minute; rpm=2
    assert resp.status_code == 429
    assert resp.json()["error"]["code"] == "rate_limit_exceeded"
    assert resp.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(resp.headers["retry-after"]) <= 30
    assert resp.headers["x-ratelimit-limit-requests"] == "2"
    # Bob has his own budget.
    assert (await client.post("/v1/spend/100", headers=bearer(BOB))).status_code == 200
    await limiter.close()
