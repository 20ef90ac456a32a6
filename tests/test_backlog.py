"""routing.backlog.replay: hand-computed cases, and parity with the literal engine loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.backlog import (
    Arrivals,
    EngineShape,
    Replayed,
    SharedPrefix,
    Work,
    replay,
    replay_pair,
)
from tests.replay_oracle import replay_literal

SHAPE = EngineShape(
    slots=2, chunk_tokens=100, prefill_ms_per_token=1.0, decode_step_ms_b1=10.0, batch_slope=0.5
)


def test_hand_computed_two_slots():
    # In hand: A decoding (0 prefill, 3 steps), B prefilling 150 tokens then 1 step.
    # New: 50 tokens, 2 steps; it waits for a slot.
    r = replay(SHAPE, [Work(0, 3), Work(150, 1)], Work(50, 2))
    # loop 1: B's chunk of 100 (t=100), A steps alone (t=110); loop 2: B's last 50 (t=160), its
    # first token out, A and B step at 2 rows (t=175): B is done, the new request takes its slot
    # at 175; loop 3: its 50 tokens (t=225, first token), it steps with A's last (t=240);
    # loop 4: its last step alone (t=250). It decoded at 2 rows, then 1: mean 1.5.
    assert r == Replayed(queue_ms=175.0, first_token_ms=225.0, last_token_ms=250.0, mean_batch=1.5,
                        stalled_others_ms=50.0,  # A decoded through its 50 ms chunk
                        # its steps attended to A's 2 tokens and its own 0, then its own 1
                        mean_context=1.5)  # fmt: skip


def test_identical_steps_are_jumped_without_rounding_an_extra_step():
    shape = EngineShape(slots=4, chunk_tokens=256, prefill_ms_per_token=0.0,
                        decode_step_ms_b1=1.0, batch_slope=0.0)  # fmt: skip
    r = replay(shape, [Work(0, 0.1 + 0.2), Work(0, 13.29)], Work(1, 6.7))
    assert r.last_token_ms == pytest.approx(replay_literal(
        shape, [Work(0, 0.1 + 0.2), Work(0, 13.29)], Work(1, 6.7)).last_token_ms)  # fmt: skip


plain_works = st.lists(
    st.builds(
        Work,
        st.sampled_from([0.0, 1.0, 16.0, 100.0, 250.0, 700.0]),
        st.sampled_from([0.0, 1.0, 3.0, 7.5, 16.0, 31.0, 127.0]),
        st.booleans(),
        st.sampled_from([0.0, 40.0, 1200.0]),
    ),
    max_size=40,
)


@st.composite
def works(draw: st.DrawFn) -> list[Work]:
    """Work in hand, some of it sharing an earlier request's prefix."""
    out = []
    for i, w in enumerate(draw(plain_works)):
        if i and draw(st.booleans()):
            source = draw(st.integers(0, i - 1))
            w = replace(w, shared=SharedPrefix(source, draw(st.sampled_from([16.0, 90.0, 800.0]))))
        out.append(w)
    return out


def _sharing(new: Work, ahead: Sequence[Work], source: int | None) -> Work:
    """``new`` sharing the prefix of ``ahead[source]`` (modulo its length), if any."""
    if source is None or not ahead:
        return new
    return replace(new, shared=SharedPrefix(source % len(ahead), 400.0))


@settings(max_examples=300, deadline=None)
@given(
    ahead=works(),
    new_source=st.sampled_from([None, 0, 5]),
    cached_ms=st.sampled_from([0.0, 0.1]),
    new=st.builds(
        Work,
        st.sampled_from([1.0, 30.0, 512.0]),
        st.sampled_from([0.0, 1.0, 15.0]),
        context=st.sampled_from([0.0, 700.0]),
    ),
    slots=st.sampled_from([1, 2, 4, 64]),
    chunk=st.sampled_from([64, 256]),
    beside=st.sampled_from([0, 16, 40]),
    fixed=st.sampled_from([0.0, 5.0]),
    slope=st.sampled_from([0.0, 0.4]),
    mixed=st.booleans(),
    per_context=st.sampled_from([0.0, 0.01]),
)
def test_replay_equals_the_literal_loop(
    ahead: Sequence[Work],
    new_source: int | None,
    cached_ms: float,
    new: Work,
    slots: int,
    chunk: int,
    beside: int,
    fixed: float,
    slope: float,
    mixed: bool,
    per_context: float,
):
    shape = EngineShape(
        slots,
        chunk,
        0.5,
        8.0,
        slope,
        prefill_fixed_ms=fixed,
        chunk_tokens_decoding=beside,
        mixed_steps=mixed,
        decode_ms_per_context_token=per_context,
        cached_token_ms=cached_ms,
    )
    new = _sharing(new, ahead, new_source)
    got = replay(shape, ahead, new)
    want = replay_literal(shape, ahead, new)
    assert got.queue_ms == pytest.approx(want.queue_ms)
    assert got.first_token_ms == pytest.approx(want.first_token_ms)
    assert got.last_token_ms == pytest.approx(want.last_token_ms)
    assert got.mean_batch == pytest.approx(want.mean_batch)
    assert got.stalled_others_ms == pytest.approx(want.stalled_others_ms)
    assert got.mean_context == pytest.approx(want.mean_context)
    assert got.reused_tokens == pytest.approx(want.reused_tokens)


def test_each_decode_step_reads_the_context_of_its_rows():
    # 10 ms a step plus 0.01 ms per token of context. In hand: A decoding 2 steps at context
    # 1000. New: a 500-token prompt (0.1 ms a token: 50 ms), 3 steps after its first token.
    shape = EngineShape(slots=2, chunk_tokens=1000, prefill_ms_per_token=0.1,
                        decode_step_ms_b1=10.0, batch_slope=0.0,
                        decode_ms_per_context_token=0.01)  # fmt: skip
    r = replay(shape, [Work(0, 2, context=1000)], Work(500, 3, context=500))
    # its prompt (t=50), a step with A: 1000 + 500 tokens (t=75); A's last step with it: 1001 +
    # 501 (t=100.02); its last alone at 502 (t=115.04)
    assert (r.first_token_ms, r.mean_batch) == (50.0, pytest.approx(5 / 3))
    assert r.last_token_ms == pytest.approx(115.04)
    assert r.mean_context == pytest.approx((1500 + 1502 + 502) / 3)
    assert replay_literal(shape, [Work(0, 2, context=1000)], Work(500, 3, context=500)) == r
    # identical steps are jumped with their growing context: 100 steps alone from 500 tokens
    alone = replay(shape, [], Work(1, 100, context=500))
    assert alone.last_token_ms == pytest.approx(0.1 + 100 * 10 + 0.01 * (100 * 500 + 4950))
    assert shape.decode_step_ms(2, 1500) == pytest.approx(25.0)


def test_a_prompt_beside_decoding_rows_runs_in_the_smaller_chunk():
    # Two slots; in hand: A decoding 5 steps; new: 30 prompt tokens, 2 steps after its first.
    # 1 ms a prompt token, 10 ms a decode step whatever its rows.
    shape = EngineShape(slots=2, chunk_tokens=100, prefill_ms_per_token=1.0,
                        decode_step_ms_b1=10.0, batch_slope=0.0, chunk_tokens_decoding=10)  # fmt: skip
    r = replay(shape, [Work(0, 5)], Work(30, 2))
    # three 10-token chunks, each followed by A's step (t=10, 20 | 30, 40 | 50): the first
    # token at 50; then two steps with A (60, 70)
    assert r == Replayed(queue_ms=0.0, first_token_ms=50.0, last_token_ms=70.0, mean_batch=2.0,
                         stalled_others_ms=30.0,
                         mean_context=3.0)  # A's 2 tokens and its 0, then 3 and 1  # fmt: skip
    assert replay_literal(shape, [Work(0, 5)], Work(30, 2)) == r
    # full chunks beside A: the whole prompt at once (t=30), then two steps with A (40, 50)
    full = replay(replace(shape, chunk_tokens_decoding=0), [Work(0, 5)], Work(30, 2))
    assert (full.first_token_ms, full.last_token_ms, full.stalled_others_ms) == (30.0, 50.0, 30.0)
    # with nothing decoding the full chunk runs: 30 tokens in one chunk, alone
    assert replay(shape, [], Work(30, 2)).first_token_ms == 30.0
    assert (shape.chunk(0), shape.chunk(3)) == (100, 10)


def test_a_mixed_step_gives_the_first_token_after_the_decode_rows():
    # The cloud's step holds A's decode row and the new prompt's 30 tokens: its first token
    # comes when the step ends (30 + 10 = 40), and it decodes from the next step (50, 60).
    shape = EngineShape(slots=2, chunk_tokens=100, prefill_ms_per_token=1.0,
                        decode_step_ms_b1=10.0, batch_slope=0.0, mixed_steps=True)  # fmt: skip
    r = replay(shape, [Work(0, 5)], Work(30, 2))
    assert (r.first_token_ms, r.last_token_ms, r.mean_batch) == (40.0, 60.0, 2.0)
    assert replay_literal(shape, [Work(0, 5)], Work(30, 2)) == r
    # separate steps (the edge): the first token at the chunk's end, then two steps with A
    edge = replay(replace(shape, mixed_steps=False), [Work(0, 5)], Work(30, 2))
    assert (edge.first_token_ms, edge.last_token_ms) == (30.0, 50.0)
    # nothing decoding: the chunk is the whole step either way
    assert replay(shape, [], Work(30, 2)).first_token_ms == 30.0
    # two prompts ahead (40 tokens each): the cloud packs all three into one step under a
    # 151-token budget (A's row takes one: 110 ms of prefill, A's row: 120); the edge runs one
    # prompt per loop, a decode step after each (40, 50 | 90, 100 | 130)
    wide = replace(shape, chunk_tokens=151, slots=4)
    ahead = [Work(0, 5), Work(40, 1), Work(40, 1)]
    assert replay(wide, ahead, Work(30, 2)).first_token_ms == 120.0
    assert replay_literal(wide, ahead, Work(30, 2)) == replay(wide, ahead, Work(30, 2))
    assert replay(replace(wide, mixed_steps=False), ahead, Work(30, 2)).first_token_ms == 130.0


def test_arrivals_keep_the_population_and_slow_the_decode():
    # Two slots, a population of two. In hand: A decoding 1 step. New: 10 tokens, 4 steps.
    # Every request that finishes is replaced by one of 50 tokens and 1 step.
    shape = EngineShape(slots=2, chunk_tokens=100, prefill_ms_per_token=1.0,
                        decode_step_ms_b1=10.0, batch_slope=0.5)  # fmt: skip
    alone = replay(shape, [Work(0, 1)], Work(10, 4))
    assert alone.last_token_ms == 55.0  # 10 ms prefill; a step of 2 rows (15), 3 alone (30)
    r = replay(shape, [Work(0, 1)], Work(10, 4), arrivals=Arrivals(2, Work(50, 1)))
    # t=10 its first token; a step of 2 rows (t=25): A is done, B (50, 1) takes its slot;
    # B's 50 tokens (t=75), a step of 2 rows (t=90): B is done, C takes its slot; C's 50
    # (t=140), a step of 2 rows (t=155): C is done, D comes; D's 50 (t=205), the new
    # request's last step, with D (t=220). It decoded at 2 rows throughout.
    assert r == Replayed(queue_ms=0.0, first_token_ms=10.0, last_token_ms=220.0, mean_batch=2.0,
                         stalled_others_ms=10.0,  # A decoding through its 10 ms
                         mean_context=1.5)  # its own 0..3 beside newcomers of 0  # fmt: skip
    # a population the node already has brings nobody: the same as without arrivals
    assert replay(shape, [Work(0, 1)], Work(10, 4), arrivals=Arrivals(1, Work(50, 1))) == alone
    with pytest.raises(ValueError):
        Arrivals(2, Work(0, 3))


def test_arrivals_come_after_the_new_requests_first_token():
    """Requests sent after the decision join once the new request's prompt is done: on a
    mixed-step node none shares the step that computes its prompt, so its first token comes
    when it would alone, and only its decode slows."""
    shape = EngineShape(slots=4, chunk_tokens=100, prefill_ms_per_token=1.0,
                        decode_step_ms_b1=10.0, batch_slope=0.5, mixed_steps=True)  # fmt: skip
    ahead = [Work(0, 5)]
    alone = replay(shape, ahead, Work(40, 4))
    for run in (replay, replay_literal):
        r = run(shape, ahead, Work(40, 4), arrivals=Arrivals(3, Work(30, 4)))
        assert r.first_token_ms == alone.first_token_ms
        assert r.last_token_ms > alone.last_token_ms


# a backlog, a new request and the arrivals after it (the node kept at ``population``)
ARRIVAL_CASES = dict(
    ahead=works(),
    new=st.builds(Work, st.sampled_from([1.0, 30.0, 512.0]), st.sampled_from([0.0, 1.0, 15.0])),
    slots=st.sampled_from([1, 2, 4, 64]),
    population=st.sampled_from([0, 1, 3, 8, 70]),
    later=st.builds(Work, st.sampled_from([1.0, 64.0, 300.0]), st.sampled_from([0.0, 2.0, 20.0])),
)


def _arrival_shape(slots: int) -> EngineShape:
    """The engine of the arrival cases: mixed steps at two slots, a step per token otherwise."""
    return EngineShape(slots, 64, 0.5, 8.0, 0.4, prefill_fixed_ms=5.0, mixed_steps=slots == 2,
                       decode_ms_per_context_token=0.01)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(**ARRIVAL_CASES)
def test_replay_with_arrivals_equals_the_literal_loop(
    ahead: Sequence[Work], new: Work, slots: int, population: int, later: Work
):
    shape = _arrival_shape(slots)
    arr = Arrivals(population, later)
    got = replay(shape, ahead, new, arrivals=arr)
    want = replay_literal(shape, ahead, new, arrivals=arr)
    assert got.queue_ms == pytest.approx(want.queue_ms)
    assert got.first_token_ms == pytest.approx(want.first_token_ms)
    assert got.last_token_ms == pytest.approx(want.last_token_ms)
    assert got.mean_batch == pytest.approx(want.mean_batch)
    assert got.stalled_others_ms == pytest.approx(want.stalled_others_ms)
    assert got.mean_context == pytest.approx(want.mean_context)


@settings(max_examples=300, deadline=None)
@given(**ARRIVAL_CASES, max_loops=st.sampled_from([3, 4096]))
def test_replay_pair_equals_the_two_replays_it_forks(
    ahead: Sequence[Work], new: Work, slots: int, population: int, later: Work, max_loops: int
):
    """The pair runs the loops up to the new request's first token once and forks there: each
    half is exactly what its own replay gives, the loop budget included."""
    shape = _arrival_shape(slots)
    arr = Arrivals(population, later)
    without, held = replay_pair(shape, ahead, new, arr, max_loops=max_loops)
    assert without == replay(shape, ahead, new, max_loops=max_loops)
    assert held == replay(shape, ahead, new, max_loops=max_loops, arrivals=arr)


def test_a_shared_prefix_is_reused_only_after_its_first_computer_prefilled_it():
    """The engines match a prefix at admission: a request that takes a slot once the earlier
    request's prefill is done computes only the rest; one that takes a slot beside it while it
    still prefills computes it again."""
    ahead = [Work(200, 0)]
    new = Work(200, 0, shared=SharedPrefix(0, 160))
    one_slot = replace(SHAPE, slots=1)
    r = replay(one_slot, ahead, new)
    assert (r.queue_ms, r.first_token_ms, r.reused_tokens) == (200.0, 240.0, 160.0)
    assert replay_literal(one_slot, ahead, new) == r
    beside = replay(SHAPE, ahead, new)  # two slots: it starts at once, beside the first
    assert (beside.queue_ms, beside.first_token_ms, beside.reused_tokens) == (0.0, 400.0, 0.0)
    # an edge that catches up copies the prefix before the second's first chunk, which runs
    # once the first (older) has prefilled it
    caught = replay(replace(SHAPE, catch_up=True), ahead, new)
    assert (caught.queue_ms, caught.first_token_ms, caught.reused_tokens) == (0.0, 240.0, 160.0)
    assert replay_literal(replace(SHAPE, catch_up=True), ahead, new) == caught
    # a cached token still costs its share: a tenth of a computed one saves nine tenths
    dear = replay(replace(one_slot, cached_token_ms=0.1), ahead, new)
    assert dear.first_token_ms == pytest.approx(200.0 + 40.0 + 16.0)
    # work in hand reuses likewise, and what it saves moves the new request up
    chain = [Work(200, 0), Work(200, 0, shared=SharedPrefix(0, 160))]
    assert replay(one_slot, chain, Work(10, 0)).first_token_ms == 200.0 + 40.0 + 10.0
    assert replay(one_slot, [Work(200, 0), Work(200, 0)], Work(10, 0)).first_token_ms == 410.0
