"""The latency cost model: its formula, queueing, and rates that move with measurements."""

from __future__ import annotations

import pytest

from routing.backlog import Work
from routing.fleet.state import NodeKind, NodeState
from routing.latency import LatencyModel, Observation, priors, rates


@pytest.fixture
def consts(monkeypatch: pytest.MonkeyPatch):
    """Set the rate book's constants (``routing.latency.priors``) for one test, by name."""

    def set_(**values: float) -> None:
        for name, value in values.items():
            monkeypatch.setattr(rates, name.upper(), value)

    return set_


def node(node_id: str = "e1", kind: NodeKind = NodeKind.EDGE, **kw) -> NodeState:
    defaults = dict(
        region="eu-west",
        url="http://x",
        models=["m"],
        max_context=4096,
        device="cpu",
        max_batch=4,
        prefill_tokens_per_s=500.0,
        decode_ms_per_token=20.0,
    )
    defaults.update(kw)
    return NodeState(id=node_id, kind=kind, **defaults)


def finished(
    node_id: str, kind: NodeKind, prompt: int, completion: int, *, ttft_ms: float,
    e2e_ms: float, rtt_ms: float,
) -> Observation:  # fmt: skip
    """A request that finished on ``node_id`` with nothing cached and no prediction."""
    return Observation(
        node_id=node_id,
        kind=kind,
        prompt_tokens=prompt,
        cached_tokens=0,
        completion_tokens=completion,
        ttft_ms=ttft_ms,
        e2e_ms=e2e_ms,
        net_rtt_ms=rtt_ms,
    )


def est(
    model: LatencyModel,
    n: NodeState,
    prompt=100,
    cached=0,
    out=10.0,
    rtt=5.0,
    extra=0,
    ahead: list[Work] | None = None,
):
    return model.estimate(
        n,
        prompt_tokens=prompt,
        cached_tokens=cached,
        expected_output_tokens=out,
        rtt_ms=rtt,
        extra_inflight=extra,
        ahead=ahead,
    )


def test_formula_on_an_idle_node():
    m = LatencyModel()
    e = est(m, node())
    # ttft = rtt 5 + queue 0 + 100 tokens / 500 tok/s; the prefill gives the first token, the
    # other 9 take a decode step of 20 ms each
    assert (e.queue_ms, e.prefill_ms, e.ttft_ms) == (0.0, 200.0, 205.0)
    assert e.decode_ms_per_token == 20.0 and e.batch == 1
    assert e.e2e_ms == pytest.approx(385.0)
    assert e.uncached_tokens == 100 and e.cached_tokens == 0


def test_prefix_cache_credit_and_one_token_minimum():
    m = LatencyModel()
    e = est(m, node(), prompt=100, cached=64)
    assert (e.cached_tokens, e.uncached_tokens) == (64, 36)
    assert e.prefill_ms == pytest.approx(72.0)
    # All cached: as the engines do, the last block is computed again so that at least one
    # token gives the next token's logits; credit is whole blocks only.
    e = est(m, node(), prompt=32, cached=32)
    assert (e.cached_tokens, e.uncached_tokens) == (16, 16)
    e = est(m, node(), prompt=33, cached=32)
    assert (e.cached_tokens, e.uncached_tokens) == (32, 1)
    assert est(m, node(), prompt=100, cached=70).cached_tokens == 64


def test_batch_slows_decode_and_a_full_node_queues():
    m = LatencyModel()
    # The node reports 20 ms/token while running 2: normalized to batch 1 that is 20 / 1.6.
    busy = node(running=2)
    d1 = 20.0 / 1.6
    e = est(m, busy)
    # a new request waits for the step in flight: half a step of 2 rows, on average
    assert e.batch == 3 and e.queue_ms == pytest.approx(0.5 * d1 * 1.6)
    assert e.decode_ms_per_token == pytest.approx(d1 * (1 + 0.6 * 2))

    full = node(running=4, waiting=1)  # 4 slots, 1 waiting: we are second in line
    e = est(m, full)
    d1 = 20.0 / (1 + 0.6 * 3)
    # Requests we know only by count are half-way through a typical (128-token) answer: the
    # four running ones decode 64 more steps at batch 4, then two slots are free.
    wait = (64 + 0.5) * d1 * (1 + 0.6 * 3)
    assert e.queue_ms == pytest.approx(wait)
    assert e.ttft_ms == pytest.approx(5 + wait + 200)
    assert e.load == pytest.approx(5 / 4)

    # Requests this gateway sent after the state was taken count too.
    three = est(m, node(running=3), extra=0).queue_ms
    assert three == pytest.approx(0.5 * 20.0)  # the step in flight only (20 ms at 3 rows)
    assert est(m, node(running=3), extra=1).queue_ms > three + 100


def test_no_kv_room_means_waiting_for_a_finish():
    m = LatencyModel()
    roomy = node(
        "c", NodeKind.CLOUD, max_batch=64, running=2, kv_blocks_total=1000, kv_blocks_used=10
    )
    tight = node(
        "c", NodeKind.CLOUD, max_batch=64, running=2, kv_blocks_total=1000, kv_blocks_used=995
    )
    assert est(m, roomy).queue_ms < 20.0  # the step in flight only
    assert est(m, tight).queue_ms > est(m, roomy).queue_ms + 100


def test_defaults_when_nothing_is_known_then_measurements_take_over():
    m = LatencyModel()
    blank = node("o", NodeKind.OPENAI, prefill_tokens_per_s=0.0, decode_ms_per_token=0.0)
    assert m.prefill_tokens_per_s(blank) == 3000.0
    assert m.decode_ms_per_token_b1(blank) == 25.0
    # 600 uncached tokens, ttft 350 ms of which 50 ms network: 2000 tok/s. 21 tokens by 750 ms.
    m.observe(finished("o", NodeKind.OPENAI, 600, 21, ttft_ms=350.0, e2e_ms=750.0, rtt_ms=50.0))
    assert m.prefill_tokens_per_s(blank) == pytest.approx(2000.0)
    assert m.decode_ms_per_token_b1(blank) == pytest.approx(20.0)
    assert m.mean_output_tokens("o") == 21


def test_measured_rates_blend_with_self_reports_and_move_predictions(consts):
    consts(rate_alpha=1.0, self_report_weight=0.3, warmup_samples=2)
    m = LatencyModel()
    n = node()  # reports 500 tok/s prefill, 20 ms/token decode
    before = est(m, n, prompt=400, out=50)

    def slow_request() -> Observation:
        # Really 100 tok/s prefill (400 tokens in 4 s) and 40 ms/token (51 tokens).
        return Observation(
            node_id="e1",
            kind=NodeKind.EDGE,
            prompt_tokens=400,
            cached_tokens=0,
            completion_tokens=51,
            ttft_ms=4005.0,
            e2e_ms=4005.0 + 50 * 40.0,
            net_rtt_ms=5.0,
            estimate=before,
        )

    m.observe(slow_request())
    # One sample of two for warm-up: measured weight (1 - 0.3) * 1/2 = 0.35.
    assert m.prefill_tokens_per_s(n) == pytest.approx(0.35 * 100 + 0.65 * 500)
    m.observe(slow_request())
    assert m.prefill_tokens_per_s(n) == pytest.approx(0.7 * 100 + 0.3 * 500)
    assert m.decode_ms_per_token_b1(n) == pytest.approx(0.7 * 40 + 0.3 * 20)
    after = est(m, n, prompt=400, out=50)
    assert after.prefill_ms == pytest.approx(400 / 220 * 1000)
    # the prefill gives the first of the 50 tokens; 49 decode steps follow
    assert after.e2e_ms == pytest.approx(5 + 400 / 220 * 1000 + 49 * 34.0)
    assert before.e2e_ms == pytest.approx(5 + 800 + 49 * 20.0)

    # The node then reports itself faster again: the self-report keeps a say.
    n_fast = node(prefill_tokens_per_s=2000.0)
    assert m.prefill_tokens_per_s(n_fast) == pytest.approx(0.7 * 100 + 0.3 * 2000)


def test_decode_measurements_are_normalized_by_batch(consts):
    consts(rate_alpha=1.0, self_report_weight=0.0)
    m = LatencyModel()
    n = node(running=2)
    e = est(m, n)  # runs at batch 3: factor 1 + 0.6 * 2 = 2.2
    assert e.batch == 3
    m.observe(
        Observation(
            node_id="e1",
            kind=NodeKind.EDGE,
            prompt_tokens=10,
            cached_tokens=0,
            completion_tokens=11,
            ttft_ms=100.0,
            e2e_ms=100.0 + 10 * 44.0,
            estimate=e,
        )
    )
    assert m.decode_ms_per_token_b1(node()) == pytest.approx(20.0)


def test_short_prompts_and_cached_prompts_do_not_teach_prefill():
    m = LatencyModel()
    for prompt, cached in ((20, 0), (500, 490)):
        m.observe(
            Observation(
                node_id="e1",
                kind=NodeKind.EDGE,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=1,
                ttft_ms=5000.0,
                e2e_ms=5000.0,
            )
        )
    assert m.rates["e1"].prefill_tokens_per_s.n == 0
    assert m.prefill_tokens_per_s(node()) == 500.0


def test_prediction_errors_are_recorded_per_tier():
    m = LatencyModel()
    n = node()
    e = est(m, n, prompt=100, out=10, rtt=30.0)  # predicted ttft 230, e2e 410
    errs = m.observe(
        Observation(
            node_id="e1",
            kind=NodeKind.EDGE,
            prompt_tokens=100,
            cached_tokens=0,
            completion_tokens=10,
            ttft_ms=260.0,
            e2e_ms=400.0,
            net_rtt_ms=10.0,
            estimate=e,
        )
    )
    # The gateway saw a 10 ms network, not the client's 30: predictions are compared at 210/390.
    assert errs == {"ttft": pytest.approx(50.0), "e2e": pytest.approx(10.0)}
    ttft = m.errors.get("ttft", "edge")
    assert ttft.count == 1 and ttft.bias_ms == pytest.approx(50.0)
    assert ttft.mean_abs_rel == pytest.approx(50 / 260)
    assert m.errors.get("e2e").mean_abs_ms == pytest.approx(10.0)
    assert m.errors.get("ttft", "cloud").count == 0
    snap = m.errors.snapshot()
    assert snap["ttft:edge"]["count"] == 1 and "e2e:all" in snap
    assert m.snapshot({"e1": n})["e1"]["decode_samples"] == 1.0


def test_prefill_fixed_cost_and_per_token_rate_are_fitted():
    """A node whose prompts take 100 ms plus 2 ms a token: once prompts of several lengths
    were measured, short prompts are no longer predicted at the long prompts' rate."""
    m = LatencyModel()
    n = node()
    for uncached in (20, 300, 60, 500, 120, 40):
        e = est(m, n, prompt=uncached, out=1)
        m.observe(
            Observation(
                node_id="e1",
                kind=NodeKind.EDGE,
                prompt_tokens=uncached,
                cached_tokens=0,
                completion_tokens=1,
                ttft_ms=5.0 + 100.0 + 2.0 * uncached,
                e2e_ms=5.0 + 100.0 + 2.0 * uncached,
                net_rtt_ms=5.0,
                estimate=e,
            )
        )
    fixed, per_token, per_cached = m.prefill_cost(n)
    assert fixed == pytest.approx(100.0, rel=1e-6) and per_token == pytest.approx(2.0, rel=1e-6)
    assert per_cached == 0.0  # no prefix hits: nothing to say about their cost
    assert est(m, n, prompt=10, out=1).ttft_ms == pytest.approx(5.0 + 100.0 + 20.0)


def test_the_cost_of_attending_to_a_cached_prefix_is_fitted():
    """Prompts that hit a long cached prefix still take time for it (attention over it, the
    engine walking its blocks): 100 ms + 2 ms a new token + 0.05 ms a cached token. Once
    prompts with and without prefix hits were measured, a prefix hit is predicted with that
    cost, and the replay of work in hand counts it too."""
    m = LatencyModel()
    n = node()
    cases = [(20, 0), (300, 0), (60, 1024), (500, 0), (16, 1120), (120, 512), (40, 0), (32, 2048)]
    for uncached, cached in cases:
        prompt = uncached + cached
        e = est(m, n, prompt=prompt, out=1, cached=cached)
        ms = 100.0 + 2.0 * uncached + 0.05 * cached
        m.observe(
            Observation(
                node_id="e1", kind=NodeKind.EDGE, prompt_tokens=prompt, cached_tokens=cached,
                completion_tokens=1, ttft_ms=5.0 + ms, e2e_ms=5.0 + ms, net_rtt_ms=5.0, estimate=e,
            )
        )  # fmt: skip
    fixed, per_token, per_cached = m.prefill_cost(n)
    assert (fixed, per_token, per_cached) == pytest.approx((100.0, 2.0, 0.05), rel=1e-6)
    hit = est(m, n, prompt=1040, out=1, cached=1024)
    assert hit.ttft_ms == pytest.approx(5.0 + 100.0 + 2.0 * 16 + 0.05 * 1024)
    assert hit.basis.prefill_work_tokens == pytest.approx(16 + 0.05 * 1024 / 2.0)


def test_an_unmeasured_replica_borrows_its_peers_rates(consts):
    """Two replicas of one deployment: the one that served everything measured 4 ms/token and
    800 tok/s; its twin, never used and reporting nothing, is predicted at those rates, not at
    the kind's defaults (which would make it look slower, so it would never be tried)."""
    consts(rate_alpha=1.0, self_report_weight=0.0, warmup_samples=1)
    m = LatencyModel()
    busy = node("c0", NodeKind.CLOUD, prefill_tokens_per_s=0.0, decode_ms_per_token=0.0)
    twin = node("c1", NodeKind.CLOUD, prefill_tokens_per_s=0.0, decode_ms_per_token=0.0)
    other = node("c2", NodeKind.CLOUD, device="cuda", prefill_tokens_per_s=0.0,
                 decode_ms_per_token=0.0)  # fmt: skip
    for n in (busy, twin, other):
        est(m, n)  # the gateway sees all three
    # 400 tokens in 500 ms (800 tok/s), then 10 tokens at 4 ms
    m.observe(finished("c0", NodeKind.CLOUD, 400, 11, ttft_ms=505.0, e2e_ms=545.0, rtt_ms=5.0))
    assert m.prefill_tokens_per_s(twin) == pytest.approx(800.0)
    assert m.decode_ms_per_token_b1(twin) == pytest.approx(4.0 / m.batch_factor(NodeKind.CLOUD, 1))
    # another device is another deployment: the kind's defaults
    assert m.prefill_tokens_per_s(other) == 6000.0
    assert m.decode_ms_per_token_b1(other) == 20.0
    # a twin that reports its own rate is taken at its word
    assert m.prefill_tokens_per_s(node("c3", NodeKind.CLOUD, prefill_tokens_per_s=300.0)) == 300.0
    m.forget("c0")
    # nothing left to borrow: the defaults of a cloud node on a CPU (a GPU's, 6000, above)
    assert m.prefill_tokens_per_s(twin) == priors.CLOUD_CPU.prefill_tokens_per_s == 250.0
    assert m.decode_ms_per_token_b1(twin) == pytest.approx(60.0)


def test_the_chunks_a_node_reports_are_the_chunks_replayed():
    """A node that prefills beside decoding rows in 32-token chunks: a 256-token prompt next
    to one decoding request runs as 8 chunks with a decode step after each, not as one."""
    m = LatencyModel()
    reported = node(prefill_chunk=256, prefill_chunk_decoding=32, decode_ms_per_token=10.0)
    shape = m.shape(reported)
    assert (shape.chunk_tokens, shape.chunk_tokens_decoding) == (256, 32)
    assert m.shape(node()).chunk(1) == priors.EDGE.prefill_chunk  # unsaid: the default
    ahead = [Work(0.0, 50.0)]  # one request decoding, far from its end
    small = m.estimate(reported, prompt_tokens=256, cached_tokens=0, expected_output_tokens=1,
                       rtt_ms=0.0, ahead=ahead)  # fmt: skip
    whole = m.estimate(node(prefill_chunk=256, decode_ms_per_token=10.0), prompt_tokens=256,
                       cached_tokens=0, expected_output_tokens=1, rtt_ms=0.0, ahead=ahead)  # fmt: skip
    # 256 tokens at 500 tok/s = 512 ms either way, after half the step in flight; 7 decode
    # steps between 8 chunks in the first
    step = shape.decode_step_ms(1)
    assert whole.ttft_ms == pytest.approx(0.5 * step + 512.0)
    assert small.ttft_ms == pytest.approx(0.5 * step + 512.0 + 7 * step)


def test_the_nodes_account_of_the_wait_teaches_prefill_whatever_ran():
    """Requests that waited 2 s behind other prompts while the prediction said the node was
    idle: with the node's account of the wait they teach 2 ms a token and no fixed cost (not
    a 2 s fixed cost that every later prompt would be charged)."""
    m = LatencyModel()
    n = node()
    for prompt in (40, 200, 400, 800, 100, 600):
        e = est(m, n, prompt=prompt)
        ttft = 5.0 + 2000.0 + 2.0 * prompt
        m.observe(Observation(node_id="e1", kind=NodeKind.EDGE, prompt_tokens=prompt,
                              cached_tokens=0, completion_tokens=1, e2e_ms=ttft, ttft_ms=ttft,
                              net_rtt_ms=5.0, node_queue_ms=2000.0, estimate=e))  # fmt: skip
    fixed, per_token, _ = m.prefill_cost(n)
    assert per_token == pytest.approx(2.0) and fixed == pytest.approx(0.0, abs=1e-6)


def test_the_cost_of_reading_the_context_in_decode_is_fitted(consts):
    """A decode step reads every row's KV: 14 ms a step plus 0.008 ms per token of context
    (the edge node's figures on this machine). Requests of one batch size at different prompt
    lengths teach the per-token context cost; a long prompt is then predicted to decode slower
    than a short one, and the intercept is the step of no context."""
    consts(self_report_weight=0.0)
    m = LatencyModel()
    n = node(decode_ms_per_token=0.0)
    for prompt in (30, 250, 500, 1000, 1800, 60, 700, 1500):
        e = est(m, n, prompt=prompt, out=33)
        assert e.basis.mean_batch == 1.0
        per_token = 14.0 + 0.008 * e.basis.mean_context
        m.observe(
            Observation(
                node_id="e1", kind=NodeKind.EDGE, prompt_tokens=prompt, cached_tokens=0,
                completion_tokens=33, ttft_ms=e.ttft_ms, e2e_ms=e.ttft_ms + 32 * per_token,
                estimate=e,
            )
        )  # fmt: skip
    assert m.context_cost(n) == pytest.approx(0.008, rel=1e-6)
    assert m.decode_ms_per_token_b1(n) == pytest.approx(14.0, rel=1e-6)
    assert m.batch_slope(n) == pytest.approx(0.6)  # one batch size: the slope stays assumed
    short, long = est(m, n, prompt=100, out=33), est(m, n, prompt=1900, out=33)
    assert short.decode_ms_per_token == pytest.approx(14.0 + 0.008 * (100 + 15.5), rel=1e-6)
    assert long.decode_ms_per_token == pytest.approx(14.0 + 0.008 * (1900 + 15.5), rel=1e-6)


def test_a_fit_whose_fixed_cost_exceeds_a_whole_prompt_is_not_used(consts):
    """Prompts whose lengths do not pin the intercept (the long ones slow, the short ones all
    at one length) can fit a fixed cost above what the cheapest prompt took in all; such a fit
    is no fit, and the prefill rate answers."""
    consts(self_report_weight=0.0)
    m = LatencyModel()
    n = node()
    for uncached, ms in ((100, 60.0), (100, 5000.0), (160, 900.0), (160, 950.0), (40, 30.0)):
        m.observe(
            Observation(
                node_id="e1", kind=NodeKind.EDGE, prompt_tokens=uncached, cached_tokens=0,
                completion_tokens=1, ttft_ms=ms, e2e_ms=ms, node_queue_ms=0.0,
            )
        )  # fmt: skip
    fit = m.rates["e1"].prefill_fit
    w, sx, _, sxx, _, _, sy, sxy, _ = fit.moments.m
    b = (sxy / w - sx / w * sy / w) / (sxx / w - (sx / w) ** 2)
    assert sy / w - b * sx / w > fit.min_y  # the line's intercept: above the 30 ms prompt
    fixed, per_token, _ = m.prefill_cost(n)
    assert per_token == pytest.approx(1000.0 / m.prefill_tokens_per_s(n))
    assert 0.0 <= fixed == fit.fixed_at(per_token) <= fit.min_y == 30.0


def test_short_prompts_alone_still_say_what_a_prompt_costs_at_least(consts):
    """A GPU node that only gets short prompts (20-40 new tokens, 25 ms each from the gateway:
    HTTP, tokenizing, the engine's loop) while it reports 5,000 prompt tokens a second: their
    lengths never spread enough to fit a line, yet their mean pins its fixed cost, which the
    rate alone would miss (6 ms predicted for 30 tokens)."""
    consts(self_report_weight=1.0)
    m = LatencyModel()
    n = node("c1", NodeKind.CLOUD, prefill_tokens_per_s=5000.0, decode_ms_per_token=1.0)
    for uncached in (20, 30, 40, 25, 35, 30):
        m.observe(
            Observation(
                node_id="c1", kind=NodeKind.CLOUD, prompt_tokens=uncached, cached_tokens=0,
                completion_tokens=1, ttft_ms=5.0 + 25.0, e2e_ms=30.0, net_rtt_ms=5.0,
                node_queue_ms=0.0,
            )
        )  # fmt: skip
    assert m.rates["c1"].prefill_fit.solve() is None  # no spread: no line
    fixed, per_token, _ = m.prefill_cost(n)
    assert per_token == pytest.approx(0.2) and fixed == pytest.approx(25.0 - 0.2 * 30.0, rel=0.01)
    assert est(m, n, prompt=30, out=1).prefill_ms == pytest.approx(25.0, rel=0.01)


def test_a_plane_of_cached_and_new_tokens_that_move_together_is_not_used(consts):
    """Prompts that either hit a 1,136-token shared prefix with a few new tokens or miss it
    with about 1,100 (their two lengths sum to about the same): the plane through them is
    ill-posed, here -1.6 s plus 3.6 ms a new token and 1.5 a cached one (a 20-token prompt
    after the prefix predicted at 1.8 s, a long cold one at 2.4 s as measured, yet clamped to
    a fixed cost of 0). Such a fit is no fit; the prefill rate answers."""
    consts(self_report_weight=0.0)
    m = LatencyModel()
    n = node()
    samples = [(20, 1136, 150.0), (1100, 0, 2400.0), (30, 1120, 230.0), (1050, 16, 2300.0),
               (25, 1136, 300.0), (40, 1104, 160.0)]  # fmt: skip
    for uncached, cached, ms in samples:
        m.observe(
            Observation(
                node_id="e1", kind=NodeKind.EDGE, prompt_tokens=uncached + cached,
                cached_tokens=cached, completion_tokens=1, ttft_ms=ms, e2e_ms=ms,
                node_queue_ms=0.0,
            )
        )  # fmt: skip
    plane = m.rates["e1"].prefill_fit.moments.centered().plane()
    assert plane is not None and plane[0] < -1000.0 and plane[1] > 3.0 and plane[2] > 1.0
    fixed, per_token, per_cached = m.prefill_cost(n)
    assert per_cached == 0.0 and per_token == pytest.approx(1000.0 / m.prefill_tokens_per_s(n))
    fit = m.rates["e1"].prefill_fit
    assert fixed == fit.fixed_at(per_token) and 0.0 <= fixed <= fit.min_y == 150.0


def test_a_prompts_own_time_is_at_least_one_forward_pass():
    """16 new tokens after 1,152 cached: their per-token share (16 ms at 1,000 tokens/s) is
    less than the forward pass that computes them, which reads every weight as a decode step
    of one row does (60 ms here): the prediction takes the step's time as a floor."""
    m = LatencyModel()
    cloud = node("c1", NodeKind.CLOUD, prefill_tokens_per_s=1000.0, decode_ms_per_token=60.0)
    e = est(m, cloud, prompt=1168, cached=1152)
    assert (e.cached_tokens, e.uncached_tokens) == (1152, 16)
    assert e.prefill_ms == pytest.approx(60.0) and e.own_prefill_ms == pytest.approx(60.0)
    assert e.ttft_ms == pytest.approx(65.0)  # rtt 5
    assert e.e2e_ms == pytest.approx(65.0 + 9 * 60.0)
    # a long cold prompt costs its tokens, above the floor
    assert est(m, cloud, prompt=1168).prefill_ms == pytest.approx(1168.0)


def test_what_requests_take_beyond_the_engine_is_learned_and_added():
    """The gateway's share of a request's time to first token (its TTFT less the RTT less
    the node's own: 6 ms here) and an idle node's wait before its engine starts it (4 ms) are
    learned per node, taken off what prefill learns, and added to the next prediction (the
    node's wait only while the node is idle)."""
    m = LatencyModel()
    n = node("e1", NodeKind.EDGE, prefill_tokens_per_s=1000.0, decode_ms_per_token=10.0)
    for _ in range(30):
        e = est(m, n, prompt=100, out=1)
        m.observe(
            Observation(
                node_id="e1", kind=NodeKind.EDGE, prompt_tokens=100, cached_tokens=0,
                completion_tokens=1, ttft_ms=5.0 + 6.0 + 4.0 + 100.0, e2e_ms=115.0,
                net_rtt_ms=5.0, node_queue_ms=4.0, node_ttft_ms=104.0, estimate=e,
            )
        )  # fmt: skip
    assert m.overhead_ms("e1", idle=True) == pytest.approx(10.0, rel=0.01)
    assert m.overhead_ms("e1", idle=False) == pytest.approx(6.0, rel=0.01)
    e = est(m, n, prompt=100, out=1)
    assert e.overhead_ms == pytest.approx(10.0, rel=0.01)
    assert e.prefill_ms == pytest.approx(100.0, rel=0.02)  # the node's compute alone
    assert e.ttft_ms == pytest.approx(115.0, rel=0.01)
    busy = est(m, n, prompt=100, out=1, ahead=[Work(0.0, 5.0, context=200.0)])
    assert busy.overhead_ms == pytest.approx(6.0, rel=0.01)
    # a node not yet measured is taken at the mean of those that are, not at nothing
    other = node("e2", NodeKind.EDGE, prefill_tokens_per_s=1000.0, decode_ms_per_token=10.0)
    assert est(m, other, prompt=100, out=1).overhead_ms == pytest.approx(10.0, rel=0.01)
    # one slow first request (the gateway fetching its tokenizer) does not move it
    m.observe(
        Observation(
            node_id="e1", kind=NodeKind.EDGE, prompt_tokens=100, cached_tokens=0,
            completion_tokens=1, ttft_ms=5.0 + 2000.0 + 104.0, e2e_ms=2115.0, net_rtt_ms=5.0,
            node_queue_ms=4.0, node_ttft_ms=104.0, estimate=est(m, n, prompt=100, out=1),
        )
    )  # fmt: skip
    assert m.overhead_ms("e1", idle=True) == pytest.approx(10.0, rel=0.01)


def test_decode_is_learned_against_the_rows_seen_not_the_rows_predicted(consts):
    """A request predicted to decode alone that then decoded beside three others (requests
    sent after it) took 2x its one-row time a token: with the batch the gateway saw, the
    one-row rate stays put; with the predicted one it would double."""
    consts(self_report_weight=0.0)
    seen, predicted = LatencyModel(), LatencyModel()
    n = node("c1", NodeKind.CLOUD, prefill_tokens_per_s=1000.0, decode_ms_per_token=0.0)
    for m in (seen, predicted):
        for _ in range(20):
            e = est(m, n, prompt=10, out=11)
            assert e.basis.mean_batch == pytest.approx(1.0)
            slope = m.batch_slope(n)
            per_token = 50.0 * (1.0 + slope * 3)  # 4 rows, 50 ms a token alone
            m.observe(
                Observation(
                    node_id="c1", kind=NodeKind.CLOUD, prompt_tokens=10, cached_tokens=0,
                    completion_tokens=11, ttft_ms=20.0, e2e_ms=20.0 + 10 * per_token,
                    net_rtt_ms=0.0, estimate=e, decode_batch=4.0 if m is seen else None,
                )
            )  # fmt: skip
    assert seen.decode_ms_per_token_b1(n) == pytest.approx(50.0, rel=0.05)
    assert predicted.decode_ms_per_token_b1(n) > 1.05 * 50.0
