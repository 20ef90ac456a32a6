"""The discrete-event fleet simulator: :class:`Simulator` runs a trace through gateway
replicas, each a real ``Router`` (``routing.sim.build``), to simulated edge and cloud nodes,
charging each request the client's and the node's one-way trips (``rtt / 2``) each way and the
gateway's overhead; at the gateway the real code runs (``RequestProfile``, ``Router.decide``
over a lagging ``FleetView`` of pushed states and the real ``PrefixIndex`` fed by block events
after ``event_delay_ms``, ``begin``, ``first_token`` when the first token reaches it,
``finish`` with what it measured), so the latency model learns online; :func:`simulate` runs
one on fresh routers. Invariants: deterministic for (trace, fleet, config, seed), events being
ordered by (time, sequence number) and the seed setting only each node's push phase; each node
has at most one pending step event (older ones are invalidated by ``version``); every request
ends exactly once, finished (TTFT and e2e at the client) or failed (``NoRoute``, or a prompt no
node's KV pool can ever hold).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from routing.blocks import BLOCK_SIZE
from routing.fleet.memory_store import PrefixIndex
from routing.fleet.state import NodeState
from routing.fleet.store import FleetView
from routing.policies import NoRoute
from routing.policy_config import PolicyConfig
from routing.profile import RequestProfile
from routing.router import Measured, Ticket
from routing.sim.block_keys import block_keys
from routing.sim.build import SimGateway, build_gateways, build_nodes
from routing.sim.cloud import CloudSim
from routing.sim.edge import EdgeSim
from routing.sim.fleet import FleetSpec
from routing.sim.node import EventSink, SimRequest
from routing.sim.result import SimResult, node_stats
from routing.sim.states import pushed_state, state_template
from routing.sim.trace import TraceRequest

_ARRIVE, _DECIDE, _NODE_IN, _STEP, _FIRST_SEEN, _DONE_SEEN, _PUSH, _BLOCKS = range(8)


@dataclass(slots=True)
class _Flight:
    """The simulator's bookkeeping for one request."""

    tr: TraceRequest
    gateway: int = -1
    node: int = -1
    ticket: Ticket | None = None
    dispatch_s: float = 0.0
    up_s: float = 0.0  # one-way client -> gateway
    net_s: float = 0.0  # one-way gateway -> node
    predicted_ttft_ms: float = 0.0
    predicted_e2e_ms: float = 0.0
    first_seen_s: float = -1.0


class Simulator:
    """One run of one trace through one fleet under one policy config."""

    def __init__(
        self,
        fleet: FleetSpec,
        config: PolicyConfig,
        *,
        seed: int = 0,
        push_interval_s: float | None = None,
        count_in_flight: bool = True,
        record_load: bool = True,
        warm_prompts: Sequence[int] = (),
        warm_decode_tokens: int = 4,
        warm_rates: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        """``warm_rates``: (prefill tokens/s, decode ms/token) a node reports from the start,
        by node id, in place of what ``warm_prompts`` give it (a live node's own report after
        its warm-up, to replay a live run's first decisions)."""
        self.fleet = fleet
        self.seed = seed
        self.now = 0.0
        self.push_interval_s = push_interval_s or fleet.push_interval_s
        self.event_delay_s = fleet.event_delay_ms / 1000.0
        self.net = fleet.rtt_table()
        self.record_load = record_load
        self.config = config
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self.index = PrefixIndex()
        built = build_nodes(
            fleet,
            self._sink,
            warm_prompts=warm_prompts,
            warm_decode_tokens=warm_decode_tokens,
            warm_rates=warm_rates,
        )
        self.nodes: list[EdgeSim | CloudSim] = built.nodes
        self.node_region: list[str] = built.regions
        self.node_watts = built.watts  # each node's profile's figures (None: unknown)
        self.prefix_nodes: list[str] = built.prefix_nodes
        self._node_by_id: dict[str, int] = built.by_id
        self._templates = [
            state_template(fleet, n, r, w)
            for n, r, w in zip(self.nodes, self.node_region, self.node_watts, strict=True)
        ]
        self.states: list[NodeState] = [
            pushed_state(tpl, n, 0.0) for tpl, n in zip(self._templates, self.nodes, strict=True)
        ]
        self.gateways: list[SimGateway] = build_gateways(
            fleet, config, self._clock, count_in_flight=count_in_flight
        )
        self._gw_rr: dict[str, itertools.cycle[int]] = {}
        self._load: dict[str, list[tuple[float, float]]] = {"edge": [], "cloud": []}

    # ---- plumbing ----------------------------------------------------------------------------
    def _clock(self) -> float:
        return self.now

    def _push(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj))

    def _sink(self, node_id: str) -> EventSink:
        def sink(stored: list[int], removed: list[int]) -> None:
            self._push(self.now + self.event_delay_s, _BLOCKS, (node_id, stored, removed))

        return sink

    def _gateway_for(self, region: str) -> SimGateway:
        rr = self._gw_rr.get(region)
        if rr is None:
            local = [g.index for g in self.gateways if g.region == region]
            if not local:
                best = min(self.gateways, key=lambda g: self.net.rtt_ms(region, g.region))
                local = [g.index for g in self.gateways if g.region == best.region]
            rr = self._gw_rr[region] = itertools.cycle(local)
        return self.gateways[next(rr)]

    def view(self, blocks: Sequence[int]) -> FleetView:
        index = self.index
        return FleetView(
            nodes=self.states,
            prefix_blocks={nid: index.leading(nid, blocks) for nid in self.prefix_nodes},
        )

    # ---- the run -----------------------------------------------------------------------------
    def run(self, trace: Sequence[TraceRequest], policy: str | None = None) -> SimResult:
        import math
        import time as _time

        wall = _time.perf_counter()
        n = len(trace)
        nan = math.nan
        ttft = [nan] * n
        e2e = [nan] * n
        where = [-1] * n
        cached = [0] * n
        pred_t = [nan] * n
        pred_e = [nan] * n
        flights: list[_Flight] = [_Flight(tr) for tr in trace]
        hash_cache: dict[int, tuple[int, ...]] = {}
        rng = random.Random(self.seed)
        interval = self.push_interval_s
        last = trace[-1].arrival_s if trace else 0.0
        for i in range(len(self.nodes)):
            self._push(rng.uniform(0.0, interval), _PUSH, i)
        for i, tr in enumerate(trace):
            self._push(tr.arrival_s, _ARRIVE, i)
        heap = self._heap
        pop = heapq.heappop
        nodes = self.nodes
        model, identity = self.fleet.model, self.fleet.model_identity
        events = 0
        pending = n
        finished: list[SimRequest] = []
        while heap:
            t, _, kind, obj = pop(heap)
            self.now = t
            events += 1
            if kind == _STEP:
                i, version = obj  # type: ignore[misc]
                node = nodes[i]
                if version != node.version:
                    continue
                finished.clear()
                node.end_step(t, finished)
                for r in finished:
                    self._done(r, t)
                self._step(i, t)
            elif kind == _ARRIVE:
                i = obj  # type: ignore[assignment]
                f = flights[i]
                gw = self._gateway_for(f.tr.region)
                f.gateway = gw.index
                f.up_s = self.net.rtt_ms(f.tr.region, gw.region) / 2000.0
                self._push(t + f.up_s + gw.overhead_s, _DECIDE, i)
            elif kind == _DECIDE:
                i = obj  # type: ignore[assignment]
                f = flights[i]
                tr = f.tr
                gw = self.gateways[f.gateway]
                router = gw.router
                blocks = block_keys(tr, i, hash_cache)
                route = "chat" if tr.route == "chat" else "completions"
                prof = RequestProfile(
                    model=model,
                    model_identity=identity,
                    route=route,
                    prompt_token_ids=range(tr.prompt_tokens),
                    block_hashes=blocks,
                    max_tokens=tr.max_tokens,
                    expected_output_tokens=router.outputs.expected(
                        tr.api_key,
                        route,
                        tr.max_tokens,
                        blocks[0] if blocks else None,
                        prompt_tokens=tr.prompt_tokens,
                    ),
                    stream=tr.stream,
                    client_region=tr.region,
                    api_key=tr.api_key,
                )
                try:
                    decision = router.decide(prof, self.view(blocks), policy=policy)
                except NoRoute:
                    pending -= 1
                    continue
                ticket = router.begin(decision, profile=prof)
                j = self._node_by_id[decision.node_id]
                node = nodes[j]
                if isinstance(node, CloudSim) and (
                    math.ceil((tr.prompt_tokens + 1) / BLOCK_SIZE) > node.pool.total
                ):
                    router.finish(ticket)
                    pending -= 1
                    continue
                f.ticket, f.node, f.dispatch_s = ticket, j, t
                f.net_s = self.net.rtt_ms(gw.region, self.node_region[j]) / 2000.0
                f.predicted_ttft_ms = decision.estimate.ttft_ms
                f.predicted_e2e_ms = decision.estimate.e2e_ms
                r = SimRequest(i, tr.prompt_tokens, tr.output_tokens, blocks, tr.arrival_s)
                r.payload = f
                self._push(t + f.net_s + node.request_overhead_s, _NODE_IN, r)  # type: ignore[attr-defined]
            elif kind == _NODE_IN:
                r = obj  # type: ignore[assignment]
                f = r.payload  # type: ignore[assignment]
                j = f.node
                node = nodes[j]
                r.node_arrival_s = t
                node.enqueue(r)
                if not node.busy:
                    self._step(j, t)
                elif node.run is not None and node.wants_step_on_arrival():
                    new_end = node.interrupt(t)
                    if new_end is not None:
                        node.version += 1
                        self._push(new_end, _STEP, (j, node.version))
            elif kind == _FIRST_SEEN:
                f = obj  # type: ignore[assignment]
                if f.ticket is not None:
                    self.gateways[f.gateway].router.first_token(f.ticket)
            elif kind == _DONE_SEEN:
                r = obj  # type: ignore[assignment]
                f = r.payload  # type: ignore[assignment]
                i = r.idx
                router = self.gateways[f.gateway].router
                back = f.net_s
                first_gw = r.first_s + back
                # the node's account of the wait before the first token (both kinds report it)
                wait_ms = max(0.0, (r.first_s - r.node_arrival_s) * 1000.0 - r.prefill_ms)
                router.finish(
                    f.ticket,  # type: ignore[arg-type]
                    Measured(
                        e2e_ms=(t - f.dispatch_s) * 1000.0,
                        prompt_tokens=r.prompt,
                        completion_tokens=r.generated,
                        cached_tokens=r.cached,
                        ttft_ms=(first_gw - f.dispatch_s) * 1000.0,
                        net_rtt_ms=2000.0 * back,
                        node_queue_ms=wait_ms,
                    ),
                )
                tr = f.tr
                ttft[i] = first_gw + f.up_s - tr.arrival_s
                e2e[i] = t + f.up_s - tr.arrival_s
                where[i] = f.node
                cached[i] = r.cached
                pred_t[i] = f.predicted_ttft_ms / 1000.0
                pred_e[i] = f.predicted_e2e_ms / 1000.0
                pending -= 1
            elif kind == _PUSH:
                i = obj  # type: ignore[assignment]
                self.states[i] = pushed_state(self._templates[i], nodes[i], t)
                if self.record_load and i == 0:
                    self._record_load(t)
                if pending > 0 or t <= last:
                    self._push(t + interval, _PUSH, i)
            elif kind == _BLOCKS:
                nid, stored, removed = obj  # type: ignore[misc]
                if removed:
                    self.index.remove(nid, removed)
                if stored:
                    self.index.add(nid, stored)
        return SimResult(
            policy=policy or self.config.policy,
            node_ids=[nd.id for nd in nodes],
            node_kinds=[nd.kind for nd in nodes],
            arrival_s=[tr.arrival_s for tr in trace],
            ttft_s=ttft,
            e2e_s=e2e,
            node=where,
            prompt_tokens=[tr.prompt_tokens for tr in trace],
            output_tokens=[tr.output_tokens for tr in trace],
            cached_tokens=cached,
            predicted_ttft_s=pred_t,
            predicted_e2e_s=pred_e,
            node_stats=node_stats(nodes, self.node_watts, self.now),
            load_series=self._load,
            events=events,
            wall_s=_time.perf_counter() - wall,
        )

    def _record_load(self, t: float) -> None:
        edge = cloud = 0.0
        for node in self.nodes:
            x = node.running + len(node.waiting)
            if node.kind == "edge":
                edge += x
            else:
                cloud += x
        self._load["edge"].append((t, edge))
        self._load["cloud"].append((t, cloud))

    def _step(self, i: int, t: float) -> None:
        node = self.nodes[i]
        end = node.step(t)
        node.version += 1
        if end is None:
            node.busy = False
            return
        node.busy = True
        self._push(end, _STEP, (i, node.version))
        # the gateway sees a first token one way later (a whole reply's headers come with it)
        pre = node._pending_pre  # type: ignore[union-attr]
        if isinstance(node, EdgeSim):
            if pre is not None and pre.first_s >= 0 and pre.first_s <= end:
                self._first(pre)
        else:
            for r, c in pre:
                if r.filled + c >= r.prompt and r.first_s < 0:
                    self._first(r, end)

    def _first(self, r: SimRequest, at: float | None = None) -> None:
        f: _Flight = r.payload  # type: ignore[assignment]
        if f.first_seen_s >= 0:
            return
        t = (r.first_s if at is None else at) + f.net_s
        f.first_seen_s = t
        self._push(t, _FIRST_SEEN, f)

    def _done(self, r: SimRequest, t: float) -> None:
        f: _Flight = r.payload  # type: ignore[assignment]
        self._push(t + f.net_s, _DONE_SEEN, r)


def simulate(
    trace: Sequence[TraceRequest],
    fleet: FleetSpec,
    config: PolicyConfig,
    *,
    policy: str | None = None,
    seed: int = 0,
    push_interval_s: float | None = None,
    count_in_flight: bool = True,
    warm_prompts: Sequence[int] = (),
    warm_decode_tokens: int = 4,
) -> SimResult:
    """Run ``trace`` through a fresh simulator (fresh routers: nothing learned carries over).
    ``warm_prompts``: the nodes report rates from the start, as after serving these prompt
    lengths alone (each with ``warm_decode_tokens`` out); by default they report none until
    they step, as a fresh live node does."""
    sim = Simulator(
        fleet,
        config if policy is None else config.model_copy(update={"policy": policy}),
        seed=seed,
        push_interval_s=push_interval_s,
        count_in_flight=count_in_flight,
        warm_prompts=warm_prompts,
        warm_decode_tokens=warm_decode_tokens,
    )
    return sim.run(trace)
