"""The gateway's order on a node that takes it: where a prefix reuser is placed
(``routing.passes``), what the router predicts and tells the node, and the edge scheduler
following the places it is given."""

from __future__ import annotations

import pytest

from routing.blocks import BLOCK_SIZE
from routing.fleet.state import NodeKind, NodeState
from routing.fleet.store import FleetView
from routing.latency import LatencyKnobs
from routing.passes import Queued, place
from routing.policy_config import PolicyConfig
from routing.profile import RequestProfile
from routing.router import Router

NOW = 10_000.0


def _q(held: int = 0, ttft: float = 2000.0, waited: float = 100.0, delayed: float = 0.0,
       started: bool = False) -> Queued:  # fmt: skip
    return Queued(held, ttft, waited, delayed, started)


def test_a_reuser_passes_waiting_requests_with_room_from_the_back():
    queue = [_q(started=True), _q(started=True), _q(), _q(), _q()]
    # two slots held; three wait, each with room for a 500 ms passer (1000 ms at room 1.5)
    assert place(queue, 2, held_blocks=71, hold_ms=500.0, room=1.5) == 2
    # no gain from its prefix: stays last
    assert place(queue, 2, held_blocks=3, hold_ms=500.0, room=1.5) == 5
    # the last waiting one has no room left: nothing ahead of it is passed either
    tight = [*queue[:4], _q(ttft=600.0)]
    assert place(tight, 2, held_blocks=71, hold_ms=500.0, room=1.5) == 5
    # one already late, or delayed by earlier passers to its limit, is a barrier
    late = [*queue[:3], _q(waited=2500.0), _q()]
    assert place(late, 2, 71, 500.0, 1.5) == 4
    spent = [*queue[:3], _q(delayed=800.0), _q()]
    assert place(spent, 2, 71, 500.0, 1.5) == 4
    # a request holding as much of its prompt is not passed
    held = [*queue[:3], _q(held=70), _q()]
    assert place(held, 2, 71, 500.0, 1.5) == 4
    # the slots' holders are never passed, however many
    assert place(queue[:2], 2, 71, 500.0, 1.5) == 2


def _edge(**kw) -> NodeState:
    base = dict(
        id="edge-eu", kind=NodeKind.EDGE, region="eu-west", url="http://edge-eu", models=["m"],
        max_context=2048, device="cpu", max_batch=2, prefill_tokens_per_s=500.0,
        decode_ms_per_token=20.0, timestamp=NOW, prefix_cache=True, prefix_in_slots=True,
        gateway_order=True,
    )  # fmt: skip
    base.update(kw)
    return NodeState(**base)


def _profile(prompt: int, hashes: list[int], out: float = 16) -> RequestProfile:
    return RequestProfile(
        model="m", model_identity="m-id", route="chat", prompt_token_ids=list(range(prompt)),
        block_hashes=hashes, max_tokens=256, expected_output_tokens=out, stream=False,
        client_region="eu-west",
    )  # fmt: skip


def test_the_router_places_a_prefix_reuser_ahead_and_tells_the_node_its_place():
    """A two-slot edge: a user of an app's prompt in one slot, a long prompt in the other, two
    more waiting. The app's next user (the edge holds 71 blocks of its prompt) is placed ahead
    of the two waiting ones and predicted there (its wait is the slots' holders', not theirs
    too), its ticket's place just before the first it passed; each passed one counts the wait
    it adds. Off, it goes last."""

    def run(**knobs):
        clock = [NOW]
        r = Router(PolicyConfig(policy="edge_first", latency=LatencyKnobs(**knobs)),
                   clock=lambda: clock[0])  # fmt: skip
        node = _edge()
        fleet = FleetView(nodes=[node], prefix_blocks={node.id: 72}, stale=False)
        shared = _profile(1160, list(range(72)))
        tickets = [r.begin(r.decide(shared, fleet), profile=shared)]
        r.first_token(tickets[0])
        for i in range(3):
            clock[0] += 0.01
            p = _profile(600, [9000 + 100 * i + b for b in range(37)])
            tickets.append(r.begin(r.decide(p, FleetView([node], {}, False)), profile=p))
        clock[0] += 0.01
        decision = r.decide(shared, fleet)
        return r, tickets, decision, r.begin(decision, profile=shared)

    r, tickets, decision, ticket = run()
    est = decision.chosen.estimate
    assert est.placed_ahead == 2 and est.cached_tokens == 72 * BLOCK_SIZE
    # /v1/route says so, with the number
    assert "placed ahead of 2 waiting request(s)" in decision.detail
    assert decision.chosen.to_dict()["placed_ahead"] == 2
    assert tickets[1].order_at < ticket.order_at < tickets[2].order_at
    assert r.place(ticket) == pytest.approx(ticket.order_at)
    assert r.place(tickets[1]) == tickets[1].dispatched_at
    queue = r.ledger.queued("edge-eu", NOW + 0.05)
    assert [q.delayed_ms for q in queue] == [0.0, 0.0, 0.0, est.slot_ms, est.slot_ms]
    # the replay's order is the node's now: the next request sees the reuser third
    assert r.ledger.work("edge-eu", NOW + 0.05)[2].prefill_tokens < 100
    _, _, off, off_ticket = run(gateway_order=False)
    assert off.chosen.estimate.placed_ahead == 0
    assert off.chosen.estimate.ttft_ms > est.ttft_ms + 1000.0  # behind both long prompts
    assert r.place(off_ticket) is not None  # the node takes the gateway's order...
    r_off = Router(PolicyConfig(policy="edge_first", latency=LatencyKnobs(gateway_order=False)))
    assert r_off.place(off_ticket) is None  # ...unless the routing model does not use it


def test_a_place_becomes_an_arrival_time_no_later_than_now_and_not_far_back():
    from gateway.node_headers import ORDER_MAX_AHEAD_S, order_at, queue_time

    # sent 0.25 s ago by the wall clock: queued 0.25 s back on the node's own clock
    assert queue_time(1000.0, 1000.25, 50.0) == pytest.approx(49.75)
    assert queue_time(1001.0, 1000.0, 50.0) == 50.0  # a gateway clock ahead: now
    assert queue_time(0.0, 1000.0, 50.0) == 50.0 - ORDER_MAX_AHEAD_S
    assert order_at({}) is None
    assert order_at({"x-edgecloud-order-at": "12.5"}) == 12.5
    for bad in ("nan", "inf", "-inf", "soon"):
        with pytest.raises(ValueError):
            order_at({"x-edgecloud-order-at": bad})
