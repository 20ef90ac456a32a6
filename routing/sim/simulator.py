"""The discrete-event fleet simulator: a trace through gateway replicas (each a real
``routing.router.Router``) to simulated edge and cloud nodes (``routing.sim.edge``,
``routing.sim.cloud``).

A request's path, in simulated seconds::

    client --rtt(client, gw)/2--> gateway (overhead) --rtt(gw, node)/2--> node
    node's first token / last token --rtt(gw, node)/2--> gateway --rtt(client, gw)/2--> client

At the gateway the real code runs: ``RequestProfile`` (built from the trace's token count and
prefix block keys), ``Router.decide`` over a ``FleetView`` of the node states last pushed and
the prefix index (the real ``PrefixIndex``) fed by the nodes' block events after
``event_delay_ms``, ``Router.begin``, ``Router.first_token`` when a reply's first token
reaches it (a stream's first chunk, a whole reply's headers: the node sends them at its
first token), and ``Router.finish`` with what it measured, so the latency model learns online.

Invariants:
- Deterministic for (trace, fleet, config, seed): events are ordered by (time, sequence
  number); the seed only sets each node's push phase.
- Each node has at most one pending step event (older ones are invalidated by ``version``).
- Every request ends exactly once: finished (with TTFT and e2e at the client) or failed
  (``NoRoute``, or a prompt no node's KV pool can ever hold).
- ``count_in_flight=False`` swaps each router's ledger for one that reports nothing in flight
  (the staleness study's "without the correction"); learning is unchanged.
"""

from __future__ import annotations

import heapq
import itertools
import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from routing.backlog import Arrivals, Work
from routing.blocks import BLOCK_SIZE
from routing.fleet.memory_store import PrefixIndex
from routing.fleet.state import NodeKind, NodeState
from routing.fleet.store import FleetView
from routing.ledger import DispatchLedger
from routing.policies import NoRoute
from routing.policy_config import PolicyConfig
from routing.power import Watts, estimated_joules
from routing.profile import RequestProfile
from routing.router import Measured, Router, Ticket
from routing.sim.cloud import CloudSim
from routing.sim.edge import EdgeSim
from routing.sim.fleet import FleetSpec
from routing.sim.node import SimRequest
from routing.sim.trace import TraceRequest

_ARRIVE, _DECIDE, _NODE_IN, _STEP, _FIRST_SEEN, _DONE_SEEN, _PUSH, _BLOCKS = range(8)


class BlindLedger(DispatchLedger):
    """A ledger that keeps its entries (so ``finish`` learns) but tells ``candidates``
    nothing about them: decisions see only the node's last pushed counts."""

    def in_flight(self, node_id: str) -> int:
        return 0

    def since(self, node_id: str, t: float) -> int:
        return 0

    def work(self, node_id: str, now: float, *args: object, **kwargs: object) -> list[Work]:
        """Nothing in hand, however read (the signature accepts every call of the ledger's
        own, so that a new way of reading it cannot break the blind one)."""
        return []

    def arrivals(self, *args: object, **kwargs: object) -> Arrivals | None:
        """Nothing expected, whatever is asked (the signature accepts every call of the
        ledger's own)."""
        return None


_GROUP, _UNIQUE = 0x6A09E667, 0x3C6EF372  # tags: keys of int tuples hash the same in every process


def block_keys(tr: TraceRequest, idx: int, cache: dict[int, tuple[int, ...]]) -> list[int]:
    """Keys of the request's full 16-token prompt blocks (equal keys: equal prefixes).

    Keys are ``hash`` of int tuples (stable across processes, unlike ``hash`` of strings):
    ``(id, j)`` for sub-block ``j`` of a shared ``hash_ids`` block, ``(_GROUP, crc32(group), j)``
    for a prefix group, ``(_UNIQUE, idx, j)`` for the request's own blocks."""
    n = tr.prompt_tokens // BLOCK_SIZE
    out: list[int] = []
    if tr.hash_ids:
        per = tr.hash_block_tokens // BLOCK_SIZE
        for h in tr.hash_ids:
            if len(out) >= n:
                break
            sub = cache.get(h)
            if sub is None:
                sub = cache[h] = tuple(hash((h, j)) for j in range(per))
            out.extend(sub)
        del out[n:]
    elif tr.prefix_group and tr.prefix_tokens >= BLOCK_SIZE:
        g = zlib.crc32(tr.prefix_group.encode())
        out = [hash((_GROUP, g, j)) for j in range(min(n, tr.prefix_tokens // BLOCK_SIZE))]
    out.extend(hash((_UNIQUE, idx, j)) for j in range(len(out), n))
    return out


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


@dataclass
class SimGateway:
    index: int
    region: str
    overhead_s: float
    router: Router


@dataclass
class SimResult:
    """Per-request outcomes (parallel lists, trace order) and per-node and time-series stats."""

    policy: str
    node_ids: list[str]
    node_kinds: list[str]
    arrival_s: list[float]
    ttft_s: list[float]  # at the client; NaN for failed requests
    e2e_s: list[float]
    node: list[int]  # -1: failed
    prompt_tokens: list[int]
    output_tokens: list[int]
    cached_tokens: list[int]
    predicted_ttft_s: list[float]
    predicted_e2e_s: list[float]
    node_stats: dict[str, dict[str, float]]
    load_series: dict[str, list[tuple[float, float]]]  # tier -> (time, running + waiting)
    events: int = 0
    wall_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


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
        # the routers know the fleet's RTTs as configured overrides (the operator's table)
        regions = config.regions.model_copy(
            update={
                "rtt_overrides": [*config.regions.rtt_overrides, *fleet.regions.rtt_ms],
                "table": {**fleet.regions.table, **config.regions.table},
                "intra_region_ms": fleet.regions.intra_region_ms,
            }
        )
        self.config = config
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self.nodes: list[EdgeSim | CloudSim] = []
        self.node_region: list[str] = []
        self.states: list[NodeState] = []
        self.index = PrefixIndex()
        self.prefix_nodes: list[str] = []
        self._node_by_id: dict[str, int] = {}
        self.node_watts: list[Watts | None] = []  # each node's profile's figures (None: unknown)
        self._max_kv = 0
        for i, (nid, spec) in enumerate(fleet.expanded()):
            prof = fleet.profile(spec)
            cost = prof.cost_model()
            sink = self._sink(nid)
            node: EdgeSim | CloudSim
            if spec.kind == "edge":
                node = EdgeSim(
                    nid,
                    cost,
                    prof.slots,
                    prof.chunk_tokens,
                    sink,
                    spec.prefix_cache,
                    prof.prefill_stall_ratio,
                )
            else:
                node = CloudSim(
                    nid,
                    cost,
                    prof.slots,
                    prof.max_tokens_per_step,
                    max(1, prof.kv_blocks),
                    sink,
                    spec.prefix_cache,
                    # the engine's default: cut beside decode rows on CPU, not on CUDA
                    prof.prefill_stall_ratio if (prof.device or "").lower() == "cpu" else None,
                )
                self._max_kv = max(self._max_kv, node.pool.total)
            node.request_overhead_s = prof.request_overhead_ms / 1000.0  # type: ignore[attr-defined]
            node.max_context = prof.max_context
            node.device = prof.device or prof.name
            node.warm(warm_prompts, warm_decode_tokens)
            if warm_rates and nid in warm_rates:
                node.seed_rates(*warm_rates[nid])
            self.nodes.append(node)
            self.node_region.append(spec.region)
            idle, load = prof.watts_idle, prof.watts_load
            self.node_watts.append(None if idle is None or load is None else Watts(idle, load))
            self._node_by_id[nid] = i
            if spec.prefix_cache:
                self.prefix_nodes.append(nid)
        self._templates = [self._template(i) for i in range(len(self.nodes))]
        self.states = [self._state(i, 0.0) for i in range(len(self.nodes))]
        self.gateways: list[SimGateway] = []
        for g in fleet.gateways:
            for _ in range(g.replicas):
                cfg = config.model_copy(update={"regions": regions, "gateway_region": g.region})
                router = Router(cfg, clock=self._clock)
                if not count_in_flight:
                    router.ledger = BlindLedger()
                self.gateways.append(
                    SimGateway(len(self.gateways), g.region, g.overhead_ms / 1000.0, router)
                )
        self._gw_rr: dict[str, itertools.cycle[int]] = {}
        self._load: dict[str, list[tuple[float, float]]] = {"edge": [], "cloud": []}

    # ---- plumbing ----------------------------------------------------------------------------
    def _clock(self) -> float:
        return self.now

    def _push(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj))

    def _sink(self, node_id: str) -> Callable[[list[int], list[int]], None]:
        def sink(stored: list[int], removed: list[int]) -> None:
            self._push(self.now + self.event_delay_s, _BLOCKS, (node_id, stored, removed))

        return sink

    def _template(self, i: int) -> NodeState:
        n = self.nodes[i]
        return NodeState(
            id=n.id,
            kind=NodeKind.EDGE if n.kind == "edge" else NodeKind.CLOUD,
            region=self.node_region[i],
            url=f"sim://{n.id}",
            models=[self.fleet.model],
            model_identities={self.fleet.model: self.fleet.model_identity},
            max_context=n.max_context,
            timestamp=0.0,
            watts_idle=w.idle if (w := self.node_watts[i]) else None,
            watts_load=w.load if w else None,
            power_source="configured" if w else "",
            **n.traits().model_dump(),
        )

    def _state(self, i: int, t: float) -> NodeState:
        """The node's state now (a copy of its template: no validation on the hot path)."""
        n = self.nodes[i]
        used, total = n.kv()
        hit = n.cached_tokens / n.prompt_tokens if n.prompt_tokens else 0.0
        chunk, chunk_decoding = n.reported_chunks()
        return self._templates[i].model_copy(
            update={
                "running": n.running,
                "waiting": len(n.waiting),
                "kv_blocks_used": used,
                "kv_blocks_total": total,
                "prefill_tokens_per_s": n.prefill_tps,
                "decode_ms_per_token": n.decode_ms,
                "prefix_hit_rate": hit,
                "prefill_chunk": chunk,
                "prefill_chunk_decoding": chunk_decoding,
                "step_cost": n.fitted_step_cost(),
                "timestamp": t,
            }
        )

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
                self.states[i] = self._state(i, t)
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
        stats: dict[str, dict[str, float]] = {}
        for node, w in zip(nodes, self.node_watts, strict=True):
            stats[node.id] = {
                # its profile's idle watts over the run, load watts while it stepped
                "joules": estimated_joules(w, self.now, node.busy_s) if w else math.nan,
                "requests": float(node.served),
                "prefix_hit_rate": node.cached_tokens / node.prompt_tokens
                if node.prompt_tokens
                else 0.0,
                "busy_share": node.busy_s / max(1e-9, self.now),
                "steps": float(node.steps),
            }
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
            node_stats=stats,
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
