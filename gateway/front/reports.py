"""What the front gateway tells about itself without running a request: where a request would
go (``POST /v1/route``), the models it serves (``GET /v1/models``) and its health
(``GET /health``). Each only reads the gateway's state and the fleet's: none takes a
concurrency or fleet slot, charges a key, or dispatches to a node.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from gateway.auth import KeyIdentity
from gateway.front.dispatch import RouteName
from gateway.front.gateway import Gateway
from gateway.front.request_path import OpenAIRequest
from gateway.key_terms import apply_max_tokens, fleet_slots, tenant_of


async def route_only(
    gw: Gateway,
    data: dict[str, Any],
    route: RouteName,
    req: OpenAIRequest,
    request: Request,
    who: KeyIdentity,
) -> dict[str, Any]:
    """Where the request would go, in ``who``'s cache scope (its credited tokens only)."""
    model = gw.path.concrete_model(req.model)
    region = gw.path.client_region(request)
    salt = gw.scopes.salt(who)
    data = apply_max_tokens(data, who)
    prof, view = await gw.path.profile(data, route, model, region, who.key_id, salt)
    decision = gw.path.decide(prof, view)
    out = decision.to_dict()
    out["client_region"] = region
    if gw.fair is not None:  # the wait in its key's queue is part of the prediction
        gw.fair.observe_capacity(fleet_slots(view.nodes))
        wait, waiting = await gw.fair.expected_wait_ms(
            tenant_of(who, gw.config.auth.teams), decision.estimate.e2e_ms
        )
        out["gateway_queue_ms"] = round(wait, 2)
        out["gateway_queue_waiting"] = waiting
        out["predicted_ttft_ms"] = round(out["predicted_ttft_ms"] + wait, 2)
        out["predicted_e2e_ms"] = round(out["predicted_e2e_ms"] + wait, 2)
    return out


async def models(gw: Gateway) -> list[str]:
    """The virtual models whose target some node serves, then every model nodes serve."""
    view = await gw.store.view([])
    gw.path.learn_identities(view)
    names: list[str] = []
    for n in view.nodes:
        for m in n.models:
            if m not in names:
                names.append(m)
    virtual = [v for v, target in gw.config.virtual_models.items() if target in names]
    return virtual + names


def health(gw: Gateway) -> dict[str, Any]:
    """The gateway's health: its store, circuits, work in flight, streams, policy, warnings."""
    store_health = getattr(gw.store, "health", None)
    sh = store_health() if callable(store_health) else {}
    healthy = bool(getattr(gw.store, "healthy", True))
    return {
        "status": "ok" if healthy else "degraded",
        "store": sh,
        "circuits": gw.breakers.snapshot(),
        "in_flight": gw.in_flight,
        "streams": {
            "broken": gw.stream_stats.broken,
            "resumed": gw.stream_stats.resumed,
        },
        "policy": gw.policy_override or gw.router.config.policy,
        "policy_reload_error": gw.policy_source.last_error,
        "warnings": [*gw.warnings, *gw.client.guard.warnings()],
        "fair_share": gw.fair.health() if gw.fair is not None else None,
        **({"worker": gw.worker.describe()} if gw.worker is not None else {}),
    }
