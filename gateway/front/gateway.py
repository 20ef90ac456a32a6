"""The front gateway's state, and one request's way through it, independent of the routes.

Per request: a concurrency slot (:class:`gateway.front.dispatch.Dispatch`) -> the key's
``max_tokens`` terms -> the request path (:mod:`gateway.front.request_path`: region, profile,
ONE fleet view, decision) -> the rate-limit charge at the real bound -> with fair share on, a
fleet slot (:mod:`gateway.fair_queue`; a request that waited is decided again on a fresh
view) -> the dispatch (send with failover, read or relay the reply, resume a
broken stream: :mod:`gateway.front.dispatch`, :mod:`gateway.front.relay`) -> learn from it.

Invariants:
- Every request that got a slot is one :class:`Dispatch`, closed exactly once on every path:
  by :meth:`Gateway.forward` for replies sent whole, errors and clients gone before the reply
  started; by the :class:`RelayResponse` for streams. The slot, router tickets, breaker
  accounting and openai-node trackers never leak (``Gateway.in_flight`` returns to 0).
- A client that leaves before its reply starts cancels the dispatch: the upstream connection
  is closed, so the node cancels the request (queued or running).
- Nothing a client sends produces a 5xx: unroutable requests are 4xx (unknown model 404, too
  long 400) or 503 only when no node can serve at all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.auth import Authenticator, KeyIdentity, enforce_rate_limit
from gateway.cache_scope import CacheScopes
from gateway.circuit import CircuitBreakers
from gateway.client_ip import ClientIPResolver
from gateway.errors import APIError
from gateway.fair_counts import FairCounts, InProcessFairCounts
from gateway.fair_queue import FairQueue
from gateway.front import fastjson
from gateway.front.config import GatewayConfig
from gateway.front.disconnect import ClientGone, cancel_on_disconnect
from gateway.front.dispatch import Dispatch, DispatchDeps, Outcome, Plan, RouteName, Slots
from gateway.front.headers import hide_decision
from gateway.front.node_client import make_client
from gateway.front.plain_token_guard import PlainTokenGuard
from gateway.front.relay import RelayResponse, StreamRelay, StreamStats
from gateway.front.request_path import (
    OpenAIRequest,
    RequestModel,
    RequestPath,
    parse_json,
    request_id,
)
from gateway.front.tokenizers import TokenizerCache
from gateway.geo import GeoLocator
from gateway.key_terms import apply_max_tokens, charged_bound, fleet_slots, priority_of, tenant_of
from gateway.metrics import GatewayMetrics
from gateway.openai_schema import resumable
from gateway.ratelimit import InProcessRateLimiter, RateDecision, RateLimiter
from gateway.request_log import RequestLog
from gateway.usage import UsageLedger
from gateway.workers.spec import WorkerInfo
from routing.fleet.block_feed import BlockFeedPage
from routing.fleet.inflight import InFlightBoard, SharedCountsStore
from routing.fleet.memory_store import InProcessFleetStore, OpenAINodeTracker
from routing.fleet.state import NodeState
from routing.fleet.store import FleetStore, FleetView
from routing.policies import Decision
from routing.policy_config import ConfigSource
from routing.profile import RequestProfile
from routing.router import Router

# a request body's declared bytes per token charged before it is read (text runs 3 to 4 bytes
# a token, token ids about 6 with their JSON): an under-estimate, corrected once tokenized
BODY_BYTES_PER_TOKEN = 6

log = logging.getLogger(__name__)

SSE_REPLY_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        store: FleetStore | None = None,
        worker: WorkerInfo | None = None,
    ) -> None:
        self.config = config
        self.worker = worker
        # the Redis shared with the other gateways and workers: the operator's, else the
        # private one the workers' parent started (limits, fair share, stored responses)
        self.shared_url = config.redis_url or (worker.shared_redis_url if worker else None)
        # others admitting against the same limits, each 1/n of them while Redis is down
        self.replicas = config.gateway_replicas * (worker.count if worker else 1)
        headers = config.node_headers()
        guard = PlainTokenGuard(bool(headers), config.insecure_plain_nodes)
        guard.check_known([*config.nodes, *(c.url for c in config.openai_nodes)])
        self.client = make_client(
            config.connect_timeout_s,
            config.read_timeout_s,
            headers=headers,
            tls=config.node_tls_folder(),
            guard=guard,
        )
        # one pool: the fleet store, limiter, key store and in-flight board
        self.redis = config.redis_client(self.shared_url)
        self.trackers = {c.id: OpenAINodeTracker(c) for c in config.openai_nodes}
        self.store = store or self._make_store()
        self.policy_source = (
            ConfigSource(config.policy_file) if config.policy_file else ConfigSource.fixed()
        )
        self.router = Router(self.policy_source)
        if worker is not None and worker.count > 1 and self.redis is not None:
            board = InFlightBoard(self.redis, self.router.ledger.rows_in_flight)
            self.router.ledger.on_change = board.changed
            self.store = SharedCountsStore(self.store, board)
        circ = self.router.config.circuit
        self.breakers = CircuitBreakers(circ.failure_threshold, circ.open_s, circ.half_open_probes)
        self.policy_source.on_change(
            lambda c: self.breakers.configure(
                c.circuit.failure_threshold, c.circuit.open_s, c.circuit.half_open_probes
            )
        )
        self.tokenizers = TokenizerCache(self.client)
        self.geo = GeoLocator(config.geo, nearest=getattr(self.router.regions, "nearest", None))
        self.client_ip = ClientIPResolver(config.geo.trusted_proxies)
        self.metrics = GatewayMetrics()
        self.limiter = self._make_limiter()
        self.auth = self._make_auth()
        self.scopes = CacheScopes(config.cache_scope, config.auth.salt.get_secret_value())
        self.path = RequestPath(
            self.store,
            self.tokenizers,
            self.router,
            self.breakers,
            self.geo,
            self.client_ip,
            config.virtual_models,
            config.model_aliases,
        )
        self.slots = Slots(config.max_in_flight, self.metrics.in_flight)
        self.usage = UsageLedger(
            config.usage_retention_s, on_record=self.metrics.observe_tenant_usage
        )
        self.deps = DispatchDeps(
            client=self.client,
            router=self.router,
            breakers=self.breakers,
            trackers=self.trackers,
            store=self.store,
            metrics=self.metrics,
            limiter=self.limiter,
            slots=self.slots,
            max_attempts=config.max_attempts,
            request_log=RequestLog(config.request_log) if config.request_log else None,
            usage=self.usage,
        )
        self.fair = self._make_fair()
        self.warnings = config.redis_warnings()  # logged at start, shown in /health
        self.stream_stats = StreamStats()
        self.resume_streams = True  # ask nodes for token ids so broken streams can resume

    @property
    def in_flight(self) -> int:
        """Dispatches holding a concurrency slot now."""
        return self.slots.in_use

    @property
    def policy_override(self) -> str | None:
        return self.path.policy_override

    @policy_override.setter
    def policy_override(self, name: str | None) -> None:
        self.path.policy_override = name

    @property
    def identities(self) -> dict[str, str]:
        return self.path.identities

    def _make_store(self) -> FleetStore:
        trackers = list(self.trackers.values())
        if self.config.redis_url:
            from routing.fleet.redis_store import RedisFleetStore
            from routing.fleet.signing import RecordSigner

            token = self.config.node_token
            return RedisFleetStore(
                self.config.redis_url,
                openai_nodes=trackers,
                client=self.redis,
                signer=RecordSigner(token.get_secret_value()) if token else None,
                allowed_urls=self.config.allowed_node_urls,
            )
        return InProcessFleetStore(
            self.config.nodes,
            fetch_state=self._fetch_state,
            fetch_blocks=self._fetch_blocks,
            openai_nodes=trackers,
            poll_interval_s=self.config.poll_interval_s,
        )

    def _make_limiter(self) -> RateLimiter:
        if self.shared_url:
            from gateway.ratelimit import RedisRateLimiter

            return RedisRateLimiter(
                self.shared_url,
                client=self.redis,
                replicas=self.replicas,
                on_error=lambda _e: self.metrics.redis_error("ratelimit"),
            )
        return InProcessRateLimiter()

    def _make_fair(self) -> FairQueue | None:
        """The fair queue, when fair share is on (:class:`gateway.fair_config.FairShareConfig`)."""
        fc = self.config.fair_share
        if not (fc.enabled if fc.enabled is not None else self.config.auth.is_enabled):
            return None
        counts: FairCounts = InProcessFairCounts()
        if self.redis is not None:
            from gateway.fair_redis import RedisFairCounts

            counts = RedisFairCounts(self.redis, replicas=self.replicas, lease_s=fc.lease_s)
        return FairQueue(counts, fc)

    def _make_auth(self) -> Authenticator:
        store = None
        if self.config.redis_url and self.config.auth.redis_keys:
            from gateway.key_store import RedisKeyStore

            store = RedisKeyStore(self.config.redis_url, client=self.redis)
        return Authenticator(
            self.config.auth,
            key_store=store,
            client_of=lambda scope: self.client_ip.from_scope(scope) or "",
        )

    async def _fetch_state(self, url: str) -> NodeState:
        resp = await self.client.get(url.rstrip("/") + "/load", timeout=1.0)
        resp.raise_for_status()
        return NodeState.model_validate(resp.json())

    async def _fetch_blocks(self, url: str, epoch: str | None, seq: int) -> BlockFeedPage:
        params: dict[str, str | int] = {"since": seq}
        if epoch is not None:
            params["epoch"] = epoch
        resp = await self.client.get(url.rstrip("/") + "/prefix/events", params=params, timeout=1.0)
        resp.raise_for_status()
        return BlockFeedPage.from_json(resp.json())

    async def start(self) -> None:
        for warning in self.warnings:
            log.warning("%s", warning)
        start = getattr(self.store, "start", None)
        if start is not None:
            await start()

    async def close(self) -> None:
        if self.deps.request_log is not None:
            self.deps.request_log.close()
        await self.limiter.close()
        if self.fair is not None:
            await self.fair.close()
        await self.store.close()
        await self.client.aclose()
        self.geo.close()

    # ---- the request path (gateway.front.request_path) ----------------------------------------
    @classmethod
    async def parse(
        cls, request: Request, model_cls: RequestModel
    ) -> tuple[dict[str, Any], OpenAIRequest]:
        data, req, _ = parse_json(
            await request.body(), model_cls, request.headers.get("content-type")
        )
        return data, req

    parse_json = staticmethod(parse_json)

    def client_region(self, request: Request) -> str:
        return self.path.client_region(request)

    def concrete_model(self, requested: str) -> str:
        return self.path.concrete_model(requested)

    async def profile(
        self, body: dict[str, Any], route: str, model: str, region: str, api_key: str | None
    ) -> tuple[RequestProfile, FleetView]:
        return await self.path.profile(body, route, model, region, api_key)

    def decide(self, prof: RequestProfile, view: FleetView) -> Decision:
        return self.path.decide(prof, view)

    # ---- forwarding ------------------------------------------------------------------------------
    async def forward(
        self,
        request: Request,
        data: dict[str, Any],
        route: RouteName,
        req: OpenAIRequest,
        identity: KeyIdentity,
        *,
        strict_json: bool = False,
        rate: RateDecision | None = None,
    ) -> Response:
        """Route and relay one request. ``strict_json``: ``data`` was parsed by orjson (see
        :mod:`gateway.front.fastjson`), so it may be serialized by orjson too. ``rate``: the
        charge :meth:`admit` made before the body was read (None: charge it here).

        Owns the request's :class:`Dispatch` (see the module's docstring) until it returns a
        streamed reply, which owns it from then on."""
        d = Dispatch.acquire(self.deps)
        outcome = Outcome.ERROR
        response: Response | None = None
        try:
            async with cancel_on_disconnect(request.receive):
                response = await self._dispatch(
                    d, request, data, route, req, identity, strict_json, rate
                )
            hide_decision(response.headers, self.config.decision_headers)
            outcome = Outcome.OK if response.status_code == 200 else Outcome.REJECTED
            return response
        except ClientGone:
            outcome = Outcome.CLIENT_GONE
            response = None
            return Response(status_code=499)
        except APIError as exc:
            self.metrics.observe_request(route, exc.status, None, None)
            outcome = Outcome.REJECTED
            raise
        finally:
            if not isinstance(response, RelayResponse):
                await d.aclose(outcome)

    async def _dispatch(
        self,
        d: Dispatch,
        request: Request,
        data: dict[str, Any],
        route: RouteName,
        req: OpenAIRequest,
        identity: KeyIdentity,
        strict_json: bool,
        early: RateDecision | None = None,
    ) -> Response:
        rid = request.headers.get("x-request-id") or request_id()
        model = self.path.concrete_model(req.model)
        region = self.path.client_region(request)
        t_start = time.perf_counter()
        salt = self.scopes.salt(identity)
        try:
            data = apply_max_tokens(data, identity)
            priority = priority_of(request.headers) if self.fair is not None else 0
            prof, view = await self.path.profile(data, route, model, region, identity.key_id, salt)
            decision = self.path.decide(prof, view)
        except APIError:
            if early is not None:  # the request counts; the tokens its body stood for do not
                await self.limiter.settle(early, 0)
            raise
        self.metrics.observe_decision(decision.policy, decision.reason)
        rate = await self._charge(identity, charged_bound(prof, decision.node), early)
        queue_ms = 0.0
        if self.fair is not None:
            self.fair.observe_capacity(fleet_slots(view.nodes))
            try:
                d.admission = await self.fair.acquire(
                    tenant_of(identity, self.config.auth.teams), priority
                )
            except APIError:
                await self.limiter.refund(rate)
                raise
            queue_ms = d.admission.waited_ms
            if queue_ms > 1000 * self.config.fair_share.poll_s:  # it waited: decide again
                view = await self.store.view(prof.block_hashes)
                decision = self.path.decide(prof, view)
                t_start = time.perf_counter()
        if req.stream:
            body = {**data, "model": model, "stream_options": {"include_usage": True}}
        else:
            body = {**data, "model": model}
        plan = Plan(
            route=route,
            request_id=rid,
            profile=prof,
            decision=decision,
            rate=rate,
            body=body,
            payload=fastjson.dumps(body, strict_json),
            stream=req.stream,
            include_usage=req.include_usage,
            t_start=t_start,
            # a stream is resumed from its token ids: one choice, no logprobs, no echo
            resume=req.stream and self.resume_streams and resumable(req),
            cache_salt=salt,
            key=identity.key_id,
            team=identity.team,
        )
        opened, cand = await d.open(plan)
        hdrs = d.headers_of(opened, cand)
        if queue_ms:
            hdrs["x-edgecloud-queue-ms"] = f"{queue_ms:.1f}"
        if opened.response.status_code != 200:
            return await d.passthrough(opened, hdrs)
        if not req.stream:
            return await d.read_whole(opened, hdrs)
        d.first_token(opened.node_id)  # the node sent its first token
        fmt = self.path.tokenizers.cached(prof.model_identity)
        relay = StreamRelay(d, opened, self.stream_stats, fmt)
        return RelayResponse(relay, {**hdrs, **SSE_REPLY_HEADERS})

    async def admit(self, request: Request, identity: KeyIdentity) -> RateDecision:
        """Charge one request, and the tokens the body's declared length stands for, before
        the body is read or a prompt tokenized: a key over its limit gets its 429 here."""
        declared = request.headers.get("content-length")
        tokens = int(declared) // BODY_BYTES_PER_TOKEN if declared and declared.isdigit() else 0
        return await enforce_rate_limit(
            self.limiter, identity, tokens, on_limited=self.metrics.observe_rate_limited
        )

    async def _charge(
        self, identity: KeyIdentity, bound: int, early: RateDecision | None
    ) -> RateDecision:
        """The request's charge at its real bound (prompt tokens plus its completion): charged
        here, or the early charge (:meth:`admit`) brought up to it; a bound the key's token
        bucket cannot hold is a 429 (the early charge given back)."""
        if early is None or identity.limits.tpm is None:
            if early is None:
                return await enforce_rate_limit(
                    self.limiter, identity, bound, on_limited=self.metrics.observe_rate_limited
                )
            return replace(early, charged_tokens=bound)
        more = bound - early.charged_tokens
        left = early.remaining_tokens
        if bound > identity.limits.tpm or (more > 0 and left is not None and more > left):
            await self.limiter.refund(early)
            return await enforce_rate_limit(
                self.limiter, identity, bound, on_limited=self.metrics.observe_rate_limited
            )
        await self.limiter.settle(early, bound)  # charges ``more`` (or gives it back)
        return replace(early, charged_tokens=bound)

    # ---- informational ------------------------------------------------------------------------------
    async def route_only(
        self,
        data: dict[str, Any],
        route: RouteName,
        req: OpenAIRequest,
        request: Request,
        who: KeyIdentity,
    ) -> dict[str, Any]:
        """Where the request would go, in ``who``'s cache scope (its credited tokens only)."""
        model = self.path.concrete_model(req.model)
        region = self.path.client_region(request)
        salt = self.scopes.salt(who)
        data = apply_max_tokens(data, who)
        prof, view = await self.path.profile(data, route, model, region, who.key_id, salt)
        decision = self.path.decide(prof, view)
        out = decision.to_dict()
        out["client_region"] = region
        if self.fair is not None:  # the wait in its key's queue is part of the prediction
            self.fair.observe_capacity(fleet_slots(view.nodes))
            wait, waiting = await self.fair.expected_wait_ms(
                tenant_of(who, self.config.auth.teams), decision.estimate.e2e_ms
            )
            out["gateway_queue_ms"] = round(wait, 2)
            out["gateway_queue_waiting"] = waiting
            out["predicted_ttft_ms"] = round(out["predicted_ttft_ms"] + wait, 2)
            out["predicted_e2e_ms"] = round(out["predicted_e2e_ms"] + wait, 2)
        return out

    async def models(self) -> list[str]:
        view = await self.store.view([])
        self.path.learn_identities(view)
        names: list[str] = []
        for n in view.nodes:
            for m in n.models:
                if m not in names:
                    names.append(m)
        virtual = [v for v, target in self.config.virtual_models.items() if target in names]
        return virtual + names

    def health(self) -> dict[str, Any]:
        store_health = getattr(self.store, "health", None)
        sh = store_health() if callable(store_health) else {}
        healthy = bool(getattr(self.store, "healthy", True))
        return {
            "status": "ok" if healthy else "degraded",
            "store": sh,
            "circuits": self.breakers.snapshot(),
            "in_flight": self.in_flight,
            "streams": {
                "broken": self.stream_stats.broken,
                "resumed": self.stream_stats.resumed,
            },
            "policy": self.policy_override or self.router.config.policy,
            "policy_reload_error": self.policy_source.last_error,
            "warnings": [*self.warnings, *self.client.guard.warnings()],
            "fair_share": self.fair.health() if self.fair is not None else None,
            **({"worker": self.worker.describe()} if self.worker is not None else {}),
        }
