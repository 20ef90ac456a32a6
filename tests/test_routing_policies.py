"""Router.decide and every policy on constructed fleets.

The fleet mirrors the design's typical one: an edge node near the client (low RTT, small batch,
quick decode for small prompts, slow prefill) and a cloud node far away (high RTT, big batch,
fast prefill).
"""

from __future__ import annotations

import math
import os

import pytest

from routing.backlog import SharedPrefix
from routing.blocks import BLOCK_SIZE
from routing.fleet.state import NodeKind, NodeState
from routing.fleet.store import FleetView
from routing.latency import Estimate
from routing.latency import estimate as latency_estimate
from routing.latency.priors import ARRIVAL_WINDOW_S
from routing.policies import (
    STREAM_E2E_BOUND,
    Candidate,
    Decision,
    LatencyPolicy,
    NoRoute,
    PolicyInput,
)
from routing.policy_config import ConfigSource, PolicyConfig
from routing.profile import RequestProfile
from routing.router import Measured, Router

NOW = 10_000.0


def edge(node_id: str = "edge-eu", **kw) -> NodeState:
    base = dict(
        kind=NodeKind.EDGE,
        region="eu-west",
        url=f"http://{node_id}",
        models=["m"],
        max_context=2048,
        device="cpu",
        max_batch=4,
        prefill_tokens_per_s=500.0,
        decode_ms_per_token=20.0,
        timestamp=NOW,
    )
    base.update(kw)
    return NodeState(id=node_id, **base)


def cloud(node_id: str = "cloud-us", **kw) -> NodeState:
    base = dict(
        kind=NodeKind.CLOUD,
        region="us-east",
        url=f"http://{node_id}",
        models=["m"],
        max_context=8192,
        device="cuda",
        max_batch=64,
        running=10,
        prefill_tokens_per_s=8000.0,
        decode_ms_per_token=25.0,
        timestamp=NOW,
    )
    base.update(kw)
    return NodeState(id=node_id, **base)


def profile(prompt: int, out: float = 16, stream: bool = False, **kw) -> RequestProfile:
    base = dict(
        model="m",
        model_identity="m-id",
        route="chat",
        prompt_token_ids=list(range(prompt)),
        block_hashes=list(range(prompt // BLOCK_SIZE)),
        max_tokens=256,
        expected_output_tokens=out,
        stream=stream,
        client_region="eu-west",
    )
    base.update(kw)
    return RequestProfile(**base)


def view(*nodes: NodeState, prefix: dict[str, int] | None = None, stale=False) -> FleetView:
    return FleetView(nodes=list(nodes), prefix_blocks=prefix or {}, stale=stale)


def router(policy: str = "latency", **kw) -> Router:
    return Router(PolicyConfig(policy=policy, **kw), clock=lambda: NOW + 1)


FLEET = view(edge(), cloud())


def test_short_request_lands_on_the_edge_because_it_finishes_sooner():
    d = router().decide(profile(40), FLEET)
    assert (d.node_id, d.tier, d.reason, d.policy) == (
        "edge-eu",
        NodeKind.EDGE,
        "latency_e2e",
        "latency",
    )
    assert [c.node_id for c in d.fallbacks] == ["cloud-us"]
    cloud_est = d.fallbacks[0].estimate
    assert d.predicted_e2e_ms < cloud_est.e2e_ms
    # The edge's lead is RTT (2 ms vs ~84 ms); the cloud's is prefill and nothing else.
    assert d.estimate.rtt_ms == 2.0 and cloud_est.rtt_ms > 60
    assert d.predicted_ttft_ms == pytest.approx(2.0 + 40 / 500 * 1000)
    assert d.headers()["x-edgecloud-tier"] == "edge"
    assert d.headers()["x-edgecloud-reason"] == "latency_e2e"
    assert "edge-eu" in d.detail and "cloud-us" in d.detail


def test_long_request_goes_to_the_cloud_because_edge_prefill_is_slow():
    d = router().decide(profile(1500), FLEET)
    assert (d.node_id, d.tier) == ("cloud-us", NodeKind.CLOUD)
    assert d.predicted_e2e_ms < d.fallbacks[0].estimate.e2e_ms


def test_streams_take_the_first_token_unless_it_ends_far_later():
    r = router()
    short = r.decide(profile(40, stream=True), FLEET)
    assert (short.node_id, short.reason) == ("edge-eu", "latency_ttft")
    # 120 prompt tokens, 64 output: the cloud's first token comes sooner, the edge's last one
    # (it decodes faster), but the cloud's is within STREAM_E2E_BOUND x the edge's: a stream
    # takes the first token; non-streamed, the edge finishes sooner.
    p = dict(prompt=120, out=64)
    assert r.decide(profile(**p), FLEET).node_id == "edge-eu"
    stream = r.decide(profile(**p, stream=True), FLEET)
    assert (stream.node_id, stream.reason) == ("cloud-us", "latency_ttft")
    edge_est = stream.fallbacks[0].estimate
    assert stream.estimate.ttft_ms < edge_est.ttft_ms
    assert edge_est.e2e_ms < stream.estimate.e2e_ms <= STREAM_E2E_BOUND * edge_est.e2e_ms
    assert "left last" not in stream.why
    assert router(objective="ttft").decide(profile(**p, stream=True), FLEET).node_id == "cloud-us"
    e2e = router(objective="e2e")
    assert e2e.decide(profile(**p, stream=True), FLEET).node_id == "edge-eu"
    # The cloud's 10 decoding requests would each wait out its 15 ms prefill (150 ms in all):
    # counted, they outweigh the stream's own 106 ms gain there.
    assert (
        router(interference_weight=1.0).decide(profile(**p, stream=True), FLEET).node_id
        == "edge-eu"
    )


def _cand(node: NodeState, ttft_ms: float, e2e_ms: float) -> Candidate:
    est = Estimate(
        node_id=node.id,
        rtt_ms=1.0,
        queue_ms=0.0,
        prefill_ms=ttft_ms - 1.0,
        ttft_ms=ttft_ms,
        decode_ms_per_token=(e2e_ms - ttft_ms) / 63,
        e2e_ms=e2e_ms,
        cached_tokens=0,
        uncached_tokens=100,
    )
    return Candidate(node, est)


def _stream(*cands: Candidate, **cfg) -> Decision:
    inp = PolicyInput(profile(100, out=64, stream=True), cands, PolicyConfig(**cfg))
    return LatencyPolicy().decide(inp)


def test_a_stream_never_goes_where_it_would_end_far_later():
    # the embedded default: a CPU edge, and a CPU cloud node that prefills faster but decodes
    # at 150-190 ms/token: its first token ~100 ms sooner, its last ~5 s later
    e, c = _cand(edge("edge"), 200.0, 1200.0), _cand(cloud("cloud"), 100.0, 6000.0)
    d = _stream(e, c)
    assert (d.node_id, d.reason) == ("edge", "latency_ttft")
    assert [f.node_id for f in d.fallbacks] == ["cloud"]  # still there to fail over to
    assert d.why == (
        f"least predicted ttft among the nodes predicted to finish within "
        f"{STREAM_E2E_BOUND:g}x the soonest (cloud left last: predicted e2e over 2400 ms)"
    )
    # objective ttft asks for the first token whatever the end; e2e for the end
    assert _stream(e, c, objective="ttft").node_id == "cloud"
    assert _stream(e, c, objective="e2e").node_id == "edge"
    # the cloud a little slower to finish (within the bound): the sooner first token wins
    assert _stream(e, _cand(cloud("cloud"), 100.0, 2400.0)).node_id == "cloud"
    # alike nodes (six busy CPU edges): the least TTFT wins even where its e2e is not the least
    alike = [
        _cand(edge("edge-0"), 486.0, 3579.0),
        _cand(edge("edge-1"), 551.0, 3420.0),
        _cand(edge("edge-2"), 402.0, 3900.0),
        _cand(edge("edge-3"), 630.0, 3350.0),
    ]
    d = _stream(*alike)
    assert (d.node_id, d.reason, d.why) == ("edge-2", "latency_ttft", "least predicted ttft")
    assert [f.node_id for f in d.fallbacks] == ["edge-0", "edge-1", "edge-3"]
    # more than one left out: the near ones by TTFT, then the far ones by e2e
    d = _stream(
        _cand(edge("a"), 300.0, 1000.0),
        _cand(edge("b"), 250.0, 1900.0),
        _cand(cloud("c"), 50.0, 9000.0),
        _cand(cloud("d"), 80.0, 5000.0),
    )
    assert [x.node_id for x in d.candidates()] == ["b", "a", "d", "c"]
    assert "(c, d left last: predicted e2e over 2000 ms)" in d.why


def crossover(r: Router, fleet: FleetView) -> int:
    """The shortest prompt that the latency policy sends to the cloud."""
    for n in range(16, 2048, 16):
        if r.decide(profile(n), fleet).tier == NodeKind.CLOUD:
            return n
    return 2048


def test_no_fixed_threshold_the_cut_moves_with_load_and_measured_rates():
    r = router()
    base = crossover(r, FLEET)
    assert 16 < base < 2048
    # A busy edge (all slots taken, two waiting) sends even short prompts to the cloud.
    busy = view(edge(running=4, waiting=2), cloud())
    assert r.decide(profile(40), busy).node_id == "cloud-us"
    # The gateway measures the edge prefilling 4x slower than it reports: the cut moves down.
    d = r.decide(profile(400), view(edge(), cloud(prefill_tokens_per_s=1.0)))
    assert d.node_id == "edge-eu"
    ttft = 2 + 400 / 125 * 1000  # 125 tok/s prefill; decode at the reported 20 ms/token
    for _ in range(5):
        r.finish(
            r.begin(d),
            Measured(
                ttft_ms=ttft,
                e2e_ms=ttft + 15 * 20.0,
                prompt_tokens=400,
                completion_tokens=16,
                net_rtt_ms=2.0,
            ),
        )
    assert r.model.prefill_tokens_per_s(edge()) == pytest.approx(0.7 * 125 + 0.3 * 500)
    assert r.model.decode_ms_per_token_b1(edge()) == pytest.approx(20.0)
    assert crossover(r, FLEET) < base


def test_prefix_cache_credit_picks_the_node_holding_the_prefix():
    fleet = view(cloud("c-a"), cloud("c-b"), prefix={"c-b": 60})
    d = router().decide(profile(1000, block_hashes=list(range(62))), fleet)
    assert d.node_id == "c-b" and d.cached_tokens == 60 * BLOCK_SIZE
    assert d.headers()["x-edgecloud-cached-tokens"] == str(60 * BLOCK_SIZE)
    assert d.fallbacks[0].estimate.cached_tokens == 0
    assert d.predicted_ttft_ms < d.fallbacks[0].estimate.ttft_ms


def test_prompt_logprobs_get_no_prefix_credit_and_dearer_prompt_tokens():
    """A request for its prompt's logprobs (echo) computes every position: the prefix the
    node holds is not credited, and its prompt tokens cost the kind's measured factor."""
    from routing.latency.priors import EDGE

    caps = ["logprobs", "prompt_logprobs"]
    fleet = view(edge("e", capabilities=caps), prefix={"e": 30})
    echo = frozenset({"logprobs", "prompt_logprobs"})
    plain = router().decide(profile(500, block_hashes=list(range(31))), fleet)
    asked = router().decide(profile(500, block_hashes=list(range(31)), needs=echo), fleet)
    assert plain.cached_tokens == 30 * BLOCK_SIZE and asked.cached_tokens == 0
    cold = router().decide(profile(500), view(edge("e", capabilities=caps)))
    work = asked.estimate.basis.prefill_work_tokens
    assert work == pytest.approx(cold.estimate.basis.prefill_work_tokens * EDGE.prompt_logprob_cost)
    assert asked.predicted_ttft_ms > cold.predicted_ttft_ms > plain.predicted_ttft_ms


def test_eligibility_model_context_and_open_circuits():
    r = router()
    other_model = edge("e-other", models=["x"])
    tiny_ctx = edge("e-tiny", max_context=128)
    d = r.decide(profile(100), view(other_model, tiny_ctx, edge(), cloud()), exclude={"edge-eu"})
    assert d.node_id == "cloud-us" and d.fallbacks == ()
    cands, left_out = r.candidates(profile(100), view(other_model, tiny_ctx, edge()), {"edge-eu"})
    assert cands == [] and left_out == {
        "e-other": "model",
        "e-tiny": "context",
        "edge-eu": "excluded",
    }
    # A node can also match by the model's identity.
    by_identity = edge("e-id", models=["alias"], model_identities={"alias": "m-id"})
    assert r.decide(profile(10), view(by_identity)).node_id == "e-id"


def test_no_route_explains_why():
    r = router()
    with pytest.raises(NoRoute) as err:
        r.decide(profile(10, model="nope", model_identity="nope-id"), FLEET)
    assert err.value.code == "unknown_model"
    with pytest.raises(NoRoute) as err:
        r.decide(profile(8000), FLEET)
    assert err.value.code == "too_long" and err.value.reasons == {
        "edge-eu": "context",
        "cloud-us": "context",
    }
    with pytest.raises(NoRoute) as err:
        r.decide(profile(10), FLEET, exclude={"edge-eu", "cloud-us"})
    assert err.value.code == "unavailable"
    with pytest.raises(NoRoute) as err:
        r.decide(profile(10), view())
    assert err.value.code == "unknown_model"


def test_capabilities_and_choices_decide_eligibility_and_cost():
    """A request needing logprobs goes only to nodes advertising them, ``n`` only to nodes
    whose ``max_n`` takes it (else a NoRoute ``unsupported``), and ``n`` rows decode at a
    larger batch: a later end on the same node."""
    r = router()
    lp = frozenset({"logprobs"})
    able = edge("e-lp", capabilities=["logprobs", "prompt_logprobs"], max_n=4)
    plain = edge("e-plain")
    cands, left_out = r.candidates(profile(50, needs=lp), view(able, plain))
    assert [c.node.id for c in cands] == ["e-lp"] and left_out == {"e-plain": "capability"}
    _, left_out = r.candidates(profile(50, choices=5), view(able, plain))
    assert left_out == {"e-lp": "capability", "e-plain": "capability"}
    with pytest.raises(NoRoute) as err:
        r.decide(profile(50, choices=5), view(able, plain))
    assert err.value.code == "unsupported" and "n=5" in str(err.value)
    one = r.candidates(profile(50, out=64), view(able))[0][0].estimate
    four = r.candidates(profile(50, out=64, choices=4), view(able))[0][0].estimate
    assert four.e2e_ms > one.e2e_ms and four.batch > one.batch


def test_one_capability_filter_names_the_field_no_node_serves():
    """Grammar, logprobs and ``n`` go through one filter; the NoRoute names the request field
    some node lacked (a grammar's ``response_format`` before ``logprobs``, ``n`` last), and
    the body's needs are the union of what it asks for."""
    r = router()
    gram = edge("e-g", capabilities=["grammar"], max_n=4)
    lp = edge("e-lp", capabilities=["logprobs", "prompt_logprobs"], max_n=1)
    both = frozenset({"grammar", "logprobs"})
    with pytest.raises(NoRoute) as err:
        r.decide(profile(50, needs=both), view(gram, lp))
    assert err.value.code == "unsupported" and err.value.param == "response_format"
    assert "grammar (response_format), logprobs" in str(err.value)
    with pytest.raises(NoRoute) as err:  # e-g lacks logprobs, e-lp takes one choice
        r.decide(profile(50, needs=frozenset({"logprobs"}), choices=3), view(gram, lp))
    assert err.value.param == "logprobs"
    with pytest.raises(NoRoute) as err:
        r.decide(profile(50, choices=8), view(gram, lp))
    assert err.value.param == "n"
    all_of = edge("e-all", capabilities=["grammar", "logprobs", "prompt_logprobs"], max_n=4)
    d = r.decide(profile(50, needs=both, choices=2), view(gram, lp, all_of))
    assert [c.node.id for c in d.candidates()] == ["e-all"]

    from routing.request_body import needed_capabilities

    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    body = {"response_format": rf, "logprobs": 2, "echo": True}
    assert needed_capabilities(body, "completions") == {"grammar", "logprobs", "prompt_logprobs"}
    chat = {"response_format": {"type": "json_object"}, "logprobs": True}
    assert needed_capabilities(chat, "chat") == {"grammar", "logprobs"}
    assert needed_capabilities({"response_format": {"type": "text"}}, "chat") == frozenset()


def test_threshold_policy_cuts_on_prompt_length_only():
    r = Router(PolicyConfig(policy="threshold", threshold={"prompt_tokens": 100}))
    busy_edge = view(edge(running=4, waiting=8), cloud())
    d = r.decide(profile(100), busy_edge)  # latency would say cloud; threshold says edge
    assert (d.node_id, d.reason) == ("edge-eu", "threshold_short")
    d = r.decide(profile(101), FLEET)
    assert (d.node_id, d.reason) == ("cloud-us", "threshold_long")
    assert [c.node_id for c in d.fallbacks] == ["edge-eu"]
    d = r.decide(profile(500), view(edge()))
    assert (d.node_id, d.reason) == ("edge-eu", "threshold_no_cloud")


def test_round_robin_cycles_through_every_node():
    r = router("round_robin")
    fleet = view(cloud("c"), edge("a"), edge("b"))
    chosen = [r.decide(profile(10), fleet).node_id for _ in range(6)]
    assert chosen == ["a", "b", "c", "a", "b", "c"]
    d = r.decide(profile(10), fleet)
    assert d.reason == "round_robin" and [c.node_id for c in d.fallbacks] == ["b", "c"]


def test_least_loaded_picks_the_lowest_occupancy():
    fleet = view(edge("a", running=3), edge("b", running=1), cloud("c", running=48))
    d = router("least_loaded").decide(profile(10), fleet)
    assert (d.node_id, d.reason) == ("b", "least_loaded")
    assert [c.node_id for c in d.fallbacks] == ["a", "c"]  # 0.75 before 0.77


def test_edge_first_uses_an_edge_with_room_else_the_cloud():
    r = router("edge_first")
    d = r.decide(profile(1500), FLEET)  # long, but edge_first does not care
    assert (d.node_id, d.reason) == ("edge-eu", "edge_first")
    d = r.decide(profile(10), view(edge(running=4), cloud()))
    assert (d.node_id, d.reason) == ("cloud-us", "edge_full")
    assert [c.node_id for c in d.fallbacks] == ["edge-eu"]


def test_cloud_only_never_picks_an_edge():
    r = router("cloud_only")
    ext = NodeState(
        id="vllm",
        kind=NodeKind.OPENAI,
        region="eu-west",
        url="http://v",
        models=["m"],
        max_context=8192,
        device="external",
        max_batch=32,
        timestamp=NOW,
    )
    d = r.decide(profile(10), view(edge(), cloud(), ext))
    assert d.tier in (NodeKind.CLOUD, NodeKind.OPENAI) and d.reason == "cloud_only"
    assert {c.node_id for c in d.candidates()} == {"cloud-us", "vllm"}
    with pytest.raises(NoRoute):
        r.decide(profile(10), view(edge()))


def test_policy_can_be_chosen_per_call_and_decisions_serialize():
    r = router()
    d = r.decide(profile(40), FLEET, policy="cloud_only")
    assert d.policy == "cloud_only" and d.node_id == "cloud-us"
    body = r.decide(profile(40), view(edge(), cloud(), stale=True)).to_dict()
    assert body["node"] == "edge-eu" and body["stale_view"] is True
    assert [c["node"] for c in body["candidates"]] == ["edge-eu", "cloud-us"]
    assert body["predicted_e2e_ms"] < body["candidates"][1]["predicted_e2e_ms"]
    with pytest.raises(ValueError, match="unknown policy"):
        r.decide(profile(40), FLEET, policy="fastest")


def test_dispatches_since_the_last_heartbeat_count_as_load():
    clock = [NOW + 0.5]
    r = Router(PolicyConfig(), clock=lambda: clock[0])
    fleet = view(edge(), cloud())
    tickets = []
    for _ in range(8):
        d = r.decide(profile(40), fleet)
        tickets.append(r.begin(d, profile=profile(40)))
    placed = [t.node.id for t in tickets]
    assert placed.count("edge-eu") < 8 and "cloud-us" in placed  # the burst spills over
    assert r.in_flight("edge-eu") == placed.count("edge-eu")
    # A newer heartbeat already includes them: they are not counted twice.
    newer = view(edge(timestamp=clock[0] + 1, running=placed.count("edge-eu")), cloud())
    assert r.candidates(profile(40), newer)[0][1].estimate.load == placed.count("edge-eu") / 4
    # the next decision names what it assumed: the requests in hand and the wait for a slot
    d = r.decide(profile(40), fleet)
    h = d.headers()
    # ours in flight there, plus the node's own running count (others', as its state predates ours)
    assert int(h["x-edgecloud-in-hand"]) == r.in_flight(d.node_id) + d.node.running > 0
    assert float(h["x-edgecloud-predicted-queue-ms"]) == round(d.estimate.queue_ms, 1)
    assert float(h["x-edgecloud-predicted-prefill-ms"]) == round(d.estimate.own_prefill_ms, 1)
    assert d.estimate.own_prefill_ms > 0
    assert h["x-edgecloud-expected-output-tokens"] == "16.0"
    for t in tickets:
        r.finish(t)
    assert r.in_flight("edge-eu") == 0
    assert r.decide(profile(40), fleet).node_id == "edge-eu"
    assert r.finish(tickets[0], Measured(e2e_ms=1.0, prompt_tokens=1, completion_tokens=1)) == {}


def test_finish_learns_output_length_and_records_errors():
    r = router()
    p = profile(40, api_key="team-a")
    d = r.decide(p, FLEET)
    errors = r.finish(
        r.begin(d, profile=p),
        Measured(ttft_ms=100.0, e2e_ms=900.0, prompt_tokens=40, completion_tokens=40),
    )
    assert set(errors) == {"ttft", "e2e"} and errors["e2e"] > 0
    assert r.outputs.expected("team-a", "chat") == 40.0
    assert r.outputs.expected("team-b", "chat") == 128.0
    assert r.model.errors.get("e2e", "edge").count == 1


def test_choices_in_hand_count_as_rows_for_later_decisions():
    """A request of n=3 in flight is three rows: the ledger's counts and work in hand say so,
    so the next request on that node is predicted to decode beside three rows, not one."""
    lone, many = router(), router()
    node = edge(max_n=4)
    for r, n in ((lone, 1), (many, 3)):
        p = profile(40, out=32, choices=n)
        r.begin(r.decide(p, view(node)), profile=p)
    assert lone.ledger.in_flight_at("edge-eu", NOW + 2) == 1
    assert many.ledger.in_flight_at("edge-eu", NOW + 2) == 3
    assert len(many.ledger.work("edge-eu", NOW + 1)) == 3
    after_lone = lone.candidates(profile(40, out=32), view(node))[0][0].estimate
    after_many = many.candidates(profile(40, out=32), view(node))[0][0].estimate
    assert after_many.batch > after_lone.batch and after_many.e2e_ms > after_lone.e2e_ms


def test_a_reply_of_n_choices_teaches_the_length_of_one():
    """Usage counts every choice's tokens; the output length learned is one choice's."""
    r = router()
    p = profile(40, api_key="team-n", choices=4)
    r.finish(
        r.begin(r.decide(p, view(edge(max_n=4), cloud(max_n=64))), profile=p),
        Measured(ttft_ms=100.0, e2e_ms=900.0, prompt_tokens=40, completion_tokens=160),
    )
    assert r.outputs.expected("team-n", "chat") == 40.0


def test_hot_reloaded_config_changes_the_policy_and_keeps_learning(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("policy: latency\nobjective: e2e\n")
    src = ConfigSource(path, check_interval_s=0.0)
    r = Router(src, clock=lambda: NOW)
    d = r.decide(profile(40), FLEET)
    assert d.reason == "latency_e2e"
    r.finish(
        r.begin(d), Measured(ttft_ms=500.0, e2e_ms=900.0, prompt_tokens=100, completion_tokens=20)
    )
    learned = r.model.rates["edge-eu"].prefill_tokens_per_s.n
    path.write_text("policy: cloud_only\nobjective: ttft\n")
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    assert src.check() is True
    d = r.decide(profile(40), FLEET)
    assert d.policy == "cloud_only" and d.node_id == "cloud-us"
    assert r.config.objective == "ttft"
    assert r.model.rates["edge-eu"].prefill_tokens_per_s.n == learned == 1


def test_router_shares_the_estimator_it_is_given():
    from routing.output_length import OutputLengthEstimator

    est = OutputLengthEstimator()  # empty (and so falsy): must still be the one used
    assert Router(outputs=est).outputs is est


def test_a_node_state_taken_before_our_requests_finished_is_not_double_counted():
    """The node's state still counts two requests of ours that finished since it was taken:
    they are ours, not other gateways' (the next decision sees no unknown load)."""
    clock = [NOW + 0.5]
    r = Router(PolicyConfig(), clock=lambda: clock[0])
    fleet = view(edge(), cloud())
    tickets = [r.begin(r.decide(profile(40), fleet), profile=profile(40)) for _ in range(2)]
    node = tickets[0].node.id
    clock[0] += 1.0
    taken_at = clock[0]  # the node reports both as running at this moment
    clock[0] += 0.5
    for t in tickets:
        if t.node.id == node:
            r.finish(t)
    running = sum(t.node.id == node for t in tickets)
    stale = {"edge-eu": edge, "cloud-us": cloud}[node](timestamp=taken_at, running=running)
    other = cloud() if node == "edge-eu" else edge()
    cands = {c.node.id: c for c in r.candidates(profile(40), view(stale, other))[0]}
    assert cands[node].estimate.in_hand == 0


def test_the_typical_newcomer_is_the_median_of_what_was_sent_lately():
    """One long prompt among short ones does not make every newcomer long; nothing sent
    within the window: no newcomer expected."""
    clock = [NOW]
    r = Router(PolicyConfig(policy="edge_first"), clock=lambda: clock[0])
    fleet = view(edge(max_batch=64))
    for n in [40, 40, 40, 1500, 40]:
        p = profile(n, out=16)
        r.finish(r.begin(r.decide(p, fleet), profile=p))
        clock[0] += 0.5
    typical = r.ledger.typical("edge-eu", clock[0])
    assert typical is not None
    assert (typical.prefill_tokens, typical.decode_steps, typical.context) == (40.0, 15.0, 40.0)
    clock[0] += ARRIVAL_WINDOW_S + 1.0
    assert r.ledger.typical("edge-eu", clock[0]) is None


def test_arrivals_hold_the_node_at_what_it_has_and_blend_into_the_decode(monkeypatch):
    """Requests sent after the decision keep the node at what it holds with the new one (each
    finish replaced by a typical newcomer): an idle node expects no one beside it. The decode
    time is the geometric blend, by ``ARRIVAL_WEIGHT``, of the replays without (0) and with
    them (1); the first token is the same in all."""
    clock = [NOW]
    r = Router(PolicyConfig(policy="edge_first"), clock=lambda: clock[0])
    fleet = view(edge(max_batch=64))

    def estimate(weight: float) -> Estimate:
        monkeypatch.setattr(latency_estimate, "ARRIVAL_WEIGHT", weight)
        return r.candidates(profile(40, out=64), fleet)[0][0].estimate

    p = profile(40, out=4)
    r.finish(r.begin(r.decide(p, fleet), profile=p))
    clock[0] += 0.01
    assert estimate(1.0) == estimate(0.0)  # idle: held at the new one alone
    for _ in range(3):  # three in hand: held at four, each finish replaced
        r.begin(r.decide(p, fleet), profile=p)
    clock[0] += 0.01
    without, full, half = estimate(0.0), estimate(1.0), estimate(0.5)
    decode = {k: e.e2e_ms - e.ttft_ms for k, e in [("0", without), ("1", full), ("h", half)]}
    assert decode["1"] > 1.5 * decode["0"]  # the arrivals slow its decode
    assert decode["h"] == pytest.approx(math.sqrt(decode["0"] * decode["1"]))
    assert half.ttft_ms == pytest.approx(full.ttft_ms) == pytest.approx(without.ttft_ms)
    assert without.basis.mean_batch < half.basis.mean_batch < full.basis.mean_batch


def test_a_long_prefill_is_kept_off_the_node_whose_answers_it_would_stall():
    busy = edge("edge-a", prefill_tokens_per_s=1000.0, running=3)  # three answers streaming
    idle = edge("edge-b", prefill_tokens_per_s=500.0)
    fleet = view(busy, idle)
    alone = router().decide(profile(1000), fleet)  # the default: each request for itself
    assert alone.node_id == "edge-a"  # its own prefill is twice as fast there
    # there, its 1 s of prefill would hold up each of the three for 1 s: 3 s in all
    d = router(interference_weight=1.0).decide(profile(1000), fleet)
    assert d.node_id == "edge-b"
    held = d.fallbacks[0].estimate.stalled_others_ms
    assert held == pytest.approx(3 * d.fallbacks[0].estimate.own_prefill_ms)
    assert d.estimate.stalled_others_ms == 0.0
    assert "holds up others 3000 ms" in d.detail


def test_a_late_request_is_still_at_it():
    """Every reply's first token is seen (a stream's first chunk, a whole reply's headers), so
    a request past its predicted first token without one is still prefilling, and one past its
    predicted last token is still decoding: by default half of what it had is taken as left;
    with ``overrun_left`` 0, a token of its prompt (its last chunk) or one decode step."""
    clock = [NOW]
    r = Router(PolicyConfig(policy="edge_first"), clock=lambda: clock[0])
    fleet = view(edge())
    p = profile(400, out=16)
    t = r.begin(r.decide(p, fleet), profile=p)
    work = t.estimate.basis.prefill_work_tokens
    ttft_s = (t.estimate.ttft_ms - t.estimate.rtt_ms) / 1000.0
    clock[0] += ttft_s / 2  # half way to its predicted first token: half of it left
    assert r.ledger.work("edge-eu", clock[0])[0].prefill_tokens == pytest.approx(work / 2)
    clock[0] += ttft_s  # late, no first token: still prefilling
    late = r.ledger.work("edge-eu", clock[0], 0.5)[0]
    assert (late.prefill_tokens, late.decode_steps) == (pytest.approx(work / 2), 15.0)
    queued = r.candidates(profile(40), fleet)[0][0].estimate
    assert r.ledger.work("edge-eu", clock[0], 0.0)[0].prefill_tokens == 1.0  # its last chunk
    r.first_token(t)  # its first token: now it decodes, its prompt done
    seen = r.ledger.work("edge-eu", clock[0])[0]
    assert seen.prefill_tokens == 0.0 and seen.decode_steps == 15.0
    assert r.candidates(profile(40), fleet)[0][0].estimate.ttft_ms < queued.ttft_ms
    # past its predicted last token, not finished: still decoding, half its steps taken as left
    clock[0] += 15 * t.estimate.decode_ms_per_token / 1000.0 * 3
    assert r.ledger.work("edge-eu", clock[0], 0.5)[0].decode_steps == pytest.approx(7.5)
    assert r.ledger.work("edge-eu", clock[0], 0.0)[0].decode_steps == 1.0  # one step


def test_a_streams_relayed_tokens_say_how_far_its_decode_is():
    """A stream's progress is what the gateway relayed of it, not its prediction: a node
    slower than predicted keeps its answers' steps in the replay, a faster one drops them."""
    clock = [NOW]
    r = Router(PolicyConfig(policy="edge_first"), clock=lambda: clock[0])
    fleet = view(edge())
    p = profile(40, out=21)
    t = r.begin(r.decide(p, fleet), profile=p)
    r.first_token(t)
    per_token_s = t.estimate.decode_ms_per_token / 1000.0
    clock[0] += 30 * per_token_s  # past its predicted 20 steps, but only 5 tokens relayed
    r.progress(t, 5)
    assert r.ledger.work("edge-eu", clock[0])[0].decode_steps == 15.0  # 4 done, or 5 at most
    r.progress(t, 3)  # an older count changes nothing
    assert r.ledger.work("edge-eu", clock[0])[0].decode_steps == 15.0
    r.progress(t, 18)  # faster than the clock says: 17 or 18 done
    assert r.ledger.work("edge-eu", clock[0])[0].decode_steps == 2.0
    r.progress(t, 40)  # longer than expected: one more step at least
    assert r.ledger.work("edge-eu", clock[0])[0].decode_steps == 1.0


def test_the_ledger_says_how_many_requests_a_node_held_over_a_span():
    """Time-averaged requests in hand over a span: in flight ones for the part of it they were
    there, finished ones until they finished, none before or after."""
    from routing.ledger import DispatchLedger

    ledger = DispatchLedger()
    ledger.add("n", 0.0, 1)
    ledger.add("n", 1.0, 2)
    ledger.add("n", 5.0, 3)
    assert ledger.remove("n", 1.0, 2, now=3.0)
    # over [2, 4]: #1 all of it, #2 from 2 to 3, #3 not yet sent
    assert ledger.mean_in_flight("n", 2.0, 4.0) == pytest.approx((2.0 + 1.0) / 2.0)
    # over [4, 6]: #1 all of it, #3 from 5
    assert ledger.mean_in_flight("n", 4.0, 6.0) == pytest.approx((2.0 + 1.0) / 2.0)
    assert ledger.mean_in_flight("n", 6.0, 6.0) == 0.0
    assert ledger.mean_in_flight("other", 0.0, 10.0) == 0.0


def test_a_prompt_in_hand_twice_is_replayed_computing_its_prefix_once():
    """On a node with a prefix cache the second request of one prompt, queued behind the first,
    takes the first's blocks once that one has prefilled them: its own prefill and what the
    next request waits for are its last block's, not the whole prompt's. A node that keeps no
    prefix cache computes it twice."""

    def two_then_one(node: NodeState) -> tuple[Estimate, Estimate, float]:
        r = Router(PolicyConfig(policy="edge_first"), clock=lambda: NOW)
        fleet = view(node)
        p = profile(800)  # 50 blocks; the engines reuse 49 (a token is always computed)
        first = r.begin(r.decide(p, fleet), profile=p)
        decision = r.decide(p, fleet)
        second = r.begin(decision, profile=p)
        taken = "tokens of prefill taken from a request in hand" in decision.detail
        assert taken == (second.estimate.reused_tokens > 0)  # /v1/route says so
        later = r.decide(profile(40, block_hashes=[900, 901]), fleet)
        return first.estimate, second.estimate, later.predicted_ttft_ms

    slot = edge(max_batch=1, prefix_cache=True)
    first, second, later = two_then_one(slot)
    assert first.reused_tokens == 0.0 and first.basis.prefill_work_tokens == 800.0
    assert second.reused_tokens == 49 * BLOCK_SIZE
    assert second.basis.prefill_work_tokens == 800.0 - 49 * BLOCK_SIZE
    assert second.own_prefill_ms == pytest.approx(16 / 500 * 1000)
    cold = two_then_one(edge(max_batch=1))
    assert cold[1].reused_tokens == 0.0 and cold[1].basis.prefill_work_tokens == 800.0
    # the later request waits for the second's whole prompt: 784 tokens at 500/s more
    assert cold[2] - later == pytest.approx(784 / 500 * 1000, rel=0.05)
    # two slots: the second starts beside the first, before its blocks exist, and computes them
    _, beside, _ = two_then_one(edge(max_batch=2, prefix_cache=True))
    assert beside.reused_tokens == 0.0


def test_the_ledger_says_which_request_in_hand_shares_a_prompts_blocks():
    r = Router(PolicyConfig(policy="edge_first"), clock=lambda: NOW)
    fleet = view(edge(max_batch=1, prefix_cache=True))
    a, b = profile(800), profile(400, block_hashes=[1007, 1008, 1009])
    for p in (b, a, a):
        r.begin(r.decide(p, fleet), profile=p)
    work = r.ledger.work("edge-eu", NOW)
    assert [w.shared for w in work] == [None, None, SharedPrefix(1, 49.0 * BLOCK_SIZE)]
    shared = r.ledger.shared_prefix
    assert shared("edge-eu", list(range(30))) == SharedPrefix(1, 30.0 * BLOCK_SIZE)
    assert shared("edge-eu", [1007, 1008, 1010]) == SharedPrefix(0, 2.0 * BLOCK_SIZE)
    assert shared("edge-eu", [5000]) is None


def test_a_prefix_kept_in_slots_is_not_credited_once_every_slot_went_to_other_prompts():
    """An edge keeps prefixes in its slots: once this gateway has a slot's worth of requests
    there without the prompt, all sent after the last one with it left, every slot was taken
    by a prompt without it, so the index's credit (it hears of the overwrite only from the
    node's next events) is stale. One with it in hand, or one that left after the others were
    sent (its slot kept it), keeps the credit; a node with a paged cache keeps it too."""
    clock = [NOW]
    shared = profile(800)  # 50 blocks, 49 reusable

    def credited(node: NodeState, others: int, sharer: str = "") -> int:
        r = Router(PolicyConfig(policy="edge_first"), clock=lambda: clock[0])
        fleet = view(node, prefix={node.id: 50})
        if sharer == "before":  # it left before the others were sent
            t = r.begin(r.decide(shared, fleet), profile=shared)
            r.finish(t)
        for i in range(others):
            clock[0] += 0.001
            p = profile(40, block_hashes=[5000 + 10 * i, 5001 + 10 * i])
            r.begin(r.decide(p, fleet), profile=p)
        if sharer == "in_hand":
            r.begin(r.decide(shared, fleet), profile=shared)
        if sharer == "after":  # it leaves after the others were sent: its slot keeps it
            t = r.begin(r.decide(shared, fleet), profile=shared)
            clock[0] += 0.001
            r.finish(t)
        return r.decide(shared, fleet).estimate.cached_tokens

    slots = edge(max_batch=4, prefix_cache=True, prefix_in_slots=True)
    assert credited(slots, 3) == 49 * BLOCK_SIZE  # a slot may still keep it
    assert credited(slots, 4) == 0
    assert credited(slots, 4, "before") == 0
    assert credited(slots, 4, "in_hand") == 49 * BLOCK_SIZE  # it holds or writes it
    assert credited(slots, 4, "after") == 49 * BLOCK_SIZE
    paged = edge(max_batch=4, prefix_cache=True)
    assert credited(paged, 8) == 49 * BLOCK_SIZE
