"""The front gateway's state and its request path, independent of the HTTP routes.

Per request: validate -> model -> tokenizer (cached by identity) -> profile (prompt ids, block
hashes, region) -> ONE fleet view -> decision -> proxy with retry -> learn from the result.
Invariants:
- The hot path reads the fleet store once (``view``); a store outage serves the last view.
- Every dispatch is matched by ``router.finish`` (with measurements on success), so in-flight
  counts never leak; a failed node is reported to its circuit breaker.
- Nothing a client sends produces a 5xx: unroutable requests are 4xx (unknown model 404, too
  long 400) or 503 only when no node can serve at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from gateway.auth import Authenticator, KeyIdentity, enforce_rate_limit
from gateway.circuit import CircuitBreakers
from gateway.client_ip import ClientIPResolver
from gateway.errors import APIError, bad_request, not_found_model, too_many_requests
from gateway.front import fastjson
from gateway.front.config import GatewayConfig
from gateway.front.tokenizers import TokenizerCache, TokenizerUnavailable
from gateway.geo import GeoLocator
from gateway.metrics import GatewayMetrics
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.proxy import (
    Exhausted,
    Opened,
    StreamTotals,
    close_client,
    make_client,
    open_first,
    passthrough_headers,
    relay_stream,
)
from routing.fleet.block_feed import BlockFeedPage
from routing.fleet.memory_store import InProcessFleetStore, OpenAINodeTracker
from routing.fleet.state import NodeKind, NodeState
from routing.fleet.store import FleetStore, FleetView
from routing.policies import Candidate, Decision, NoRoute
from routing.policy_config import ConfigSource
from routing.profile import ProfileError, RequestProfile, build_profile
from routing.prompt import TemplateError
from routing.ratelimit import InProcessRateLimiter, RateDecision, RateLimiter
from routing.router import Measured, Router, Ticket

log = logging.getLogger(__name__)

_OFFLOAD_CHARS = 2000  # prompts longer than this are tokenized in a worker thread


def _request_id() -> str:
    """A new request id: what ``uuid.uuid4().hex`` gives (random, version 4), made directly."""
    n = int.from_bytes(os.urandom(16), "big")
    n = (n & ~(0xC000 << 48)) | (0x8000 << 48)  # the RFC 4122 variant
    n = (n & ~(0xF000 << 64)) | (4 << 76)  # version 4
    return f"{n:032x}"


def _prompt_chars(body: dict[str, Any]) -> int:
    """About how many characters the prompt has (text parts; a token id counts as 4)."""
    n = 0
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                n += len(text) if isinstance(text, str) else 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        n += len(prompt)
    elif isinstance(prompt, list):
        n += sum(len(p) if isinstance(p, str) else 4 for p in prompt)
    return n


class Gateway:
    def __init__(self, config: GatewayConfig, store: FleetStore | None = None) -> None:
        self.config = config
        self.client = make_client(
            config.connect_timeout_s, config.read_timeout_s, headers=config.node_headers()
        )
        self.redis = config.redis_client()  # one pool: the fleet store, limiter and key store
        self.trackers = {c.id: OpenAINodeTracker(c) for c in config.openai_nodes}
        self.store = store or self._make_store()
        self.policy_source = (
            ConfigSource(config.policy_file) if config.policy_file else ConfigSource.fixed()
        )
        self.router = Router(self.policy_source)
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
        self.identities: dict[str, str] = {}  # model name -> identity, from the last view
        self.metrics = GatewayMetrics()
        self.limiter = self._make_limiter()
        self.auth = self._make_auth()
        self.in_flight = 0
        self.policy_override: str | None = None
        self._peer_geo: dict[Any, Any] = {}  # socket peer -> GeoResult (no trusted proxies)

    def _make_store(self) -> FleetStore:
        trackers = list(self.trackers.values())
        if self.config.redis_url:
            from routing.fleet.redis_store import RedisFleetStore

            return RedisFleetStore(self.config.redis_url, openai_nodes=trackers, client=self.redis)
        return InProcessFleetStore(
            self.config.nodes,
            fetch_state=self._fetch_state,
            fetch_blocks=self._fetch_blocks,
            openai_nodes=trackers,
            poll_interval_s=self.config.poll_interval_s,
        )

    def _make_limiter(self) -> RateLimiter:
        if self.config.redis_url:
            from routing.ratelimit import RedisRateLimiter

            return RedisRateLimiter(
                self.config.redis_url,
                client=self.redis,
                replicas=self.config.gateway_replicas,
                on_error=lambda _e: self.metrics.redis_error("ratelimit"),
            )
        return InProcessRateLimiter()

    def _make_auth(self) -> Authenticator:
        store = None
        if self.config.redis_url and self.config.auth.redis_keys:
            from routing.ratelimit import RedisKeyStore

            store = RedisKeyStore(self.config.redis_url, client=self.redis)
        return Authenticator(self.config.auth, key_store=store)

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
        start = getattr(self.store, "start", None)
        if start is not None:
            await start()

    async def close(self) -> None:
        await self.limiter.close()
        await self.store.close()
        await close_client(self.client)
        self.geo.close()

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    async def parse(
        cls, request: Request, model_cls: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> tuple[dict[str, Any], Any]:
        data, req, _ = cls.parse_json(
            await request.body(), model_cls, request.headers.get("content-type")
        )
        return data, req

    @classmethod
    def parse_body(
        cls, raw: bytes, model_cls: type[ChatCompletionRequest] | type[CompletionRequest]
    ) -> tuple[dict[str, Any], Any]:
        data, req, _ = cls.parse_json(raw, model_cls)
        return data, req

    @staticmethod
    def parse_json(
        raw: bytes,
        model_cls: type[ChatCompletionRequest] | type[CompletionRequest],
        content_type: str | bytes | None = fastjson.JSON_CONTENT_TYPE,
    ) -> tuple[dict[str, Any], Any, bool]:
        """The body as JSON, its validated model, and whether orjson parsed it (see
        :mod:`gateway.front.fastjson`). ``content_type`` is the request's Content-Type header
        (None: absent): a body not declared JSON is a 415 (``gateway.json_limits``); the
        default is for callers that checked it already. Nesting deeper than
        ``gateway.json_limits.MAX_DEPTH`` is a 400 ``invalid_json``."""
        try:
            data, strict = fastjson.loads_request(raw, content_type)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(
                f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object", code="invalid_json")
        try:
            return data, model_cls.model_validate(data), strict
        except ValidationError as exc:
            raise RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
            ) from None

    def client_region(self, request: Request) -> str:
        """The client's region; clients geo cannot place get the routing policy's default."""
        scope = request.scope
        if self.client_ip.trusted:  # X-Forwarded-For counts: the address depends on headers
            found = self.geo.locate(self.client_ip.from_scope(scope))
        else:  # the peer alone says where the client is: remember what each peer resolved to
            peer_info = scope.get("client")
            peer = peer_info[0] if peer_info else None
            found = self._peer_geo.get(peer)
            if found is None:
                found = self.geo.locate(self.client_ip.from_scope(scope))
                if len(self._peer_geo) >= 4096:
                    self._peer_geo.clear()
                self._peer_geo[peer] = found
        return found.region if found.source != "default" else self.router.config.default_region

    def concrete_model(self, requested: str) -> str:
        return self.config.virtual_models.get(requested, requested)

    # ---- profiling and deciding -------------------------------------------------------------------
    async def _identity(self, model: str) -> tuple[str, FleetView | None]:
        ident = self.identities.get(model)
        if ident is not None:
            return ident, None
        view = await self.store.view([])
        self._learn_identities(view)
        ident = self.identities.get(model)
        if ident is None:
            if any(model in n.models for n in view.nodes):
                return model, view  # a node with no identity (openai kind): name is the identity
            raise not_found_model(model)
        return ident, view

    def _learn_identities(self, view: FleetView) -> None:
        for n in view.nodes:
            for name, ident in n.model_identities.items():
                self.identities[name] = ident

    async def profile(
        self, body: Any, route: str, model: str, region: str, api_key: str | None
    ) -> tuple[RequestProfile, FleetView]:
        for _ in range(2):  # a second pass only when the model's identity changed under us
            ident, view0 = await self._identity(model)
            fmt = self.tokenizers.cached(ident)
            if fmt is None:
                nodes = (view0 or await self.store.view([])).nodes
                try:
                    fmt = await self.tokenizers.get(model, ident, nodes)
                except TokenizerUnavailable as exc:
                    raise APIError(
                        503, str(exc), type_="server_error", code="tokenizer_unavailable"
                    ) from exc

            build = functools.partial(
                build_profile,
                body,
                fmt,
                model=model,
                model_identity=ident,
                route=route,
                client_region=region,
                outputs=self.router.outputs,
                api_key=api_key,
            )

            try:
                big = _prompt_chars(body) > _OFFLOAD_CHARS
                prof = await anyio.to_thread.run_sync(build) if big else build()
            except (ProfileError, TemplateError) as exc:
                raise bad_request(
                    str(exc), param="messages" if route == "chat" else "prompt"
                ) from exc
            view = await self.store.view(prof.block_hashes)
            self._learn_identities(view)
            if self.identities.get(model, ident) == ident:
                return prof, view
            self.identities.pop(model, None)
        return prof, view

    def decide(self, prof: RequestProfile, view: FleetView) -> Decision:
        self.router.reload_if_changed()  # a stat() at most once a second: hot reload of the YAML
        try:
            return self.router.decide(
                prof, view, exclude=self.breakers.open_nodes(), policy=self.policy_override
            )
        except NoRoute as exc:
            if exc.code == "unknown_model" and view.nodes:
                raise not_found_model(prof.model) from exc
            if exc.code == "too_long":
                raise bad_request(
                    str(exc), param="max_tokens", code="context_length_exceeded"
                ) from exc
            raise APIError(
                503,
                str(exc),
                type_="server_error",
                code="no_node_available",
                headers={"Retry-After": "1"},
            ) from exc

    # ---- forwarding ------------------------------------------------------------------------------
    async def forward(
        self,
        request: Request,
        data: dict[str, Any],
        route: str,
        req: Any,
        identity: KeyIdentity,
        *,
        strict_json: bool = False,
    ) -> Response:
        """Route and relay one request. ``strict_json``: ``data`` was parsed by orjson (see
        :mod:`gateway.front.fastjson`), so it may be serialized by orjson too."""
        if self.in_flight >= self.config.max_in_flight:
            raise too_many_requests("the gateway is at its concurrency limit; retry shortly", 1.0)
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1
                self.metrics.in_flight.dec()

        self.metrics.in_flight.inc()
        try:
            return await self._forward(request, data, route, req, identity, release, strict_json)
        except APIError as exc:
            self.metrics.observe_request(route, exc.status, None, None)
            if req.stream:
                release()
            raise
        finally:
            if not req.stream:
                release()

    async def _forward(
        self,
        request: Request,
        data: dict[str, Any],
        route: str,
        req: Any,
        identity: KeyIdentity,
        release: Any,
        strict_json: bool = False,
    ) -> Response:
        request_id = request.headers.get("x-request-id") or _request_id()
        model = self.concrete_model(req.model)
        region = self.client_region(request)
        t_start = time.perf_counter()
        prof, view = await self.profile(data, route, model, region, identity.key_id)
        decision = self.decide(prof, view)
        self.metrics.observe_decision(decision.policy, decision.reason)
        estimate = prof.prompt_tokens + int(prof.max_tokens or prof.expected_output_tokens)
        rate = await enforce_rate_limit(
            self.limiter, identity, estimate, on_limited=self.metrics.observe_rate_limited
        )
        cands = decision.candidates()
        tickets: dict[str, Ticket] = {}
        by_id = {c.node.id: c for c in cands}

        def on_dispatch(node_id: str) -> None:
            self.breakers.on_dispatch(node_id)
            tickets[node_id] = self.router.begin(decision, by_id[node_id], prof)
            tr = self.trackers.get(node_id)
            if tr is not None:
                tr.started()

        def on_failure(node_id: str) -> None:
            self.breakers.on_failure(node_id)
            self._end(node_id, tickets, None)

        if req.stream:
            body = {**data, "model": model, "stream_options": {"include_usage": True}}
        else:
            body = {**data, "model": model}
        payload = fastjson.dumps(body, strict_json)
        headers = {"content-type": "application/json", "x-request-id": request_id}
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        try:
            opened = await open_first(
                self.client,
                [(c.node.id, c.node.url) for c in cands],
                path,
                payload,
                headers,
                req.stream,
                max_attempts=self.config.max_attempts,
                on_failure=on_failure,
                on_dispatch=on_dispatch,
                is_allowed=lambda n: n not in self.breakers.open_nodes(),
            )
        except Exhausted as exc:
            await self.limiter.refund(rate)
            for att in exc.attempts:
                if att.status in (429,):
                    self._end(att.node_id, tickets, None)
            if exc.last_status == 429:
                raise too_many_requests(
                    "every node that can serve this request is busy", float(exc.retry_after or 1)
                ) from None
            raise APIError(
                503,
                "no node could serve the request: "
                + "; ".join(f"{a.node_id}: {a.error}" for a in exc.attempts),
                type_="server_error",
                code="upstream_unavailable",
                headers={"Retry-After": "1"},
            ) from None
        # the nodes tried before this one failed; this one answered
        for att in opened.attempts[:-1]:
            self._end(att.node_id, tickets, None)
        cand = by_id[opened.node_id]
        hdrs = self._headers(decision, cand, opened, request_id, t_start)
        if opened.response.status_code != 200:
            content = await opened.response.aread()
            await opened.response.aclose()
            self.breakers.on_success(opened.node_id)
            self._end(opened.node_id, tickets, None)
            return Response(
                content,
                status_code=opened.response.status_code,
                headers={**passthrough_headers(opened.response), **hdrs},
            )
        self.breakers.on_success(opened.node_id)
        if req.stream:  # the node sent its first token: the prompt's blocks are in its cache
            self.store.note_cache_changed(opened.node_id)
            ticket = tickets.get(opened.node_id)
            if ticket is not None:
                self.router.first_token(ticket)
        if not req.stream:
            return await self._full(opened, tickets, hdrs, t_start, rate, route)
        return self._stream(opened, tickets, hdrs, t_start, req.include_usage, release, rate, route)

    async def _full(
        self,
        opened: Opened,
        tickets: dict[str, Ticket],
        hdrs: dict[str, str],
        t_start: float,
        rate: RateDecision,
        route: str,
    ) -> Response:
        try:
            content = await opened.response.aread()
        except (httpx.TransportError, OSError) as exc:
            self.breakers.on_failure(opened.node_id)
            self._end(opened.node_id, tickets, None)
            raise APIError(
                502,
                f"the node failed while answering: {type(exc).__name__}",
                type_="server_error",
                code="upstream_error",
            ) from exc
        finally:
            await opened.response.aclose()
        e2e = (time.perf_counter() - t_start) * 1000
        usage: dict[str, Any] = {}
        with contextlib.suppress(ValueError, AttributeError):
            usage = fastjson.usage_of_response(content)
        ttft = _ttft_of_whole_reply(opened.response.headers, e2e)
        hdrs["x-edgecloud-measured-e2e-ms"] = f"{e2e:.1f}"
        if ttft is None:
            hdrs.pop("x-edgecloud-measured-ttft-ms", None)
        else:
            hdrs["x-edgecloud-measured-ttft-ms"] = f"{ttft:.1f}"
        measured = self._measured(usage, e2e, ttft)
        self._end(opened.node_id, tickets, measured)
        await self._account(rate, measured, opened, hdrs, route, 200)
        return Response(
            content,
            status_code=200,
            media_type="application/json",
            headers={**passthrough_headers(opened.response), **hdrs},
        )

    def _stream(
        self,
        opened: Opened,
        tickets: dict[str, Ticket],
        hdrs: dict[str, str],
        t_start: float,
        include_usage: bool,
        release: Any,
        rate: RateDecision,
        route: str,
    ) -> Response:
        totals = StreamTotals()
        ttft = (time.perf_counter() - t_start) * 1000

        async def finish() -> None:  # however the relay ends
            e2e = (time.perf_counter() - t_start) * 1000
            if totals.broken is not None:
                self.breakers.on_failure(opened.node_id)
                self._end(opened.node_id, tickets, None)
            elif totals.usage is not None:
                measured = self._measured(totals.usage, e2e, ttft)
                self._end(opened.node_id, tickets, measured)
                await self._account(rate, measured, opened, hdrs, route, 200)
            else:  # client went away before the end
                self._end(opened.node_id, tickets, None)
            release()

        return RelayResponse(
            relay_stream(opened, totals, include_usage, on_close=finish),
            media_type="text/event-stream",
            headers={**hdrs, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _account(
        self,
        rate: RateDecision,
        measured: Measured,
        opened: Opened,
        hdrs: dict[str, str],
        route: str,
        status: int,
    ) -> None:
        """Settle the rate-limit charge with the real usage and record the request's metrics."""
        await self.limiter.settle(rate, measured.prompt_tokens + measured.completion_tokens)
        tier, node = hdrs.get("x-edgecloud-tier"), opened.node_id
        self.metrics.observe_request(route, status, tier, node)
        self.metrics.observe_e2e(tier, node, measured.e2e_ms / 1000)
        if measured.ttft_ms is not None:
            predicted = float(hdrs.get("x-edgecloud-predicted-ttft-ms", 0)) / 1000
            self.metrics.observe_ttft(tier, node, measured.ttft_ms / 1000, predicted)

    @staticmethod
    def _measured(usage: dict[str, Any], e2e_ms: float, ttft_ms: float | None) -> Measured:
        details = usage.get("prompt_tokens_details") or {}
        return Measured(
            e2e_ms=e2e_ms,
            ttft_ms=ttft_ms,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens", 0) or 0),
        )

    def _end(self, node_id: str, tickets: dict[str, Ticket], measured: Measured | None) -> None:
        ticket = tickets.pop(node_id, None)
        if ticket is not None:
            if self.router.finish(ticket, measured):
                self.metrics.observe_prediction_errors(self.router.model.errors)
            if measured is not None:
                self.store.note_cache_changed(node_id)
        tr = self.trackers.get(node_id)
        if tr is not None:
            tr.finished(
                ok=measured is not None,
                ttft_ms=measured.ttft_ms if measured else None,
                e2e_ms=measured.e2e_ms if measured else None,
                prompt_tokens=measured.prompt_tokens if measured else 0,
                completion_tokens=measured.completion_tokens if measured else 0,
            )

    @staticmethod
    def _headers(
        decision: Decision, cand: Candidate, opened: Opened, request_id: str, t_start: float
    ) -> dict[str, str]:
        h = decision.headers()
        if cand.node.id != decision.node_id:
            h.update(
                {
                    "x-edgecloud-node": cand.node.id,
                    "x-edgecloud-tier": cand.node.kind.value,
                    "x-edgecloud-reason": "failover",
                    "x-edgecloud-predicted-ttft-ms": f"{cand.estimate.ttft_ms:.1f}",
                    "x-edgecloud-predicted-e2e-ms": f"{cand.estimate.e2e_ms:.1f}",
                    "x-edgecloud-cached-tokens": str(cand.estimate.cached_tokens),
                    "x-edgecloud-credited-tokens": str(cand.estimate.cached_tokens),
                }
            )
        node_cached = opened.response.headers.get("x-edgecloud-cached-tokens")
        if node_cached is not None:
            h["x-edgecloud-cached-tokens"] = node_cached
        h["x-edgecloud-measured-ttft-ms"] = f"{(time.perf_counter() - t_start) * 1000:.1f}"
        h["x-edgecloud-attempts"] = str(len(opened.attempts))
        h["x-request-id"] = request_id
        return h

    # ---- informational ------------------------------------------------------------------------------
    async def route_only(
        self, data: dict[str, Any], route: str, req: Any, request: Request, api_key: str | None
    ) -> dict[str, Any]:
        model = self.concrete_model(req.model)
        region = self.client_region(request)
        prof, view = await self.profile(data, route, model, region, api_key)
        out = self.decide(prof, view).to_dict()
        out["client_region"] = region
        return out

    async def models(self) -> list[str]:
        view = await self.store.view([])
        self._learn_identities(view)
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
            "policy": self.policy_override or self.router.config.policy,
            "policy_reload_error": self.policy_source.last_error,
        }


def _ttft_of_whole_reply(node_headers: httpx.Headers, e2e_ms: float) -> float | None:
    """The time to first token of a reply sent whole, as the gateway's client would have seen
    it streamed: the gateway's end-to-end time less the node's time from first to last token
    (both node figures come from the node's headers; None when it sent neither)."""
    try:
        node_ttft = float(node_headers["x-edgecloud-measured-ttft-ms"])
        node_e2e = float(node_headers["x-edgecloud-node-e2e-ms"])
    except (KeyError, ValueError):
        return None
    decode = node_e2e - node_ttft
    if not (0.0 <= decode <= e2e_ms):
        return None
    return e2e_ms - decode


class RelayResponse(StreamingResponse):
    """A StreamingResponse that watches for the client going away without an anyio task group.

    Under ASGI spec versions before 2.4 (uvicorn says 2.3), Starlette streams in a child task
    of an anyio task group and waits for ``http.disconnect`` in the parent, cancelling the
    stream when the client leaves. This does the same with one plain asyncio task watching
    ``receive``, which cancels the streaming task on a disconnect (and that cancellation, its
    own, ends the response normally, as Starlette's cancel scope does): the task group, its
    cancel scope and task handles cost about a tenth of a streamed request's CPU.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        spec = scope.get("asgi", {}).get("spec_version", "2.0")
        if scope["type"] != "http" or tuple(map(int, spec.split("."))) >= (2, 4):
            await super().__call__(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        state = {"streaming": True, "disconnected": False}

        async def watch() -> None:
            await self.listen_for_disconnect(receive)
            if state["streaming"]:
                state["disconnected"] = True
                task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["disconnected"]:
                raise
            task.uncancel()  # our own cancellation: the client left, the response is over
        finally:
            state["streaming"] = False
            watcher.cancel()
        if self.background is not None:
            await self.background()


def error_response(exc: APIError) -> JSONResponse:
    return exc.response()


async def wait_closed(task: asyncio.Task[Any]) -> None:  # pragma: no cover - helper for shutdown
    task.cancel()


NODE_KINDS = {k.value for k in NodeKind}
