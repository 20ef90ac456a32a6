"""routing.backlog.replay: hand-computed cases, and parity with the literal engine loop."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.backlog import EngineShape, Replayed, Work, replay, replay_literal

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
    assert r == Replayed(queue_ms=175.0, first_token_ms=225.0, last_token_ms=250.0, mean_batch=1.5)


def test_identical_steps_are_jumped_without_rounding_an_extra_step():
    shape = EngineShape(slots=4, chunk_tokens=256, prefill_ms_per_token=0.0,
                        decode_step_ms_b1=1.0, batch_slope=0.0)  # fmt: skip
    r = replay(shape, [Work(0, 0.1 + 0.2), Work(0, 13.29)], Work(1, 6.7))
    assert r.last_token_ms == pytest.approx(replay_literal(
        shape, [Work(0, 0.1 + 0.2), Work(0, 13.29)], Work(1, 6.7)).last_token_ms)  # fmt: skip


works = st.lists(
    st.builds(
        Work,
        st.sampled_from([0.0, 1.0, 16.0, 100.0, 250.0, 700.0]),
        st.sampled_from([0.0, 1.0, 3.0, 7.5, 16.0, 31.0, 127.0]),
        st.booleans(),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    ahead=works,
    new=st.builds(Work, st.sampled_from([1.0, 30.0, 512.0]), st.sampled_from([0.0, 1.0, 15.0])),
    slots=st.sampled_from([1, 2, 4, 64]),
    chunk=st.sampled_from([64, 256]),
    fixed=st.sampled_from([0.0, 5.0]),
    slope=st.sampled_from([0.0, 0.4]),
)
def test_replay_equals_the_literal_loop(
    ahead: Sequence[Work], new: Work, slots: int, chunk: int, fixed: float, slope: float
):
    shape = EngineShape(slots, chunk, 0.5, 8.0, slope, prefill_fixed_ms=fixed)
    got, want = replay(shape, ahead, new), replay_literal(shape, ahead, new)
    assert got.queue_ms == pytest.approx(want.queue_ms)
    assert got.first_token_ms == pytest.approx(want.first_token_ms)
    assert got.last_token_ms == pytest.approx(want.last_token_ms)
    assert got.mean_batch == pytest.approx(want.mean_batch)
