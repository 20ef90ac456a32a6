"""What no routing policy can beat: each request alone on its best node.

:func:`alone` gives, per request of a trace, the TTFT and end-to-end latency it would have in
the simulator if it ran alone (no queue, a decode batch of one) on the fleet node that serves
it fastest, with every prompt block that an earlier request of the trace shares already cached
there. Any routing policy run through :mod:`routing.sim.simulator` on that fleet gives each
request at least these (steps only get dearer with more rows, and a node holds at most the
blocks sent before), so the p-th percentile of a policy's latencies is at least the p-th
percentile of these: a target below it is out of reach for every policy.

The cost terms are those the simulator charges a request that runs alone: the client's one-way
trip to its gateway and back, the gateway's overhead, the trip to the node and back, the node's
per-request overhead, one step's overhead with the uncached prompt (``chunk_ms``), and each
further token's decode step at the mean context of the answer, the approximation the simulator
itself makes for a run of decode steps. Chunking a long prompt into several steps only adds to
that, so it is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from routing.blocks import BLOCK_SIZE, reusable_blocks
from routing.sim.block_keys import block_keys
from routing.sim.fleet import FleetSpec
from routing.sim.trace import TraceRequest


@dataclass(frozen=True)
class AloneLatency:
    """Per request (trace order), seconds: the least TTFT and the least e2e over the fleet's
    nodes (each from its own best node), the kind of the node with the least e2e, and the
    prompt tokens taken as cached."""

    ttft_s: np.ndarray
    e2e_s: np.ndarray
    best_kind: list[str]
    cached_tokens: np.ndarray


def _gateway(fleet: FleetSpec, region: str) -> tuple[str, float]:
    """The region and overhead (s) of the gateway a client in ``region`` reaches, as the
    simulator picks it (its own region's, else the nearest)."""
    table = fleet.rtt_table()
    local = [g for g in fleet.gateways if g.region == region]
    if not local:
        near = min(fleet.gateways, key=lambda g: table.rtt_ms(region, g.region))
        local = [g for g in fleet.gateways if g.region == near.region]
    g = min(local, key=lambda g: g.overhead_ms)
    return g.region, g.overhead_ms / 1000.0


def shared_prefix_tokens(trace: Sequence[TraceRequest]) -> np.ndarray:
    """Per request, the leading prompt tokens that an earlier request of the trace also sent
    (whole blocks, at most the blocks a node can reuse): the most any node can hold for it."""
    seen: set[int] = set()
    cache: dict[int, tuple[int, ...]] = {}
    out = np.zeros(len(trace), dtype=np.int64)
    for i, tr in enumerate(trace):
        keys = block_keys(tr, i, cache)
        n = 0
        for k in keys[: reusable_blocks(tr.prompt_tokens)]:
            if k not in seen:
                break
            n += 1
        out[i] = n * BLOCK_SIZE
        seen.update(keys)
    return out


def alone(trace: Sequence[TraceRequest], fleet: FleetSpec) -> AloneLatency:
    """Each request of ``trace`` alone on the node of ``fleet`` that serves it fastest."""
    table = fleet.rtt_table()
    cached = shared_prefix_tokens(trace)
    specs = {(spec.kind, spec.region, spec.profile): spec for _, spec in fleet.expanded()}
    costs = [(spec, fleet.profile(spec)) for spec in specs.values()]
    models = [(spec, prof, prof.cost_model()) for spec, prof in costs]
    gateways = {r: _gateway(fleet, r) for r in {tr.region for tr in trace}}
    n = len(trace)
    ttft, e2e = np.full(n, np.inf), np.full(n, np.inf)
    kinds = [""] * n
    for i, tr in enumerate(trace):
        gw_region, gw_s = gateways[tr.region]
        client_s = table.rtt_ms(tr.region, gw_region) / 1000.0 + gw_s
        for spec, prof, cost in models:
            if tr.prompt_tokens > prof.max_context:  # refused there whatever the policy
                continue
            c = min(int(cached[i]), tr.prompt_tokens - 1) if spec.prefix_cache else 0
            fixed = client_s + table.rtt_ms(gw_region, spec.region) / 1000.0
            fixed += prof.request_overhead_ms / 1000.0
            first = fixed + (cost.overhead_ms + cost.chunk_ms(c, tr.prompt_tokens - c)) / 1000.0
            steps = tr.output_tokens - 1
            ctx = tr.prompt_tokens + 0.5 * tr.output_tokens
            last = first + steps * (cost.overhead_ms + cost.decode_ms(1, ctx)) / 1000.0
            ttft[i] = min(ttft[i], first)
            if last < e2e[i]:
                e2e[i], kinds[i] = last, spec.kind
    ttft[np.isinf(ttft)] = np.nan  # no node takes it: it fails under every policy
    e2e[np.isinf(e2e)] = np.nan
    return AloneLatency(ttft, e2e, kinds, cached)
