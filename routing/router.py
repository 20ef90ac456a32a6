"""The routing entry point: ``Router.decide(profile, view) -> Decision``, and its feedback loop.

A request's life as the router sees it::

    profile = build_profile(body, formatter, ..., outputs=router.outputs)
    decision = router.decide(profile, await store.view(profile.block_hashes), exclude=open_circuits)
    for cand in decision.candidates():            # retry order
        ticket = router.begin(decision, cand)      # counts it in flight on that node
        ...proxy...
        router.finish(ticket, measured)           # learn rates, output length, record errors

Invariants:
- Eligible = serves the model, ``prompt + max_tokens`` fits the node's context, in the view
  (the store only returns fresh nodes, or its last view when it is unreachable), and not in
  ``exclude`` (open circuits). Nothing else filters; policies only order.
- Every request this gateway has in flight on a node is replayed as work in hand there
  (``DispatchLedger.work``: its remaining prefill and decode steps, from its prediction and its
  first token when seen), including those sent after the node's state was taken, so a burst
  does not pile onto one node between heartbeats; the node's own running and waiting counts
  beyond what it had seen of ours stand for other gateways' requests.
- A config change (hot reload) takes effect at the next ``decide``; learned rates, RTT
  measurements and output-length statistics are kept.
- Pure: no I/O; time comes from the injected ``clock`` (wall time, like NodeState.timestamp).
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from routing.backlog import Arrivals, SharedPrefix, Work
from routing.blocks import BLOCK_SIZE
from routing.fleet.state import NodeState
from routing.fleet.store import FleetView
from routing.latency import Estimate, LatencyKnobs, LatencyModel, Observation
from routing.passes import Queued, place
from routing.policies import Candidate, Decision, NoRoute, Policy, PolicyInput, make_policy
from routing.policy_config import ConfigSource, PolicyConfig
from routing.profile import OutputLengthEstimator, RequestProfile
from routing.regions import RegionTable

Typical = Literal["mean", "median"]  # how a node's recent sends make one newcomer's work


@dataclass(frozen=True, slots=True)
class Ticket:
    """One dispatch of one request to one node (from ``Router.begin``)."""

    id: int
    node: NodeState
    estimate: Estimate
    dispatched_at: float
    profile: RequestProfile | None = None
    shadow: tuple[tuple[str, Estimate], ...] = ()  # the shadow models' estimates for its node
    # its place in the node's queue (wall-clock seconds, ``dispatched_at`` unless it was
    # placed ahead of requests in hand: ``routing.passes``); the node is told it where it
    # takes the gateway's order (``Router.place``)
    order_at: float | None = None


@dataclass(frozen=True, slots=True)
class Measured:
    """What the gateway measured for a finished request (times in ms, at the gateway).

    ``ttft_ms`` is ``None`` for replies that were not streamed; ``net_rtt_ms`` is the
    gateway-to-node RTT if measured (else the region table's estimate is used);
    ``node_queue_ms`` is what the node said the request waited before its first token (its
    time to first token less its own prompt's compute), when it said; ``node_ttft_ms`` its own
    time to first token (what the gateway measured beyond it and the RTT is the gateway's).
    """

    e2e_ms: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    ttft_ms: float | None = None
    net_rtt_ms: float | None = None
    node_queue_ms: float | None = None
    node_ttft_ms: float | None = None


@dataclass(slots=True)
class _InFlight:
    dispatched_at: float
    estimate: Estimate
    output_tokens: float
    first_token_at: float | None = None
    tokens_seen: int = 0  # completion tokens the gateway has relayed (streams), 0: none seen
    hashes: Sequence[int] = ()  # its prompt's leading block hashes, as far as a node reuses
    # its place in the node's queue (clock seconds): when it was sent, or just before the
    # requests in hand it was placed ahead of (``Estimate.placed_ahead``)
    order_at: float = 0.0
    delayed_ms: float = 0.0  # what requests placed ahead of it have added to its wait


def _holders(entries: Iterable[_InFlight]) -> dict[int, int]:
    """Block hash -> the index (in ``entries``' order) of the first entry whose prompt has it."""
    held: dict[int, int] = {}
    for i, e in enumerate(entries):
        for h in e.hashes:
            held.setdefault(h, i)
    return held


def _shared(hashes: Sequence[int], held: Mapping[int, int]) -> tuple[int, int]:
    """``(blocks, index)``: the longest run of ``hashes``' leading blocks an entry of ``held``
    has, and the first such entry (-1: none). Hashes are chained, so an entry holding a block
    holds every block before it: the run is found by bisection."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo, held[hashes[lo - 1]] if lo else -1


class DispatchLedger:
    """Requests in flight per node, with their dispatch times (sorted, as the clock is) and
    what was predicted for them, so a decision can replay the work each node has in hand."""

    def __init__(self, keep_finished_s: float = 30.0) -> None:
        self._times: dict[str, list[tuple[float, int]]] = {}
        self._entries: dict[int, _InFlight] = {}
        # (dispatched at, finished at) of recent finishes per node: a node's state taken before
        # they finished still counts them as running
        self._finished: dict[str, collections.deque[tuple[float, float]]] = {}
        self.keep_finished_s = keep_finished_s
        # (dispatched at, prefill work tokens, decode steps, prompt tokens) of recent dispatches
        # per node, and when the first one went: its usual population and work (``arrivals``)
        self._sent: dict[str, collections.deque[tuple[float, float, float, float]]] = {}
        self._first_sent: dict[str, float] = {}
        # (finished at, its prompt's block hashes) of recent finishes per node, in that order
        self._left: dict[str, collections.deque[tuple[float, Sequence[int]]]] = {}

    def add(
        self,
        node_id: str,
        at: float,
        ticket_id: int,
        estimate: Estimate | None = None,
        output_tokens: float = 0.0,
        hashes: Sequence[int] = (),
        order_at: float | None = None,
    ) -> None:
        bisect.insort(self._times.setdefault(node_id, []), (at, ticket_id))
        if estimate is not None:
            order = at if order_at is None else order_at
            self._entries[ticket_id] = _InFlight(
                at, estimate, output_tokens, hashes=hashes, order_at=order
            )
            work = estimate.prefill_work_tokens or float(estimate.uncached_tokens)
            sent = self._sent.setdefault(node_id, collections.deque(maxlen=1024))
            sent.append((at, work, max(0.0, output_tokens - 1.0), float(estimate.prompt_tokens)))
            self._first_sent.setdefault(node_id, at)

    def remove(self, node_id: str, at: float, ticket_id: int, now: float | None = None) -> bool:
        entry = self._entries.pop(ticket_id, None)
        items = self._times.get(node_id)
        if not items:
            return False
        i = bisect.bisect_left(items, (at, ticket_id))
        if i < len(items) and items[i] == (at, ticket_id):
            del items[i]
            if now is not None and entry is not None and entry.hashes:
                left = self._left.setdefault(node_id, collections.deque(maxlen=256))
                left.append((now, entry.hashes))
            if now is not None:
                done = self._finished.setdefault(node_id, collections.deque())
                done.append((at, now))
                while done and (now - done[0][1] > self.keep_finished_s or len(done) > 4096):
                    done.popleft()
            return True
        return False

    def mean_in_flight(self, node_id: str, start: float, end: float) -> float:
        """The mean number of this gateway's requests the node had in hand over
        ``[start, end]`` (clock seconds): each one dispatched before ``end`` and not finished
        before ``start`` counts for the part of the span it was there (finishes older than
        ``keep_finished_s`` are forgotten). 0 for an empty span."""
        span = end - start
        if span <= 0:
            return 0.0
        held = 0.0
        for at, _ in self._times.get(node_id, ()):
            if at >= end:  # sorted by dispatch time
                break
            held += end - max(at, start)
        for at, finished in reversed(self._finished.get(node_id, ())):
            if finished <= start:  # appended in finishing order: the rest finished earlier
                break
            if at < end:
                held += min(finished, end) - max(at, start)
        return held / span

    def in_flight_at(self, node_id: str, t: float) -> int:
        """Requests of ours the node had in hand at time ``t`` (a NodeState's timestamp):
        dispatched before it, and still in flight or finished after it."""
        items = self._times.get(node_id, ())
        n = bisect.bisect_right(items, (t, float("inf"))) if items else 0
        for at, finished in reversed(self._finished.get(node_id, ())):
            if finished <= t:  # appended in finishing order: every older one finished before t
                break
            if at <= t:
                n += 1
        return n

    def _queue(self, node_id: str) -> list[_InFlight]:
        """Our requests in hand on the node (those with a prediction) in the order it takes
        them: by ``order_at``, which is the dispatch order but for requests placed ahead."""
        entries = [
            (e.order_at, ticket_id, e)
            for _, ticket_id in self._times.get(node_id, ())
            if (e := self._entries.get(ticket_id)) is not None
        ]
        entries.sort(key=lambda x: (x[0], x[1]))
        return [e for _, _, e in entries]

    def queued(self, node_id: str, now: float) -> list[Queued]:
        """Our requests in hand on the node in its order (``work``'s), as a pass judges
        them (``routing.passes``)."""
        return [
            Queued(
                held_blocks=e.estimate.cached_tokens // BLOCK_SIZE,
                predicted_ttft_ms=e.estimate.ttft_ms,
                waited_ms=(now - e.dispatched_at) * 1000.0,
                delayed_ms=e.delayed_ms,
                started=e.first_token_at is not None,
            )
            for e in self._queue(node_id)
        ]

    def place_ahead(self, node_id: str, passed: int, slot_ms: float) -> float | None:
        """The place in the node's queue just ahead of its last ``passed`` requests in hand,
        each of which now waits ``slot_ms`` more; None when there are none to pass."""
        queue = self._queue(node_id)
        if passed <= 0 or passed > len(queue):
            return None
        for e in queue[-passed:]:
            e.delayed_ms += slot_ms
        return queue[-passed].order_at - 1e-6

    def slots_taken_without(self, node_id: str, prefix: Sequence[int], slots: int) -> bool:
        """Whether all ``slots`` of the node went to prompts without ``prefix`` (leading block
        hashes): at least that many of our requests in hand lack it, each sent after the last
        one with it left the node (among the recent finishes kept), and none in hand has it
        (one that does holds it, or writes it). False when a request in hand is not known."""
        want, n = list(prefix), len(prefix)
        if n == 0 or slots <= 0 or len(self._times.get(node_id, ())) < slots:
            return False
        last = -math.inf
        for finished, hashes in reversed(self._left.get(node_id, ())):
            if list(hashes[:n]) == want:
                last = finished
                break
        count = 0
        for at, ticket_id in self._times.get(node_id, ()):
            e = self._entries.get(ticket_id)
            if e is None or list(e.hashes[:n]) == want:
                return False
            count += at > last
        return count >= slots

    def first_token(self, ticket_id: int, at: float) -> None:
        entry = self._entries.get(ticket_id)
        if entry is not None and entry.first_token_at is None:
            entry.first_token_at = at

    def progress(self, ticket_id: int, tokens: int) -> None:
        """``tokens`` completion tokens of the ticket's reply have been relayed (a stream)."""
        entry = self._entries.get(ticket_id)
        if entry is not None and tokens > entry.tokens_seen:
            entry.tokens_seen = tokens

    def in_flight(self, node_id: str) -> int:
        return len(self._times.get(node_id, ()))

    def gateway_in_flight(self) -> int:
        """This gateway's requests in flight, on every node."""
        return sum(len(items) for items in self._times.values())

    def arrivals(
        self,
        node_id: str,
        now: float,
        window_s: float,
        typical: Typical = "mean",
        share: bool = False,
    ) -> Arrivals | None:
        """What this gateway is expected to keep on the node: the mean number of its requests
        in flight there over the last ``window_s`` (or since the first, when more recent),
        rounded, each newcomer with the ``typical`` (mean or median) prefill work, decode steps
        and prompt of the requests sent in that time; None when nothing was sent in it.

        With ``share`` the population is instead this gateway's requests in flight now, the
        one being decided included, times the node's share of the gateway's request-time over
        the window (its mean population over all nodes'): a closed loop of clients replaces
        each request that finishes somewhere, and the newcomer lands here as often as
        requests lately spent their time here."""
        sent = self._sent.get(node_id)
        window_s = min(window_s, self.keep_finished_s)
        start = now - window_s
        while sent and sent[0][0] < start:
            sent.popleft()
        if not sent:
            return None
        start = max(start, self._first_sent[node_id])
        if now - start <= 0:
            return None
        if share:
            held = {n: self.mean_in_flight(n, now - window_s, now) for n in self._times}
            total = sum(held.values())
            if total <= 0:
                return None
            population = (self.gateway_in_flight() + 1) * held.get(node_id, 0.0) / total
        else:
            population = self.mean_in_flight(node_id, start, now)
        of = statistics.median if typical == "median" else statistics.fmean
        work = Work(
            max(1.0, of(s[1] for s in sent)),
            of(s[2] for s in sent),
            context=of(s[3] for s in sent),
        )
        return Arrivals(int(population + 0.5), work)

    def since(self, node_id: str, t: float) -> int:
        """In-flight requests dispatched after ``t`` (not yet visible in a state taken at ``t``)."""
        items = self._times.get(node_id)
        if not items:
            return 0
        return len(items) - bisect.bisect_right(items, (t, float("inf")))

    def work(
        self, node_id: str, now: float, overrun_left: float = 0.0, progress: bool = True
    ) -> list[Work]:
        """What each request in flight on the node still has to do, oldest first, as far as
        its prediction and what was seen of it (its first token) tell; its context is its
        prompt and the tokens it is taken to have generated (a stream's, those relayed so far,
        and one more at most while it runs). Every reply's first token is seen
        (a stream's first chunk; a whole reply's headers, which nodes send with it), so one
        not seen yet is still before it, however late against its prediction (a token of its
        prompt left at least: its last chunk); one not finished is still decoding, however
        late. How far along a late one is, is not known:
        ``overrun_left`` of its prefill work or its decode steps is taken as left (at least one
        step; ``latency.overrun_left``)."""
        out: list[Work] = []
        held: dict[int, int] = {}  # block hash -> the first request in hand with it
        for e in self._queue(node_id):
            index = len(out)
            blocks, source = _shared(e.hashes, held)
            for h in e.hashes:
                held.setdefault(h, index)
            est = e.estimate
            elapsed = (now - e.dispatched_at) * 1000.0
            steps = max(0.0, e.output_tokens - 1.0)
            t_first = est.ttft_ms - est.rtt_ms
            prompt = float(est.prompt_tokens)
            if e.first_token_at is not None:
                since_first = (now - e.first_token_at) * 1000.0
                done = since_first / max(est.decode_ms_per_token, 1e-3)
                if e.tokens_seen and progress:
                    # a stream: the tokens relayed after its first, and one more at most
                    done = min(max(done, e.tokens_seen - 1.0), float(e.tokens_seen), steps)
                elif done >= steps:  # past its predicted last token, not finished: still at it
                    done = steps * (1.0 - overrun_left)
                left = max(1.0, steps - done) if steps else 0.0
                out.append(Work(0.0, left, context=prompt + 1.0 + steps - left))
            else:
                left = (t_first - elapsed) / max(est.own_prefill_ms, 1e-3)
                if left <= 0:  # past its predicted first token, none seen: still prefilling
                    left = overrun_left
                tokens = est.prefill_work_tokens or float(est.uncached_tokens)
                started = left < 1.0
                beyond = blocks * BLOCK_SIZE - est.cached_tokens
                shared = None
                if beyond > 0 and not started:  # replayed afresh: what it may take, and from
                    tokens += est.reused_tokens
                    shared = SharedPrefix(source, beyond)
                # its last chunk is still to run, however late: at least one token of it (and
                # the step it rides: an eager pass on a GPU, 12-20 ms)
                prefill = max(min(1.0, tokens), tokens * min(1.0, left))
                out.append(Work(prefill, steps, started, prompt, shared))
        return out

    def shared_prefix(self, node_id: str, hashes: Sequence[int]) -> SharedPrefix | None:
        """The longest run of leading blocks of a new prompt (its block ``hashes``) that a
        request of ours in hand on the node has too, as ``SharedPrefix(index in
        :meth:`work`, its prompt tokens)``; None when none shares a block."""
        blocks, source = _shared(hashes, _holders(self._queue(node_id)))
        return SharedPrefix(source, float(blocks * BLOCK_SIZE)) if blocks else None


class Router:
    """Holds the policy, the latency model, the region table and the output-length estimator."""

    def __init__(
        self,
        config: ConfigSource | PolicyConfig | None = None,
        *,
        model: LatencyModel | None = None,
        regions: RegionTable | None = None,
        outputs: OutputLengthEstimator | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(config, ConfigSource):
            self.source = config
        else:
            self.source = ConfigSource.fixed(config)
        cfg = self.source.current
        self.model = model if model is not None else LatencyModel(cfg.latency)
        self.regions = regions if regions is not None else RegionTable(cfg.regions)
        self.outputs = (
            outputs if outputs is not None else OutputLengthEstimator(cfg.expected_output)
        )
        # the shadow latency models (``PolicyConfig.shadow_latency``): they estimate every
        # candidate and learn from every reply as ``model`` does, and route nothing
        self.shadows: dict[str, LatencyModel] = {}
        self.ledger = DispatchLedger()
        self.clock = clock
        self._ids = itertools.count(1)
        self._policies: dict[str, Policy] = {}
        self._cfg: PolicyConfig | None = None
        self._sync()

    # ---- config ------------------------------------------------------------------------------
    @property
    def config(self) -> PolicyConfig:
        self._sync()
        assert self._cfg is not None
        return self._cfg

    def _sync(self) -> None:
        cfg = self.source.current
        if cfg is self._cfg:
            return
        if self._cfg is not None:
            self.model.configure(cfg.latency)
            self.regions.configure(cfg.regions)
            self.outputs.configure(cfg.expected_output)
        # a shadow kept by name keeps what it learned; a new one starts afresh
        for name in set(self.shadows) - set(cfg.shadow_latency):
            del self.shadows[name]
        for name, knobs in cfg.shadow_latency.items():
            if name in self.shadows:
                self.shadows[name].configure(knobs)
            else:
                self.shadows[name] = LatencyModel(knobs)
        self._cfg = cfg

    def reload_if_changed(self) -> bool:
        """Cheap per-request check of the policy file (see ``ConfigSource.check``)."""
        return self.source.check()

    def policy(self, name: str | None = None) -> Policy:
        """The policy instance for ``name`` (default: the configured one); kept across calls."""
        name = name or self.config.policy
        pol = self._policies.get(name)
        if pol is None:
            pol = self._policies[name] = make_policy(name)
        return pol

    # ---- deciding ----------------------------------------------------------------------------
    def candidates(
        self, profile: RequestProfile, view: FleetView, exclude: Collection[str] = ()
    ) -> tuple[list[Candidate], dict[str, str]]:
        """Eligible nodes with their estimates (sorted by id), and why the others are not."""
        cfg = self.config
        now = self.clock()
        out: list[Candidate] = []
        left_out: dict[str, str] = {}
        need = profile.context_needed
        for node in view.nodes:
            if profile.model not in node.models and (
                profile.model_identity not in node.model_identities.values()
            ):
                left_out[node.id] = "model"
            elif need > node.max_context:
                left_out[node.id] = "context"
            elif node.id in exclude:
                left_out[node.id] = "excluded"
            else:
                est = self._estimate(self.model, cfg.latency, node, profile, view, now)
                shadow = tuple(
                    (name, self._estimate(m, m.knobs, node, profile, view, now))
                    for name, m in self.shadows.items()
                )
                out.append(Candidate(node, est, shadow))
        out.sort(key=lambda c: c.node.id)
        return out, left_out

    def _estimate(
        self,
        model: LatencyModel,
        knobs: LatencyKnobs,
        node: NodeState,
        profile: RequestProfile,
        view: FleetView,
        now: float,
    ) -> Estimate:
        """``model``'s estimate of ``profile`` on ``node`` from the fleet view and the ledger,
        read as ``knobs`` say (the routing model's, or a shadow's own)."""
        client_region = profile.client_region or self.config.default_region
        seen = self.ledger.in_flight_at(node.id, node.timestamp)
        extra = max(0, node.running + node.waiting - seen)
        credited = min(view.prefix_blocks.get(node.id, 0), len(profile.reusable_hashes))
        if (
            credited
            and knobs.slot_eviction
            and node.prefix_in_slots
            and not extra
            and self.ledger.slots_taken_without(
                node.id, profile.reusable_hashes[:credited], node.max_batch
            )
        ):
            credited = 0  # its slots all went to prompts without it (``slot_eviction``)
        ahead = self.ledger.work(node.id, now, knobs.overrun_left, knobs.stream_progress)
        estimate = functools.partial(
            model.estimate,
            node,
            prompt_tokens=profile.prompt_tokens,
            cached_tokens=credited * BLOCK_SIZE,
            expected_output_tokens=profile.expected_output_on(node.kind),
            rtt_ms=self.regions.rtt_ms(client_region, node.region),
            # what other gateways sent it: its own counts beyond ours it had seen
            extra_inflight=extra,
            ahead=ahead,
            # only read where it counts: a node with a prefix cache, the knob on
            shared_prefix=self.ledger.shared_prefix(node.id, profile.reusable_hashes)
            if node.prefix_cache and knobs.in_hand_prefix
            else None,
            arrivals=self.ledger.arrivals(
                node.id,
                now,
                knobs.arrival_window_s,
                "mean" if knobs.arrival_work == "mean" else "median",
                share=knobs.arrival_population == "gateway_share",
            )
            if knobs.future_arrivals
            else None,
        )
        est = estimate()
        if not (knobs.gateway_order and node.gateway_order and credited and not extra):
            return est
        # placed ahead of the waiting requests in hand with room for it (``routing.passes``)
        queue = self.ledger.queued(node.id, now)
        at = place(queue, node.max_batch, credited, est.slot_ms, knobs.pass_room)
        return est if at >= len(queue) else estimate(position=at)

    def decide(
        self,
        profile: RequestProfile,
        view: FleetView,
        *,
        exclude: Collection[str] = (),
        policy: str | None = None,
    ) -> Decision:
        """Choose a node for ``profile`` (raises :class:`NoRoute` when none can take it)."""
        cands, left_out = self.candidates(profile, view, exclude)
        if not cands:
            reasons = set(left_out.values())
            if not left_out or reasons == {"model"}:
                raise NoRoute("unknown_model", f"no node serves model {profile.model!r}", left_out)
            if reasons <= {"model", "context"}:
                raise NoRoute(
                    "too_long",
                    f"{profile.context_needed} tokens (prompt {profile.prompt_tokens} + "
                    f"max_tokens) exceed the context of every node serving {profile.model!r}",
                    left_out,
                )
            raise NoRoute(
                "unavailable", f"no node serving {profile.model!r} is available now", left_out
            )
        cfg = self.config
        inp = PolicyInput(profile, cands, cfg, view.stale)
        pol = self._policies.get(policy or cfg.policy)
        return (pol or self.policy(policy)).decide(inp)

    # ---- feedback ----------------------------------------------------------------------------
    def begin(
        self,
        decision: Decision,
        candidate: Candidate | None = None,
        profile: RequestProfile | None = None,
    ) -> Ticket:
        """Count a dispatch to ``candidate`` (default: the chosen node) as in flight, at the
        place in the node's queue its estimate was made for (``Estimate.placed_ahead``: ahead
        of that many of the last requests in hand, which each wait its ``slot_ms`` more).
        Requests that some other dispatch put in hand between the decision and this call
        (an await between them) are among those counted."""
        cand = candidate or decision.chosen
        now = self.clock()
        est = cand.estimate
        order = self.ledger.place_ahead(cand.node.id, est.placed_ahead, est.slot_ms)
        place = now if order is None else order
        ticket = Ticket(next(self._ids), cand.node, est, now, profile, cand.shadow, place)
        out = profile.expected_output_on(cand.node.kind) if profile is not None else 0.0
        hashes = profile.reusable_hashes if profile is not None else ()
        self.ledger.add(cand.node.id, now, ticket.id, est, out, hashes, ticket.order_at)
        return ticket

    def place(self, ticket: Ticket) -> float | None:
        """The ticket's place in its node's queue to tell the node (wall-clock seconds), where
        the node takes the gateway's order and the routing model uses it
        (``latency.gateway_order``); None otherwise."""
        if not (ticket.node.gateway_order and self.config.latency.gateway_order):
            return None
        return ticket.order_at if ticket.order_at is not None else ticket.dispatched_at

    def first_token(self, ticket: Ticket) -> None:
        """The node sent the ticket's first token: its prefill is over (refines ``work``)."""
        self.ledger.first_token(ticket.id, self.clock())

    def progress(self, ticket: Ticket, tokens: int) -> None:
        """``tokens`` completion tokens of the ticket's stream have been relayed: how far its
        decode is (refines ``work``)."""
        self.ledger.progress(ticket.id, tokens)

    def finish(self, ticket: Ticket, measured: Measured | None = None) -> dict[str, float]:
        """End a dispatch. With ``measured`` (a successful request) the model learns from it.

        Returns the prediction errors recorded (``ttft``/``e2e``, measured - predicted, ms).
        Idempotent: a ticket finished twice is learned from once.
        """
        now = self.clock()
        if not self.ledger.remove(ticket.node.id, ticket.dispatched_at, ticket.id, now):
            return {}
        if measured is None:
            return {}
        # the rows it decoded beside: this gateway's requests on the node while it decoded
        # (itself included, at most the node's slots)
        ttft = measured.ttft_ms if measured.ttft_ms is not None else ticket.estimate.ttft_ms
        span_s = (measured.e2e_ms - ttft) / 1000.0
        decode_batch = None
        if span_s > 0:
            rows = self.ledger.mean_in_flight(ticket.node.id, now - span_s, now)
            decode_batch = min(max(1.0, rows), float(max(1, ticket.node.max_batch)))
        net = measured.net_rtt_ms
        if net is None:
            net = self.regions.rtt_ms(self.config.home_region, ticket.node.region)
        obs = Observation(
            node_id=ticket.node.id,
            kind=ticket.node.kind,
            prompt_tokens=measured.prompt_tokens,
            cached_tokens=measured.cached_tokens,
            completion_tokens=measured.completion_tokens,
            e2e_ms=measured.e2e_ms,
            ttft_ms=measured.ttft_ms,
            net_rtt_ms=net,
            node_queue_ms=measured.node_queue_ms,
            node_ttft_ms=measured.node_ttft_ms,
            decode_batch=decode_batch,
            estimate=ticket.estimate,
        )
        errors = self.model.observe(obs)
        for name, est in ticket.shadow:  # each learns from its own prediction for it
            shadow = self.shadows.get(name)
            if shadow is not None:
                shadow.observe(replace(obs, estimate=est))
        if ticket.profile is not None:
            p = ticket.profile
            self.outputs.observe(
                p.api_key,
                p.route,
                measured.completion_tokens,
                p.max_tokens,
                p.first_block,
                p.prompt_key,
                ticket.node.kind,
                p.last_message_key,
                p.prompt_tokens,
            )
        return errors

    def in_flight(self, node_id: str) -> int:
        return self.ledger.in_flight(node_id)
