"""The ``NodeState`` a simulated node pushes to the fleet view: :func:`state_template` holds
what never changes over a run (id, kind, region, model, context, watts, engine traits) and
:func:`pushed_state` copies it with the node's live counters and reported rates at a push.
Invariant: a pushed state is a ``model_copy`` of the node's template (no validation on the
simulator's hot path), so it differs from the template only in the fields the node measures.
"""

from __future__ import annotations

from routing.fleet.state import NodeKind, NodeState
from routing.power import Watts
from routing.sim.cloud import CloudSim
from routing.sim.edge import EdgeSim
from routing.sim.fleet import FleetSpec


def state_template(
    fleet: FleetSpec, node: EdgeSim | CloudSim, region: str, watts: Watts | None
) -> NodeState:
    """The node's state before it has run anything (its reported rates still those it starts
    with)."""
    return NodeState(
        id=node.id,
        kind=NodeKind.EDGE if node.kind == "edge" else NodeKind.CLOUD,
        region=region,
        url=f"sim://{node.id}",
        models=[fleet.model],
        model_identities={fleet.model: fleet.model_identity},
        max_context=node.max_context,
        timestamp=0.0,
        watts_idle=watts.idle if watts else None,
        watts_load=watts.load if watts else None,
        power_source="configured" if watts else "",
        **node.traits().model_dump(),
    )


def pushed_state(template: NodeState, node: EdgeSim | CloudSim, t: float) -> NodeState:
    """The node's state at ``t`` (a copy of its template: no validation on the hot path)."""
    used, total = node.kv()
    hit = node.cached_tokens / node.prompt_tokens if node.prompt_tokens else 0.0
    chunk, chunk_decoding = node.reported_chunks()
    return template.model_copy(
        update={
            "running": node.running,
            "waiting": len(node.waiting),
            "kv_blocks_used": used,
            "kv_blocks_total": total,
            "prefill_tokens_per_s": node.prefill_tps,
            "decode_ms_per_token": node.decode_ms,
            "prefix_hit_rate": hit,
            "prefill_chunk": chunk,
            "prefill_chunk_decoding": chunk_decoding,
            "step_cost": node.fitted_step_cost(),
            "timestamp": t,
        }
    )
