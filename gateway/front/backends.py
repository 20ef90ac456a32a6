"""Which implementation of each shared service a front gateway's config picks: the fleet
store, the rate limiter, fair share's counts and the key store are Redis-backed when the
config names a Redis (on the one pool the gateway shares), else in process; the in-process
fleet store polls the configured nodes through the gateway's node client. The Redis modules
are imported only when used, so a gateway without Redis never loads them.
"""

from __future__ import annotations

import functools

from gateway.auth import Authenticator
from gateway.client_ip import ClientIPResolver
from gateway.fair_counts import FairCounts, InProcessFairCounts
from gateway.fair_queue import FairQueue
from gateway.front.config import GatewayConfig
from gateway.front.node_client import NodeClient
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import InProcessRateLimiter, RateLimiter
from routing.fleet.block_feed import BlockFeedPage
from routing.fleet.memory_store import InProcessFleetStore, OpenAINodeTracker
from routing.fleet.state import NodeState
from routing.fleet.store import FleetStore
from routing.redis_connect import RedisClient


def make_store(
    config: GatewayConfig,
    redis: RedisClient | None,
    trackers: list[OpenAINodeTracker],
    client: NodeClient,
) -> FleetStore:
    """The fleet store: Redis's when ``redis_url`` is set, else one polling ``config.nodes``."""
    if config.redis_url:
        from routing.fleet.redis_store import RedisFleetStore
        from routing.fleet.signing import RecordSigner

        token = config.node_token
        return RedisFleetStore(
            config.redis_url,
            openai_nodes=trackers,
            client=redis,
            signer=RecordSigner(token.get_secret_value()) if token else None,
            allowed_urls=config.allowed_node_urls,
        )
    return InProcessFleetStore(
        config.nodes,
        fetch_state=functools.partial(fetch_state, client),
        fetch_blocks=functools.partial(fetch_blocks, client),
        openai_nodes=trackers,
        poll_interval_s=config.poll_interval_s,
    )


def make_limiter(
    shared_url: str | None, redis: RedisClient | None, replicas: int, metrics: GatewayMetrics
) -> RateLimiter:
    """The rate limiter: in the shared Redis (``replicas`` admitting against the same limits),
    else in process."""
    if shared_url:
        from gateway.ratelimit import RedisRateLimiter

        return RedisRateLimiter(
            shared_url,
            client=redis,
            replicas=replicas,
            on_error=lambda _e: metrics.redis_error("ratelimit"),
        )
    return InProcessRateLimiter()


def make_fair(config: GatewayConfig, redis: RedisClient | None, replicas: int) -> FairQueue | None:
    """The fair queue, when fair share is on (:class:`gateway.fair_config.FairShareConfig`)."""
    fc = config.fair_share
    if not (fc.enabled if fc.enabled is not None else config.auth.is_enabled):
        return None
    counts: FairCounts = InProcessFairCounts()
    if redis is not None:
        from gateway.fair_redis import RedisFairCounts

        counts = RedisFairCounts(redis, replicas=replicas, lease_s=fc.lease_s)
    return FairQueue(counts, fc)


def make_auth(
    config: GatewayConfig, redis: RedisClient | None, client_ip: ClientIPResolver
) -> Authenticator:
    """The key check, with keys added at run time looked up in Redis when configured."""
    store = None
    if config.redis_url and config.auth.redis_keys:
        from gateway.key_store import RedisKeyStore

        store = RedisKeyStore(config.redis_url, client=redis)
    return Authenticator(
        config.auth,
        key_store=store,
        client_of=lambda scope: client_ip.from_scope(scope) or "",
    )


async def fetch_state(client: NodeClient, url: str) -> NodeState:
    """A node's ``/load``, for the in-process fleet store."""
    resp = await client.get(url.rstrip("/") + "/load", timeout=1.0)
    resp.raise_for_status()
    return NodeState.model_validate(resp.json())


async def fetch_blocks(client: NodeClient, url: str, epoch: str | None, seq: int) -> BlockFeedPage:
    """A node's prefix block events since ``seq`` (of ``epoch``), for the in-process store."""
    params: dict[str, str | int] = {"since": seq}
    if epoch is not None:
        params["epoch"] = epoch
    resp = await client.get(url.rstrip("/") + "/prefix/events", params=params, timeout=1.0)
    resp.raise_for_status()
    return BlockFeedPage.from_json(resp.json())
