"""The simulated fleet built from a :class:`~routing.sim.fleet.FleetSpec` and a policy config:
:func:`build_nodes` makes each expanded node (an ``EdgeSim`` or ``CloudSim`` from its profile,
warmed as asked) and :func:`build_gateways` each gateway replica (a real ``Router`` on the
simulator's clock, knowing the fleet's RTTs as configured overrides). Invariants: nodes and
replicas come in the fleet file's order (a node's index is its position in ``expanded()``, a
replica's its position over ``gateways`` and their ``replicas``); the config passed in is
never mutated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from routing.policy_config import PolicyConfig
from routing.power import Watts
from routing.router import Router
from routing.sim.blind_ledger import BlindLedger
from routing.sim.cloud import CloudSim
from routing.sim.edge import EdgeSim
from routing.sim.fleet import FleetSpec
from routing.sim.node import EventSink


@dataclass
class SimGateway:
    index: int
    region: str
    overhead_s: float
    router: Router


@dataclass
class SimNodes:
    """The fleet's nodes and, index for index, their regions and profiles' watts."""

    nodes: list[EdgeSim | CloudSim] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)
    watts: list[Watts | None] = field(default_factory=list)  # None: the profile gives none
    by_id: dict[str, int] = field(default_factory=dict)
    prefix_nodes: list[str] = field(default_factory=list)  # ids of those with a prefix cache


def build_nodes(
    fleet: FleetSpec,
    sink_for: Callable[[str], EventSink],
    *,
    warm_prompts: Sequence[int] = (),
    warm_decode_tokens: int = 4,
    warm_rates: Mapping[str, tuple[float, float]] | None = None,
) -> SimNodes:
    """Every node of ``fleet`` from its profile, reporting its block events to
    ``sink_for(node_id)``; warmed on ``warm_prompts``, or starting at ``warm_rates[node_id]``
    (prefill tokens/s, decode ms/token) where given."""
    out = SimNodes()
    for i, (nid, spec) in enumerate(fleet.expanded()):
        prof = fleet.profile(spec)
        cost = prof.cost_model()
        sink = sink_for(nid)
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
        node.request_overhead_s = prof.request_overhead_ms / 1000.0  # type: ignore[attr-defined]
        node.max_context = prof.max_context
        node.device = prof.device or prof.name
        node.warm(warm_prompts, warm_decode_tokens)
        if warm_rates and nid in warm_rates:
            node.seed_rates(*warm_rates[nid])
        out.nodes.append(node)
        out.regions.append(spec.region)
        idle, load = prof.watts_idle, prof.watts_load
        out.watts.append(None if idle is None or load is None else Watts(idle, load))
        out.by_id[nid] = i
        if spec.prefix_cache:
            out.prefix_nodes.append(nid)
    return out


def build_gateways(
    fleet: FleetSpec,
    config: PolicyConfig,
    clock: Callable[[], float],
    *,
    count_in_flight: bool = True,
) -> list[SimGateway]:
    """Every gateway replica of ``fleet``, each a fresh ``Router`` on ``config`` in its region;
    with ``count_in_flight=False`` each router's ledger is a :class:`BlindLedger`."""
    # the routers know the fleet's RTTs as configured overrides (the operator's table)
    regions = config.regions.model_copy(
        update={
            "rtt_overrides": [*config.regions.rtt_overrides, *fleet.regions.rtt_ms],
            "table": {**fleet.regions.table, **config.regions.table},
            "intra_region_ms": fleet.regions.intra_region_ms,
        }
    )
    gateways: list[SimGateway] = []
    for g in fleet.gateways:
        for _ in range(g.replicas):
            cfg = config.model_copy(update={"regions": regions, "gateway_region": g.region})
            router = Router(cfg, clock=clock)
            if not count_in_flight:
                router.ledger = BlindLedger()
            gateways.append(SimGateway(len(gateways), g.region, g.overhead_ms / 1000.0, router))
    return gateways
