"""A redis-py client for Redis as an operator runs it: one server, Sentinel, or Cluster.

Which deployment a URL names (:func:`parse_redis_url`):

- ``redis://[user:password@]host:port/db`` and ``rediss://...`` (TLS): one server (standalone).
- ``redis+sentinel://[user:password@]s1:26379,s2:26379/service[/db]`` and
  ``rediss+sentinel://...``: the primary that the Sentinels at ``s1``, ``s2``, ... name for
  ``service`` (the Sentinels' own password, if they have one, comes from
  ``$EDGECLOUD_REDIS_SENTINEL_PASSWORD``; TLS, with ``rediss+``, applies to both).
- ``redis+cluster://[user:password@]n1:6379,n2:6379`` and ``rediss+cluster://...``: a Redis
  Cluster reached through those seed nodes (database 0 only).

The URL alone says which: no other setting names the deployment.

Every client follows the rules of :mod:`routing.redis_link`: short timeouts and no retries of
its own, so a lost server costs a command one timeout and the caller degrades. What each shape
does on a failover:

- Sentinel (:class:`redis.asyncio.sentinel.Sentinel` with a blocking pool): a connection asks the
  Sentinels for the primary when it connects; a command on a demoted or dead primary fails once
  (redis-py closes that connection), and the next connection goes to the new primary.
- Cluster (:class:`redis.asyncio.cluster.RedisCluster`): MOVED redirections are followed (a
  manual failover moves slots without an error); a command on a dead primary fails, and the
  client refreshes its slot map before a later command. Its connections are per primary, up to
  ``max_connections`` each; past that a command fails at once instead of waiting.

Passwords come from the URL or, better, ``$EDGECLOUD_REDIS_PASSWORD`` (and
``$EDGECLOUD_REDIS_USERNAME``); TLS checks certificates against the system CAs or
``$EDGECLOUD_REDIS_CA_CERTS``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias
from urllib.parse import unquote

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

RedisClient: TypeAlias = "Redis | RedisCluster"
Shape = Literal["standalone", "sentinel", "cluster"]

PASSWORD_ENV = "EDGECLOUD_REDIS_PASSWORD"
USERNAME_ENV = "EDGECLOUD_REDIS_USERNAME"
SENTINEL_PASSWORD_ENV = "EDGECLOUD_REDIS_SENTINEL_PASSWORD"
CA_CERTS_ENV = "EDGECLOUD_REDIS_CA_CERTS"
SCHEMES = (
    "redis://",
    "rediss://",
    "redis+sentinel://",
    "rediss+sentinel://",
    "redis+cluster://",
    "rediss+cluster://",
)


class RedisUrlError(ValueError):
    """A Redis URL that names no deployment this client can reach."""


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where Redis is: the parsed URL (no password in its repr)."""

    shape: Shape
    hosts: tuple[tuple[str, int], ...]  # the server, the Sentinels, or the cluster's seeds
    tls: bool = False
    db: int = 0
    service: str | None = None  # the Sentinel service name
    username: str | None = None
    password: str | None = None

    def __repr__(self) -> str:
        where = ",".join(f"{h}:{p}" for h, p in self.hosts)
        return f"RedisTarget({self.shape}, {where}, tls={self.tls}, db={self.db})"


def _host_port(part: str, default_port: int) -> tuple[str, int]:
    if part.startswith("["):  # [ipv6]:port
        host, _, rest = part[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
    if not host:
        raise RedisUrlError(f"a Redis URL names no host in {part!r}")
    try:
        return host, int(port) if port else default_port
    except ValueError as exc:
        raise RedisUrlError(f"bad port in {part!r}") from exc


def parse_redis_url(url: str) -> RedisTarget:
    """The deployment ``url`` names (see the module notes); raises :class:`RedisUrlError` for
    anything else."""
    scheme = next((s for s in SCHEMES if url.startswith(s)), None)
    if scheme is None:
        raise RedisUrlError(f"a Redis URL starts with one of {', '.join(SCHEMES)}")
    sentinel = "+sentinel" in scheme
    cluster = "+cluster" in scheme
    rest = url[len(scheme) :].split("?", 1)[0]
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    default_port = 26379 if sentinel else 6379
    hosts = tuple(_host_port(h, default_port) for h in hostlist.split(",") if h)
    if not hosts:
        raise RedisUrlError("a Redis URL names no host")
    parts = [p for p in path.split("/") if p]
    service = None
    if sentinel:
        if not parts:
            raise RedisUrlError("a Sentinel URL names its service: redis+sentinel://h:p/service")
        service = unquote(parts.pop(0))
    if len(parts) > 1:
        raise RedisUrlError(f"unexpected path in a Redis URL: /{path}")
    try:
        db = int(parts[0]) if parts else 0
    except ValueError as exc:
        raise RedisUrlError(f"the database must be a number, got {parts[0]!r}") from exc
    if cluster and db != 0:
        raise RedisUrlError("a Redis Cluster has database 0 only")
    if len(hosts) > 1 and not (sentinel or cluster):
        raise RedisUrlError("several hosts need a redis+cluster:// or redis+sentinel:// URL")
    shape: Shape = "sentinel" if sentinel else "cluster" if cluster else "standalone"
    return RedisTarget(
        shape=shape,
        hosts=hosts,
        tls=scheme.startswith("rediss"),
        db=db,
        service=service,
        username=username,
        password=password,
    )


class _SentinelBlockingPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's primary discovery with the blocking pool's wait for a free connection."""


def _auth_and_tls(target: RedisTarget) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if target.password is not None:
        kwargs["password"] = target.password
        if target.username:
            kwargs["username"] = target.username
    elif os.environ.get(PASSWORD_ENV):
        kwargs["password"] = os.environ[PASSWORD_ENV]
        if os.environ.get(USERNAME_ENV):
            kwargs["username"] = os.environ[USERNAME_ENV]
    if target.tls:
        kwargs["ssl"] = True
        kwargs["ssl_cert_reqs"] = "required"
        if os.environ.get(CA_CERTS_ENV):
            kwargs["ssl_ca_certs"] = os.environ[CA_CERTS_ENV]
    return kwargs


def connect(
    url: str,
    *,
    timeout_s: float = 0.25,
    connect_timeout_s: float | None = None,
    max_connections: int = 64,
    pool_timeout_s: float = 1.0,
) -> RedisClient:
    """A client for the deployment ``url`` names that never hangs or retries.

    ``max_connections``: the pool (per primary on a cluster); a command that finds them all
    busy waits up to ``pool_timeout_s`` (standalone and Sentinel; on a cluster it fails at once).
    Responses are decoded to ``str``.
    """
    target = parse_redis_url(url)
    socket = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s if connect_timeout_s is None else connect_timeout_s,
    }
    common: dict[str, Any] = {
        **socket,
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": True,
        **_auth_and_tls(target),
    }
    size = max(1, int(max_connections))
    if target.shape == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in target.hosts],
            max_connections=size,
            require_full_coverage=False,
            **common,
        )
    common.pop("ssl", None)
    if target.shape == "sentinel":
        sentinel_kwargs: dict[str, Any] = dict(socket)
        if os.environ.get(SENTINEL_PASSWORD_ENV):
            sentinel_kwargs["password"] = os.environ[SENTINEL_PASSWORD_ENV]
        if target.tls:
            sentinel_kwargs.update(ssl=True, ssl_cert_reqs="required")
            if os.environ.get(CA_CERTS_ENV):
                sentinel_kwargs["ssl_ca_certs"] = os.environ[CA_CERTS_ENV]
        sentinels = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs)
        return sentinels.master_for(
            str(target.service),
            redis_class=Redis,
            connection_pool_class=_SentinelBlockingPool,
            max_connections=size,
            timeout=pool_timeout_s,
            db=target.db,
            ssl=target.tls,
            retry_on_timeout=False,
            health_check_interval=0,
            **common,
        )
    host, port = target.hosts[0]
    scheme = "rediss" if target.tls else "redis"
    pool = BlockingConnectionPool.from_url(
        f"{scheme}://{host if ':' not in host else f'[{host}]'}:{port}/{target.db}",
        max_connections=size,
        timeout=pool_timeout_s,
        retry_on_timeout=False,
        health_check_interval=0,
        **{k: v for k, v in common.items() if k != "ssl"},
    )
    return Redis.from_pool(pool)


def is_cluster(client: object) -> bool:
    """True for a Redis Cluster client (whose scripts and transactions must stay in one slot)."""
    return isinstance(client, RedisCluster)


def hash_tag(ident: str) -> str:
    """``{ident}``: a Redis Cluster hash tag, so that every key ending in it shares one slot.

    ``%``, ``{`` and ``}`` in ``ident`` are percent-encoded (injective), so the tag is exactly
    ``ident`` whatever it holds; keys built as ``prefix + hash_tag(ident)`` with a prefix free of
    braces always share the slot of ``ident``.
    """
    enc = ident.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return "{" + enc + "}"
