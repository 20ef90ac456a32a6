"""The front gateway (:class:`Gateway`): its components, built once from its config and closed
once, and one request's way through them (:meth:`Gateway.forward`: a concurrency slot, the
key's ``max_tokens`` terms, the request path's decision on ONE fleet view, the charge at the
real bound, a fair-share slot, then the dispatch). Every request that got a slot is one
:class:`Dispatch`, closed exactly once on every path, by ``forward`` or, for a stream, by its
:class:`RelayResponse`, so ``Gateway.in_flight`` returns to 0; a client gone before its reply
starts cancels the dispatch, and the node the request; nothing a client sends produces a 5xx
(503 only when no node can serve at all).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from gateway.auth import KeyIdentity
from gateway.cache_scope import CacheScopes
from gateway.circuit import CircuitBreakers
from gateway.client_ip import ClientIPResolver
from gateway.errors import APIError
from gateway.front import fastjson
from gateway.front.backends import make_auth, make_fair, make_limiter, make_store
from gateway.front.charges import Charges
from gateway.front.config import GatewayConfig
from gateway.front.disconnect import ClientGone, cancel_on_disconnect
from gateway.front.dispatch import Dispatch, DispatchDeps, Outcome, Plan, RouteName, Slots
from gateway.front.headers import hide_decision
from gateway.front.node_client import make_client
from gateway.front.plain_token_guard import PlainTokenGuard
from gateway.front.relay import RelayResponse, StreamRelay, StreamStats
from gateway.front.request_path import OpenAIRequest, RequestPath, request_id
from gateway.front.tokenizers import TokenizerCache
from gateway.geo import GeoLocator
from gateway.key_terms import apply_max_tokens, charged_bound, fleet_slots, priority_of, tenant_of
from gateway.metrics import GatewayMetrics
from gateway.openai_schema import resumable
from gateway.ratelimit import RateDecision
from gateway.request_log import RequestLog
from gateway.usage import UsageLedger
from gateway.workers.spec import WorkerInfo
from routing.fleet.inflight import InFlightBoard, SharedCountsStore
from routing.fleet.memory_store import OpenAINodeTracker
from routing.fleet.store import FleetStore
from routing.policy_config import ConfigSource
from routing.router import Router

log = logging.getLogger(__name__)

SSE_REPLY_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Gateway:
    """One front gateway: its components, and :meth:`forward` for each request."""

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
        self.store = store or make_store(
            config, self.redis, list(self.trackers.values()), self.client
        )
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
        self.limiter = make_limiter(self.shared_url, self.redis, self.replicas, self.metrics)
        self.charges = Charges(self.limiter, self.metrics)
        self.auth = make_auth(config, self.redis, self.client_ip)
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
        self.fair = make_fair(config, self.redis, self.replicas)
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
        charge :meth:`Charges.admit` made before the body was read (None: charge it here).

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
        rate = await self.charges.charge(identity, charged_bound(prof, decision.node), early)
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
