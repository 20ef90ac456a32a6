"""One dispatch: a request's life from its routing decision to the end of its reply, with ONE
owner that ends it exactly once.

A :class:`Dispatch` holds everything one request takes from the gateway and the fleet while
it runs: its concurrency slot (:class:`Slots`); its fleet slot under fair share
(:class:`gateway.fair_queue.Admission`, when it holds one); per node it was sent to, one :class:`Leg` (a
router ticket, the node's circuit-breaker accounting and, for an ``openai`` node, its
tracker's in-flight count); and the upstream response being read or relayed.

Invariants:
- ``close(outcome)`` runs exactly once, however the request ends (answered, passed through,
  refused, failed, client gone, an unexpected exception anywhere in the gateway); it ends
  every leg still open and gives the slot back, and the fair-share admission with it. Later
  calls do nothing.
- A leg ends exactly once (:meth:`Dispatch.fail`, :meth:`Dispatch.end`, or ``close``): a node
  that failed before its first byte and was then replaced is finished once, never again when
  the replacement answers. Only an ended-with-a-measurement leg teaches the router.
- A node's breaker sees one failure per failed leg (connect error, 5xx, a stream that broke
  before or after its first byte) and one success per answer (any status it was not retried
  for).
- One owner at a time: :meth:`Gateway.forward` until it returns a streamed reply; from then
  the :class:`gateway.front.relay.RelayResponse`, which closes the dispatch however the
  response ends, including when its body is never iterated (the client left before the body
  started), and, when the response object is dropped without being called, a finalizer.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from fastapi.responses import Response

from gateway.circuit import CircuitBreakers
from gateway.errors import APIError, too_many_requests
from gateway.fair_queue import Admission
from gateway.front import fastjson
from gateway.front.headers import decision_headers, set_whole_reply_timings
from gateway.front.node_client import NodeClient
from gateway.metrics import GatewayMetrics
from gateway.node_headers import (
    CACHE_SALT_HEADER,
    HEADERS_AT_FIRST_TOKEN,
    node_ttft_ms,
    node_wait_ms,
)
from gateway.proxy import Exhausted, Opened, Upstream, open_first, passthrough_headers
from gateway.ratelimit import RateDecision, RateLimiter
from gateway.request_log import RequestLog
from gateway.token_ids import TOKEN_IDS_HEADER
from gateway.usage import UsageLedger
from routing.fleet.memory_store import OpenAINodeTracker
from routing.fleet.store import FleetStore
from routing.policies import Candidate, Decision
from routing.profile import RequestProfile
from routing.router import Measured, Router, Ticket

RouteName = Literal["chat", "completion"]
MAX_WHOLE_RETRIES = 2  # a reply sent whole whose node fails mid-body: nodes tried after it


class Outcome(enum.StrEnum):
    """How a dispatch ended (``Dispatch.outcome``)."""

    OK = "ok"  # the reply went to the client whole
    REJECTED = "rejected"  # an error reply: the gateway's own, or a node's passed through
    FAILED = "failed"  # the node failed after it started answering
    CLIENT_GONE = "client_gone"  # the client left before the reply ended
    ERROR = "error"  # an unexpected exception inside the gateway


class Slots:
    """The gateway's concurrency limit: at most ``limit`` dispatches hold a slot at once."""

    __slots__ = ("gauge", "in_use", "limit")

    def __init__(self, limit: int, gauge: Any | None = None) -> None:
        self.limit = limit
        self.in_use = 0
        self.gauge = gauge  # a prometheus Gauge (inc/dec), or None

    def acquire(self) -> bool:
        if self.in_use >= self.limit:
            return False
        self.in_use += 1
        if self.gauge is not None:
            self.gauge.inc()
        return True

    def release(self) -> None:
        self.in_use -= 1
        if self.gauge is not None:
            self.gauge.dec()


@dataclass(frozen=True, slots=True)
class DispatchDeps:
    """What dispatches share: the gateway's parts they account to (one per gateway)."""

    client: NodeClient
    router: Router
    breakers: CircuitBreakers
    trackers: Mapping[str, OpenAINodeTracker]
    store: FleetStore
    metrics: GatewayMetrics
    limiter: RateLimiter
    slots: Slots
    max_attempts: int
    request_log: RequestLog | None = None
    usage: UsageLedger | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """What the request path decided for one request: the input of its dispatch."""

    route: RouteName
    request_id: str
    profile: RequestProfile
    decision: Decision
    rate: RateDecision
    body: dict[str, Any]  # as sent to the node: concrete model, usage asked for on streams
    payload: bytes  # ``body`` serialized
    stream: bool
    include_usage: bool  # the client asked for the usage chunk
    t_start: float  # time.perf_counter() when the request arrived

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/completions"

    resume: bool = False  # ask nodes for token ids, so the stream can be resumed
    cache_salt: str = ""  # the caller's cache scope (gateway.cache_scope), sent to every node
    key: str = "anonymous"  # the caller's key and team, whose usage this is (gateway.usage)
    team: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        h = {"content-type": "application/json", "x-request-id": self.request_id}
        if self.resume:
            h[TOKEN_IDS_HEADER] = "1"
        if self.cache_salt:
            h[CACHE_SALT_HEADER] = self.cache_salt
        return h


@dataclass(slots=True, eq=False)
class Leg:
    """One node's part of a dispatch: dispatched once, ended once."""

    node_id: str
    ticket: Ticket
    tracker: OpenAINodeTracker | None


def measured_of(
    usage: Mapping[str, Any],
    e2e_ms: float,
    ttft_ms: float | None,
    node_wait: float | None = None,
    node_ttft: float | None = None,
) -> Measured:
    """``node_wait``: what the node said its time to first token spent waiting
    (:func:`gateway.node_headers.node_wait_ms`); ``node_ttft``: its own time to first token."""
    details = usage.get("prompt_tokens_details") or {}
    return Measured(
        e2e_ms=e2e_ms,
        ttft_ms=ttft_ms,
        node_queue_ms=node_wait,
        node_ttft_ms=node_ttft,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens", 0) or 0),
    )


class Dispatch:
    """See the module's docstring. Made by :meth:`acquire` (which takes the slot)."""

    __slots__ = (
        "_legs",
        "admission",
        "deps",
        "first_byte_ms",
        "outcome",
        "plan",
        "tried",
        "upstream",
    )

    def __init__(self, deps: DispatchDeps) -> None:
        self.deps = deps
        self.plan: Plan | None = None
        self._legs: dict[str, Leg] = {}
        self.tried: set[str] = set()  # every node this request was sent to
        self.outcome: Outcome | None = None  # set once, by close
        self.upstream: Upstream | None = None  # the response being read or relayed
        self.first_byte_ms = 0.0  # when the answering node's headers came (set by headers_of)
        self.admission: Admission | None = None  # its fleet slot under fair share

    @classmethod
    def acquire(cls, deps: DispatchDeps) -> Dispatch:
        """A dispatch holding a concurrency slot, or a 429 when the gateway has none free."""
        if not deps.slots.acquire():
            raise too_many_requests("the gateway is at its concurrency limit; retry shortly", 1.0)
        return cls(deps)

    @property
    def closed(self) -> bool:
        return self.outcome is not None

    @property
    def open_legs(self) -> int:
        return len(self._legs)

    # ---- legs ----------------------------------------------------------------------------------
    def begin(self, cand: Candidate) -> Leg:
        """Count a send to ``cand``'s node: breaker probe, router ticket, tracker."""
        assert self.plan is not None and self.outcome is None
        node_id = cand.node.id
        self.deps.breakers.on_dispatch(node_id)
        ticket = self.deps.router.begin(self.plan.decision, cand, self.plan.profile)
        tracker = self.deps.trackers.get(node_id)
        if tracker is not None:
            tracker.started()
        leg = self._legs[node_id] = Leg(node_id, ticket, tracker)
        self.tried.add(node_id)
        return leg

    def fail(self, node_id: str) -> None:
        """The node failed (before or after its first byte): its breaker counts it, its leg
        ends unmeasured."""
        self.deps.breakers.on_failure(node_id)
        self.end(node_id, None)

    def end(self, node_id: str, measured: Measured | None) -> None:
        """End the node's leg (if still open): with ``measured`` the router learns from it."""
        leg = self._legs.pop(node_id, None)
        if leg is None:
            return
        deps = self.deps
        if deps.router.finish(leg.ticket, measured):
            deps.metrics.observe_prediction_errors(deps.router.model.errors)
        if measured is not None:
            deps.store.note_cache_changed(node_id)
            if deps.request_log is not None and leg.ticket.profile is not None:
                deps.request_log.record(
                    leg.ticket.profile, measured.completion_tokens, leg.ticket.dispatched_at
                )
        if leg.tracker is not None:
            m = measured
            leg.tracker.finished(
                ok=m is not None,
                ttft_ms=m.ttft_ms if m else None,
                e2e_ms=m.e2e_ms if m else None,
                prompt_tokens=m.prompt_tokens if m else 0,
                completion_tokens=m.completion_tokens if m else 0,
            )

    def first_token(self, node_id: str) -> None:
        """The node sent its first token: the prompt's blocks are in its cache."""
        self.deps.store.note_cache_changed(node_id)
        leg = self._legs.get(node_id)
        if leg is not None:
            self.deps.router.first_token(leg.ticket)

    def progress(self, node_id: str, tokens: int) -> None:
        """The node's stream has relayed ``tokens`` completion tokens of this leg."""
        leg = self._legs.get(node_id)
        if leg is not None:
            self.deps.router.progress(leg.ticket, tokens)

    # ---- the one ending --------------------------------------------------------------------------
    def close(self, outcome: Outcome) -> None:
        """End the dispatch (exactly once; see the module's docstring). Synchronous, so that
        any path, a finalizer included, can run it; the upstream response, if still open, is
        dropped (its connection is closed when it is freed; :meth:`aclose` closes it first)."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        try:
            for node_id in list(self._legs):
                self.end(node_id, None)
        finally:
            self.upstream = None
            self.deps.slots.release()
            if self.admission is not None:
                self.admission.release()

    async def aclose(self, outcome: Outcome) -> None:
        """Close the upstream response (which cancels the request on its node), then
        :meth:`close`."""
        upstream, self.upstream = self.upstream, None
        try:
            if upstream is not None:
                with contextlib.suppress(httpx.TransportError, OSError):
                    await upstream.aclose()
        finally:
            self.close(outcome)

    # ---- running it ------------------------------------------------------------------------------
    async def _open_first(
        self, cands: list[Candidate], path: str, payload: bytes, stream: bool
    ) -> tuple[Opened, Candidate]:
        """Send to ``cands`` in order until one answers (:func:`gateway.proxy.open_first`),
        one leg per node tried; the legs of the busy nodes tried before it end."""
        assert self.plan is not None
        deps = self.deps
        by_id = {c.node.id: c for c in cands}

        def dispatched(node_id: str) -> None:
            self.begin(by_id[node_id])

        opened = await open_first(
            deps.client,
            [(c.node.id, c.node.url) for c in cands],
            path,
            payload,
            self.plan.headers,
            stream,
            max_attempts=deps.max_attempts,
            on_failure=self.fail,
            on_dispatch=dispatched,
            is_allowed=lambda n: n not in deps.breakers.open_nodes(),
        )
        self.upstream = opened.response
        for node_id in [n for n in self._legs if n != opened.node_id]:
            self.end(node_id, None)  # busy (429) nodes tried before this one
        deps.breakers.on_success(opened.node_id)
        return opened, by_id[opened.node_id]

    async def open(self, plan: Plan) -> tuple[Opened, Candidate]:
        """Send the request to the decision's candidates in order until one answers (see
        :func:`gateway.proxy.open_first`); 429 or 503 when none does."""
        self.plan = plan
        deps = self.deps
        try:
            return await self._open_first(
                plan.decision.candidates(), plan.path, plan.payload, plan.stream
            )
        except Exhausted as exc:
            await deps.limiter.refund(plan.rate)
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

    async def open_continuation(
        self, cands: list[Candidate], body: dict[str, Any]
    ) -> Opened | None:
        """Open the continuation of a broken stream (``gateway.front.resume``) on the first
        of ``cands`` that streams it; None when none does (their legs ended)."""
        if not cands:
            return None
        payload = fastjson.dumps(body, False)
        try:
            opened, _ = await self._open_first(cands, "/v1/completions", payload, True)
        except Exhausted:
            return None
        if opened.response.status_code != 200:
            await self.aclose_upstream_quietly()
            self.end(opened.node_id, None)
            return None
        return opened

    def headers_of(self, opened: Opened, cand: Candidate) -> dict[str, str]:
        assert self.plan is not None
        p = self.plan
        self.first_byte_ms = (time.perf_counter() - p.t_start) * 1000
        return decision_headers(
            p.decision,
            cand,
            opened.response.headers,
            len(opened.attempts),
            p.request_id,
            self.first_byte_ms,
        )

    async def _read_body(self, opened: Opened) -> bytes:
        """The reply's whole body; a node failing meanwhile fails its leg (a 502 follows).
        The upstream is closed either way."""
        try:
            return await opened.response.aread()
        except (httpx.TransportError, OSError) as exc:
            self.fail(opened.node_id)
            raise _upstream_error(exc) from exc
        finally:
            await self.aclose_upstream()

    async def _reopen_elsewhere(self) -> tuple[Opened, Candidate] | None:
        """The request sent again, whole, to the decision's candidates not tried yet (None:
        none is left, or none answers)."""
        assert self.plan is not None
        plan = self.plan
        rest = [c for c in plan.decision.candidates() if c.node.id not in self.tried]
        if not rest:
            return None
        try:
            return await self._open_first(rest, plan.path, plan.payload, False)
        except Exhausted:
            return None

    async def passthrough(self, opened: Opened, hdrs: dict[str, str]) -> Response:
        """A node's non-200 answer (a 4xx it was not retried for), passed through as it came."""
        content = await self._read_body(opened)
        self.end(opened.node_id, None)
        return Response(
            content,
            status_code=opened.response.status_code,
            headers={**passthrough_headers(opened.response), **hdrs},
        )

    async def read_whole(self, opened: Opened, hdrs: dict[str, str]) -> Response:
        """Read a reply sent whole (200), learn from it, settle the rate charge.

        A node that fails while its body is on the way (it died after its headers, which it
        sends at the first token) has sent nothing the client saw: the request goes to the
        decision's next candidates not tried yet, up to ``MAX_WHOLE_RETRIES`` times, before a
        502. The client then reads one answer, with the failover headers of the node that gave
        it."""
        assert self.plan is not None
        plan = self.plan
        for retries_left in range(MAX_WHOLE_RETRIES, -1, -1):
            if opened.response.headers.get(HEADERS_AT_FIRST_TOKEN) == "1":
                self.first_token(opened.node_id)  # its headers came with the first token
            try:
                content = await self._read_body(opened)
                break
            except APIError:
                again = await self._reopen_elsewhere() if retries_left else None
                if again is None:
                    raise
                opened, cand = again
                hdrs = self.headers_of(opened, cand)
                if opened.response.status_code != 200:
                    return await self.passthrough(opened, hdrs)
        e2e = (time.perf_counter() - plan.t_start) * 1000
        usage: dict[str, Any] = {}
        with contextlib.suppress(ValueError, AttributeError):
            usage = fastjson.usage_of_response(content)
        ttft = set_whole_reply_timings(hdrs, opened.response.headers, e2e, self.first_byte_ms)
        node_h = opened.response.headers
        measured = measured_of(usage, e2e, ttft, node_wait_ms(node_h), node_ttft_ms(node_h))
        self.end(opened.node_id, measured)
        await self.account(measured, opened.node_id, hdrs)
        return Response(
            content,
            status_code=200,
            media_type="application/json",
            headers={**passthrough_headers(opened.response), **hdrs},
        )

    async def aclose_upstream(self) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            await upstream.aclose()

    async def aclose_upstream_quietly(self) -> None:
        with contextlib.suppress(httpx.TransportError, OSError):
            await self.aclose_upstream()

    async def account(self, measured: Measured, node_id: str, hdrs: Mapping[str, str]) -> None:
        """Settle the rate-limit charge with the real usage and record the request's metrics
        and its tenant's usage."""
        assert self.plan is not None
        m = self.deps.metrics
        await self.deps.limiter.settle(
            self.plan.rate, measured.prompt_tokens + measured.completion_tokens
        )
        if self.deps.usage is not None:
            self.deps.usage.record(
                self.plan.key,
                self.plan.team,
                measured.prompt_tokens,
                measured.cached_tokens,
                measured.completion_tokens,
            )
        tier = hdrs.get("x-edgecloud-tier")
        m.observe_request(self.plan.route, 200, tier, node_id)
        m.observe_e2e(tier, node_id, measured.e2e_ms / 1000)
        if measured.ttft_ms is not None:
            predicted = float(hdrs.get("x-edgecloud-predicted-ttft-ms", 0)) / 1000
            m.observe_ttft(tier, node_id, measured.ttft_ms / 1000, predicted)


def _upstream_error(exc: BaseException) -> APIError:
    return APIError(
        502,
        f"the node failed while answering: {type(exc).__name__}",
        type_="server_error",
        code="upstream_error",
    )
