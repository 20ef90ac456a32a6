"""The front gateway's configuration (one YAML file; the routing policy has its own).

Safe defaults (each refused or narrowed unless the operator says otherwise):
- A gateway that binds a non-loopback address with authentication off refuses to start
  (:meth:`GatewayConfig.check_exposure`) unless ``insecure_no_auth`` (``--insecure-no-auth``).
- The node token (``node_token``, default ``$EDGECLOUD_NODE_TOKEN``) is sent to every node on
  every request (:meth:`GatewayConfig.node_headers`); nodes started with the same token refuse
  requests without it. It is a secret: never logged, hidden in reprs.
- ``observability`` says who may read ``/health`` and ``/metrics``: ``loopback`` (the default:
  loopback callers or an admin key; a Prometheus scraper elsewhere sends an admin key as its
  bearer token), ``admin`` (an admin key; loopback callers only while auth is off), ``open``
  (anyone; the details of ``/health`` only to loopback or admin callers).
- Tenants: ``cache_scope`` (``key``, the default; ``team``; ``global``) says which callers
  share prefix-cache blocks (:mod:`gateway.cache_scope`); ``decision_headers`` (``full``,
  ``minimal``, ``off``) how much of the routing decision a caller sees in ``x-edgecloud-*``
  headers and ``POST /v1/route`` (admins always see all of it).
- Redis: ``redis://`` or ``rediss://`` (TLS) URLs, ``redis+sentinel://`` for a Sentinel-managed
  primary, ``redis+cluster://`` for a Redis Cluster (see :mod:`routing.redis_connect`; a URL
  that names nothing is refused at load); the password from the URL or, better,
  ``$EDGECLOUD_REDIS_PASSWORD``. One connection pool is shared
  by the rate limiter, the key store and the fleet store, of ``redis_max_connections``
  (default: from ``max_in_flight``, :func:`routing.redis_link.pool_size_for`). With a node
  token, node records in Redis must be signed with it (:mod:`routing.fleet.signing`), and
  ``allowed_node_urls`` may narrow the URLs routed to; a Redis URL off loopback without a
  password or TLS, or without a node token, is warned of (:meth:`GatewayConfig.redis_warnings`).
- Nodes off loopback are reached over ``https://`` (their registered or configured URL says
  so): ``node_tls`` names a folder whose ``ca.pem`` verifies them and whose ``cert.pem`` and
  ``key.pem``, when present, are presented to nodes that require a client certificate
  (:mod:`gateway.tls_folder`; checked at load). The node token is never sent over plain HTTP
  beyond loopback unless ``insecure_plain_nodes`` (:mod:`gateway.front.plain_token_guard`).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from gateway.auth_config import AuthConfig
from gateway.cache_scope import CacheScope
from gateway.fair_config import FairShareConfig
from gateway.geo import GeoConfig
from gateway.node_token import NODE_TOKEN_ENV, NODE_TOKEN_HEADER
from gateway.secret_strength import check_node_token
from gateway.tls_folder import TLSFolder, load_tls_folder
from routing.fleet.memory_store import OpenAINodeConfig
from routing.redis_connect import PASSWORD_ENV, RedisClient, parse_redis_url
from routing.redis_link import pool_size_for, redis_client


class UnsafeExposure(ValueError):
    """The configuration would expose the gateway without authentication."""


def is_loopback_host(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, ``localhost``)."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _env_node_token() -> SecretStr | None:
    token = os.environ.get(NODE_TOKEN_ENV)
    return SecretStr(token) if token else None


class GatewayConfig(BaseModel):
    """Example::

    host: 0.0.0.0
    port: 8000
    redis_url: rediss://redis.internal:6380/0 # omit for the in-process fleet store
    nodes: [http://10.0.0.5:8001]            # polled over /load (in-process store only)
    openai_nodes: [{id: vllm-1, url: http://10.0.0.9:8000, region: eu-west, models: [m]}]
    policy_file: policy.yaml                 # routing knobs, hot-reloaded
    virtual_models: {auto: smollm2-135m-instruct}
    model_aliases: {"claude-*": auto, "gpt-*": auto}  # agents' own model names
    geo: {database: GeoLite2-City.mmdb, default_region: eu-west, countries: {FR: eu-west}}
    auth: {salt: "...", keys: [...], admin_keys: [...]}
    gateway_replicas: 3                      # replicas sharing Redis (rate-limit fallback share)
    observability: loopback                  # /health and /metrics
    """

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", description="address to listen on (--host overrides)")
    port: int = Field(default=8000, ge=0, le=65535, description="port (--port overrides)")
    redis_url: str | None = Field(
        default=None,
        description="the fleet store nodes register in (redis://, rediss://, "
        "redis+sentinel://host:port,.../service, redis+cluster://host:port,...); "
        "none: in-process",
    )
    nodes: list[str] = Field(
        default_factory=list, description="node base URLs, polled over /load (in-process store)"
    )
    openai_nodes: list[OpenAINodeConfig] = Field(
        default_factory=list, description="other OpenAI-compatible servers (vLLM, ...) to route to"
    )
    policy_file: Path | None = Field(
        default=None, description="the routing policy YAML (hot-reloaded); none: the defaults"
    )
    virtual_models: dict[str, str] = Field(
        default_factory=lambda: {"auto": "smollm2-135m-instruct"},
        description="model names clients may use for a concrete model",
    )
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="other model names agents send, as shell patterns (claude-*, gpt-*), mapped "
        "to a served model or a virtual one; the first matching pattern wins",
    )
    responses_ttl_s: float = Field(
        default=30 * 86400,
        gt=0,
        description="how long a stored /v1/responses response can be read or chained",
    )
    geo: GeoConfig = Field(default_factory=GeoConfig, description="client IP -> region")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys and limits")
    fair_share: FairShareConfig = Field(
        default_factory=FairShareConfig,
        description="per-key concurrency and weighted fair admission when the fleet is full",
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, gt=0, description="larger request bodies get 413"
    )
    max_in_flight: int = Field(default=4096, gt=0, description="over this: 429 with Retry-After")
    request_log: Path | None = Field(
        default=None,
        description="opt-in: append one trace line per finished request (no prompt text) for "
        "edgecloud sim / tune",
    )
    max_attempts: int = Field(default=3, ge=1, description="nodes tried before the first byte")
    connect_timeout_s: float = Field(default=2.0, gt=0, description="to a node")
    read_timeout_s: float = Field(default=600.0, gt=0, description="between two reads from a node")
    poll_interval_s: float = Field(
        default=1.0, gt=0, description="how often the in-process store polls nodes' /load"
    )
    log_prompts: bool = Field(default=False, description="log request bodies (privacy!)")
    tune_gc: bool = Field(
        default=True, description="freeze start-up objects and collect garbage less often"
    )
    node_token: SecretStr | None = Field(
        default_factory=_env_node_token,
        description=f"sent to nodes in {NODE_TOKEN_HEADER} (default ${NODE_TOKEN_ENV})",
    )
    redis_max_connections: int | None = Field(
        default=None, ge=1, description="the shared Redis pool (default: from max_in_flight)"
    )
    redis_pool_timeout_s: float = Field(
        default=1.0, gt=0, description="how long a command waits for a free pooled connection"
    )
    gateway_replicas: int = Field(
        default=1, ge=1, description="replicas sharing Redis: each admits 1/n while it is down"
    )
    observability: Literal["open", "loopback", "admin"] = Field(
        default="loopback",
        description="who may read /health details and /metrics: loopback (loopback callers or "
        "an admin key, e.g. a scraper's bearer token), admin (an admin key), open (anyone)",
    )
    allowed_node_urls: list[str] = Field(
        default_factory=list,
        description="shell patterns (https://10.0.*) a Redis-registered node's URL must "
        "match to be routed to; empty: any signed registration",
    )
    cache_scope: CacheScope = Field(
        default="key",
        description="who shares prefix-cache blocks: key (each API key alone), team (keys of "
        "one team), global (everyone); without keys there is one scope",
    )
    decision_headers: Literal["full", "minimal", "off"] = Field(
        default="full",
        description="what callers see of the routing decision: full (x-edgecloud-* headers "
        "and /v1/route), minimal (tier and request id; /v1/route names the tier only), off "
        "(request id only; /v1/route for admins only)",
    )
    usage_retention_s: float = Field(
        default=86_400.0,
        gt=0,
        description="how far back GET /admin/usage can see per-key token usage (kept in "
        "minute buckets in memory)",
    )
    insecure_no_auth: bool = Field(
        default=False, description="allow a non-loopback host with authentication off"
    )
    node_tls: Path | None = Field(
        default=None,
        description="a folder for TLS to https:// nodes: ca.pem (the CA their certificates are "
        "checked against; none: the system's), cert.pem and key.pem (presented to nodes that "
        "require a client certificate)",
    )
    insecure_plain_nodes: bool = Field(
        default=False,
        description="send the node token over plain http:// to nodes off loopback (a network "
        "trusted end to end); otherwise such nodes are refused as unreachable",
    )

    @field_validator("node_token")
    @classmethod
    def _strong_token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            check_node_token(v.get_secret_value())
        return v

    @field_validator("node_tls")
    @classmethod
    def _tls_folder(cls, v: Path | None) -> Path | None:
        if v is not None:
            load_tls_folder(v, server=False)  # TLSFolderError is a ValueError
        return v

    def node_tls_folder(self) -> TLSFolder | None:
        """The ``node_tls`` folder's files (None: not set)."""
        return load_tls_folder(self.node_tls, server=False) if self.node_tls else None

    @model_validator(mode="after")
    def _redis_target(self) -> GatewayConfig:
        if self.redis_url:
            parse_redis_url(self.redis_url)  # RedisUrlError is a ValueError
        return self

    @property
    def redis_pool_size(self) -> int:
        """Connections of the one Redis pool (see :func:`routing.redis_link.pool_size_for`)."""
        return self.redis_max_connections or pool_size_for(self.max_in_flight)

    def redis_client(self, url: str | None = None) -> RedisClient | None:
        """A new client on the one pool this gateway's Redis users share (None: no Redis).
        ``url``: the Redis its workers share when ``redis_url`` is unset (a private one)."""
        url = self.redis_url or url
        if not url:
            return None
        return redis_client(
            url,
            max_connections=self.redis_pool_size,
            pool_timeout_s=self.redis_pool_timeout_s,
        )

    def redis_warnings(self) -> list[str]:
        """What is unsafe about ``redis_url`` beyond loopback: no password, no TLS, or no
        node token to sign the fleet's records with (logged at start, shown in /health)."""
        if not self.redis_url:
            return []
        target = parse_redis_url(self.redis_url)
        if all(is_loopback_host(h) for h, _ in target.hosts):
            return []
        out = []
        if not target.password and not os.environ.get(PASSWORD_ENV):
            out.append("redis_url has no password (set $EDGECLOUD_REDIS_PASSWORD)")
        if not target.tls:
            out.append("redis_url is not TLS (use rediss://): the fleet's traffic is in clear")
        if self.node_token is None:
            out.append(
                "no node_token: node registrations in Redis are not signed, so anyone who can "
                "write to Redis can register a node and receive traffic"
            )
        return out

    def node_headers(self) -> dict[str, str]:
        """Headers every request to a node carries (the node token, when one is set)."""
        if self.node_token is None:
            return {}
        return {NODE_TOKEN_HEADER: self.node_token.get_secret_value()}

    def check_exposure(self, host: str | None = None) -> None:
        """Raise :class:`UnsafeExposure` if serving on ``host`` (default: ``self.host``) would
        expose an unauthenticated gateway beyond this machine without ``insecure_no_auth``."""
        host = self.host if host is None else host
        if self.auth.is_enabled or self.insecure_no_auth or is_loopback_host(host):
            return
        raise UnsafeExposure(
            f"refusing to serve on {host} with authentication off: anyone who can reach it "
            "could run generations. Configure auth (auth.salt and auth.keys, hashed with "
            "gateway.auth.hash_key) or bind 127.0.0.1; to run open anyway, pass "
            "--insecure-no-auth (config: insecure_no_auth: true)."
        )


def load_gateway_config(path: str | Path) -> GatewayConfig:
    data = yaml.safe_load(Path(path).read_text()) or {}
    return GatewayConfig.model_validate(data)
