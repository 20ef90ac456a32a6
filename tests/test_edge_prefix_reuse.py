"""Edge prefix reuse: a finished request's KV kept in its slot serves a later request's leading
blocks (multi-turn chat), with the cloud's block hashes and events.

The tiny random model, both graph flavours (GroupQueryAttention in place, portable concat).
Greedy outputs of warm (reused) runs are compared with cold runs of an engine without reuse.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.engine import EdgeEngine, EdgeEngineConfig, greedy
from edge_runtime.export import ensure_export
from edge_runtime.slot_cache import IntegrityError, SlotCache
from routing.blocks import BLOCK_SIZE, block_hashes, model_seed
from routing.engine import FinishReason, GenerationRequest, PrefixCacheEngine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=["gqa", "concat"])
def graph(request: pytest.FixtureRequest, tiny_model_path: Path, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.getbasetemp() / "edge-onnx"  # shared with test_edge_runtime
    root.mkdir(exist_ok=True)
    return ensure_export(tiny_model_path, "fp32", request.param, root=root).folder


def _prompts(*lengths: int, seed: int = 11) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 49152, n).tolist() for n in lengths]


async def _engine(folder: Path, **kw: object) -> EdgeEngine:
    base: dict[str, object] = dict(slots=2, context=256, threads=1, warmup=False)
    base.update(kw)
    engine = EdgeEngine(folder, EdgeEngineConfig(**base))  # type: ignore[arg-type]
    await engine.start()
    return engine


class Turn:
    """One request's outcome, and the prompt tokens the engine prefilled for it."""

    def __init__(self, tokens: list[int], cached: int, prefilled: int) -> None:
        self.tokens, self.cached, self.prefilled = tokens, cached, prefilled


async def _run(engine: EdgeEngine, prompt: list[int], new: int = 6) -> Turn:
    scheduler = engine._require_started()
    before = scheduler.prefilled_tokens
    tokens: list[int] = []
    cached: list[int] = []
    request = GenerationRequest(prompt, greedy(new))
    async for event in engine.generate(request):
        tokens += event.token_ids
        cached.append(event.cached_tokens)
        if event.finished:
            assert event.finish_reason is FinishReason.LENGTH and len(tokens) == new
    assert len(set(cached)) == 1  # valid from the first event on, never changes
    assert scheduler.cache is None or scheduler.cache.check_integrity() is None
    return Turn(tokens, cached[0], scheduler.prefilled_tokens - before)


def _kept(prompt: list[int], out: list[int]) -> list[int]:
    """What a slot keeps after a LENGTH finish: the last sampled token was never fed."""
    return prompt + out[:-1]


async def test_follow_up_turn_reuses_blocks_and_matches_cold(graph: Path) -> None:
    first, new_user = _prompts(40, 20)
    cold = await _engine(graph, prefix_reuse=False)
    warm = await _engine(graph)
    try:
        assert isinstance(warm, PrefixCacheEngine) and warm.stats().traits.prefix_cache
        seed = model_seed(warm.model_id)
        t1 = await _run(warm, first, new=12)
        assert (t1.cached, t1.prefilled) == (0, 40)
        kept1 = _kept(first, t1.tokens)  # 51 tokens: 3 full blocks
        ev = warm.drain_block_events()
        assert ev.stored == block_hashes(kept1, seed) and len(ev.stored) == 3
        assert ev.removed == [] and sorted(warm.held_blocks()) == sorted(ev.stored)
        assert not warm.drain_block_events()  # each change once

        # turn 2: the conversation so far plus a new message
        second = first + t1.tokens + new_user  # 72 tokens, 3 of its 4 usable blocks are held
        t2 = await _run(warm, second, new=8)
        assert t2.cached == 3 * BLOCK_SIZE and t2.prefilled == 72 - 48
        ref1, ref2 = await _run(cold, first, new=12), await _run(cold, second, new=8)
        assert t1.tokens == ref1.tokens and t2.tokens == ref2.tokens
        assert (ref2.cached, ref2.prefilled) == (0, 72)

        kept2 = _kept(second, t2.tokens)  # 79 tokens: 4 full blocks, the first 3 kept all along
        ev = warm.drain_block_events()
        assert ev.stored == block_hashes(kept2, seed)[3:] and ev.removed == []
        assert sorted(warm.held_blocks()) == sorted(block_hashes(kept2, seed))
        assert warm.stats().prefix_hit_rate == pytest.approx(48 / (40 + 72))

        # the whole kept sequence as a prompt: one token at least is computed
        t3 = await _run(warm, kept2[:64])
        assert t3.cached == 3 * BLOCK_SIZE and t3.prefilled == 16
        assert t3.tokens == (await _run(cold, kept2[:64])).tokens

        # reuse off: nothing reused, reported or held
        assert cold.drain_block_events().stored == [] and cold.held_blocks() == []
        assert cold.stats().prefix_hit_rate == 0.0 and not cold.stats().traits.prefix_cache
        assert cold._require_started().cache is None
    finally:
        await warm.shutdown()
        await cold.shutdown()


async def test_slot_choice_removed_events_and_zero_match(graph: Path) -> None:
    """An unrelated prompt takes the empty slot, then the least recently freed one (whose
    blocks are reported removed); a partial match keeps only the matched blocks. Free slots'
    kept KV survives other slots' decode steps (the dummy rows of a batched step)."""
    a, b, c, a_next = _prompts(40, 37, 50, 10)
    cold = await _engine(graph, prefix_reuse=False, slots=1)
    warm = await _engine(graph)
    try:
        seed = model_seed(warm.model_id)
        ta = await _run(warm, a)  # slot 0
        ha = block_hashes(_kept(a, ta.tokens), seed)
        assert warm.drain_block_events().stored == ha and len(ha) == 2

        tb = await _run(warm, b)  # no match: the empty slot 1, decoding with slot 0 idle
        assert (tb.cached, tb.prefilled) == (0, 37)
        hb = block_hashes(_kept(b, tb.tokens), seed)
        ev = warm.drain_block_events()
        assert ev.stored == hb and ev.removed == []
        assert sorted(warm.held_blocks()) == sorted(ha + hb)

        # a's follow-up still finds slot 0 intact
        follow = a + ta.tokens + a_next  # 56 tokens, 3 usable blocks, 2 held
        tf = await _run(warm, follow)
        assert tf.cached == 32 and tf.prefilled == 56 - 32
        assert tf.tokens == (await _run(cold, follow)).tokens
        hf = block_hashes(_kept(follow, tf.tokens), seed)
        ev = warm.drain_block_events()
        assert ev.stored == hf[2:] and ev.removed == []

        # unrelated again: b's slot is the least recently freed; its blocks go
        tc = await _run(warm, c)
        assert (tc.cached, tc.prefilled) == (0, 50)
        hc = block_hashes(_kept(c, tc.tokens), seed)
        ev = warm.drain_block_events()
        assert sorted(ev.removed) == sorted(hb) and ev.stored == hc
        assert sorted(warm.held_blocks()) == sorted(hf + hc)

        # a prompt sharing one block with slot 0: reuse 16 tokens, the rest of slot 0 goes
        partial = follow[:20] + _prompts(30, seed=5)[0]
        tp = await _run(warm, partial)
        assert tp.cached == 16 and tp.prefilled == 50 - 16
        assert tp.tokens == (await _run(cold, partial)).tokens
        hp = block_hashes(_kept(partial, tp.tokens), seed)
        ev = warm.drain_block_events()
        assert sorted(ev.removed) == sorted(hf[1:]) and ev.stored == hp[1:]
        assert sorted(warm.held_blocks()) == sorted(hp + hc)
        assert warm.stats().prefix_hit_rate == pytest.approx(48 / (40 + 37 + 56 + 50 + 50))
    finally:
        await warm.shutdown()
        await cold.shutdown()


async def test_free_slot_between_decoding_slots_keeps_its_kv(graph: Path) -> None:
    """Slots 0 and 2 decode in one batched step while slot 1, free, holds kept KV (a dummy
    row of the gqa step): its next turn still reuses it and matches a cold run. (z's 5-block
    match in slot 2 is worth the row more than the free slot 1 inside the busy span.)"""
    x, y, z, more = _prompts(40, 41, 80, 8, seed=21)
    cold = await _engine(graph, prefix_reuse=False, slots=1)
    warm = await _engine(graph, slots=3)
    try:
        outs = [await _run(warm, p) for p in (x, y, z)]  # slots 0, 1, 2 (empty ones first)
        assert [e.tokens[:1] for e in warm._require_started().cache.entries] == [
            x[:1],
            y[:1],
            z[:1],
        ]
        both = [p + o.tokens + more for p, o in ((x, outs[0]), (z, outs[2]))]
        turns = await asyncio.gather(*(_collect(warm, p) for p in both))
        assert [t[1] for t in turns] == [32, 80]  # slots 0 and 2, decoding together
        follow = y + outs[1].tokens + more
        t = await _run(warm, follow)
        assert t.cached == 32 and t.prefilled == len(follow) - 32
        assert t.tokens == (await _run(cold, follow)).tokens
        for p, (tokens, _) in zip(both, turns, strict=True):
            assert tokens == (await _run(cold, p, new=12)).tokens
    finally:
        await warm.shutdown()
        await cold.shutdown()


async def _collect(engine: EdgeEngine, prompt: list[int], new: int = 12) -> tuple[list[int], int]:
    tokens: list[int] = []
    cached = -1
    async for event in engine.generate(GenerationRequest(prompt, greedy(new))):
        tokens += event.token_ids
        cached = event.cached_tokens
    return tokens, cached


async def test_cancelled_request_leaves_its_kv(graph: Path) -> None:
    """A client that leaves (e.g. a stop string matched above the engine) leaves the KV it
    wrote: the next turn reuses the prompt's blocks."""
    prompt, more = _prompts(40, 5, seed=3)
    cold = await _engine(graph, prefix_reuse=False, slots=1)
    warm = await _engine(graph)
    try:
        stream = warm.generate(GenerationRequest(prompt, greedy(100)))
        first = await anext(stream)
        await stream.aclose()  # cancelled, at some point of its decode
        assert first.cached_tokens == 0 and warm.stats().running == 0
        follow = prompt + more
        t = await _run(warm, follow)
        assert t.cached == 32 and t.prefilled == 45 - 32
        assert t.tokens == (await _run(cold, follow)).tokens
    finally:
        await warm.shutdown()
        await cold.shutdown()


def test_collision_guard_and_integrity() -> None:
    """Equal hashes with different token ids are a miss; a busy slot is never matched."""
    cache = SlotCache(slots=2, seed=model_seed("m"), max_kept=100)
    tokens = list(range(3, 3 + 40))
    cache.take(0, 0)
    cache.release(0, tokens, cache.hashes(tokens[:16]))  # known hashes of a prefix
    cache.check_integrity()
    hashes = cache.hashes(tokens)
    assert cache.choose([0, 1], [*tokens, 1], hashes, limit=2) == (0, 2)
    forged = tokens[:16] + [7] * 16 + tokens[32:]  # block 1 differs, its hash is claimed equal
    assert cache.match(0, forged, hashes, limit=2) == 1
    assert cache.choose([0, 1], [9] * 40, cache.hashes([9] * 40), limit=2) == (1, 0)  # empty
    cache.take(0, 2)
    assert cache.match(0, tokens, hashes, limit=2) == 0  # busy
    assert sorted(cache.held_hashes()) == sorted(hashes)
    cache.check_integrity()
    cache.release(0, tokens[:32] + [5] * 90)  # kept up to max_kept tokens only
    assert cache.kept_len(0) == 100
    cache.check_integrity()
    ev = cache.drain_events()
    assert ev.removed == [] and len(ev.stored) == 100 // BLOCK_SIZE


async def test_a_prefix_a_running_request_holds_is_copied_into_the_next(graph: Path) -> None:
    """Two users of one app prompt at once: while A (48-token app prompt + question) decodes in
    slot 0, B (the same app prompt + another question) takes slot 1 with A's three prompt
    blocks copied into it and prefills only its question; its greedy tokens match a cold run.
    A's prompt blocks are reported stored as soon as its prefill wrote them."""
    system, qa, qb = _prompts(48, 10, 12, seed=21)
    cold = await _engine(graph, prefix_reuse=False, slots=1)
    warm = await _engine(graph)
    try:
        seed = model_seed(warm.model_id)
        a = warm.generate(GenerationRequest(system + qa, greedy(150)))
        await anext(a)  # A's prompt is written; it decodes on
        assert warm.drain_block_events().stored == block_hashes(system + qa, seed)[:3]
        tb = await _run(warm, system + qb)
        assert (tb.cached, tb.prefilled) == (48, 12)
        assert warm._require_started().copied_tokens == 48
        assert warm.stats().running == 1  # A still runs, its slot untouched
        await a.aclose()
        assert tb.tokens == (await _run(cold, system + qb)).tokens
        # A's own answer was not disturbed by the copy out of its slot
        ta = await _run(warm, system + qa, new=6)
        assert ta.cached == 48 and ta.tokens == (await _run(cold, system + qa)).tokens
    finally:
        await warm.shutdown()
        await cold.shutdown()


async def _waiting(engine: EdgeEngine, n: int) -> None:
    for _ in range(2000):
        if engine.stats().waiting == n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never {n} waiting")


@pytest.mark.parametrize("prefix_first", [4, 0])
async def test_a_waiting_request_whose_prefix_a_busy_slot_holds_goes_first(
    graph: Path, prefix_first: int
) -> None:
    """Two slots, both busy: A (unrelated, a long answer) and C (an app prompt S of five
    blocks and a question, a long answer). B (unrelated) waits, then D (S and another
    question). When A is cancelled its free slot keeps only A's prompt, but C's busy slot
    holds S: admitting by prefix, D goes first (S copied, only its question computed) and
    finishes while B still waits; in strict arrival order B goes first. D's greedy tokens
    match a cold run either way."""
    s, qc, qd, a, b = _prompts(80, 8, 8, 40, 40, seed=37)
    # answers as long as the model's context: C must still run when B and D are done, even
    # where the tiny model decodes a token in a fraction of a millisecond
    warm = await _engine(graph, prefix_first=prefix_first, context=2048)
    cold = await _engine(graph, prefix_reuse=False, slots=1)
    try:
        ga = warm.generate(GenerationRequest(a, greedy(1900)))
        gc = warm.generate(GenerationRequest(s + qc, greedy(1900)))
        await anext(ga)
        await anext(gc)
        finished: list[str] = []  # in the order the engine's final events were handed over

        async def run(name: str, prompt: list[int]) -> Turn:
            turn = await _run(warm, prompt)
            finished.append(name)
            return turn

        tb = asyncio.create_task(run("B", b))
        await _waiting(warm, 1)
        td = asyncio.create_task(run("D", s + qd))
        await _waiting(warm, 2)
        await ga.aclose()
        d = await td
        # S copied either way, so D computes only its 8-token question (not read from the
        # scheduler's counter: B, admitted when D ends, may prefill before D's last event)
        assert d.cached == 80
        await tb
        assert finished == (["D", "B"] if prefix_first else ["B", "D"])
        await gc.aclose()
        assert d.tokens == (await _run(cold, s + qd)).tokens
    finally:
        await warm.shutdown()
        await cold.shutdown()


@pytest.mark.parametrize("a_new", [6, 1])
async def test_a_second_user_admitted_mid_prefill_catches_up_on_the_first_ones_prompt(
    graph: Path, a_new: int
) -> None:
    """A and B, two users of one 160-token app prompt, sent together: B is admitted while A
    still prefills it in 16-token chunks, so its slot holds at most what A wrote by then.
    Catching up, B copies A's whole prompt before its own first chunk (A, older, prefills
    first; from A's busy slot, or from its free one where A's one-token answer is done) and
    computes only its question, with the same greedy tokens as a cold run."""
    system, qa, qb = _prompts(160, 10, 12, seed=23)
    cold = await _engine(graph, prefix_reuse=False, slots=1)
    warm = await _engine(graph, prefill_chunk=16)
    try:
        assert warm.stats().traits.prefix_catch_up
        scheduler = warm._require_started()
        ta, tb = await asyncio.gather(_run(warm, system + qa, a_new), _run(warm, system + qb))
        # the prompt tokens both computed: A's 170 and what B did not copy
        assert (tb.cached, scheduler.prefilled_tokens) == (160, 170 + 12)
        assert scheduler.copied_tokens >= 160 - 16
        assert ta.cached == 0
        assert tb.tokens == (await _run(cold, system + qb)).tokens
        assert ta.tokens == (await _run(cold, system + qa, a_new)).tokens
        warm._require_started().cache.check_integrity()  # type: ignore[union-attr]
    finally:
        await warm.shutdown()
        await cold.shutdown()


def test_a_free_slot_inside_the_busy_span_goes_first_unless_a_longer_prefix_is_worth_a_row() -> (
    None
):
    """Slot 2 decodes; slots 0, 1, 3, 4 and 5 keep finished requests' KV (5 freed first).
    A decode step runs every slot from the lowest busy one to the highest, so a new request
    takes slot 1 or 3 (one row more), the least recently freed of them, even over a 2-block
    match in slot 5; a 5-block match there is worth the rows."""
    cache = SlotCache(slots=6, seed=model_seed("m"), max_kept=200)
    kept = {s: list(range(100 * s + 3, 100 * s + 43)) for s in (0, 1, 3, 4)}
    kept[5] = list(range(503, 503 + 90))
    for s in range(6):
        cache.take(s, 0)
    for s in (5, 0, 1, 3, 4):
        cache.release(s, kept[s])
    cache.check_integrity()
    free = [0, 1, 3, 4, 5]

    def choose(prompt: list[int]) -> tuple[int, int]:
        return cache.choose(free, prompt, cache.hashes(prompt), limit=(len(prompt) - 1) // 16)

    assert choose([7] * 40) == (1, 0)
    assert choose(kept[5][:32] + [7] * 30) == (1, 0)
    assert choose([*kept[5], 7]) == (5, 5)
    cache.release(2, list(range(900, 940)))  # nothing busy: as before, whatever the order
    assert choose([7] * 40) == (5, 0)


def test_grow_adopt_and_the_busy_slot_to_copy_from() -> None:
    cache = SlotCache(slots=3, seed=model_seed("m"), max_kept=200)
    prompt = list(range(3, 3 + 50))
    hashes = cache.hashes(prompt)
    cache.take(0, 0)
    cache.grow(0, prompt[:20], hashes)  # one full block written so far
    assert cache.best_source(prompt, hashes, limit=3, exclude=1) == (0, 1)
    cache.grow(0, prompt[:50], hashes)
    cache.check_integrity()
    assert cache.best_source(prompt, hashes, limit=3, exclude=1) == (0, 3)
    assert cache.best_source(prompt, hashes, limit=2, exclude=1) == (0, 2)  # the limit holds
    assert cache.best_source(prompt, hashes, limit=3, exclude=0) == (-1, 0)
    assert cache.choose([1, 2], prompt, hashes, limit=3) == (1, 0)  # busy: never chosen
    cache.take(1, 0)
    cache.adopt(1, 0, 3)
    cache.check_integrity()
    assert cache.drain_events().stored == hashes[:3]  # once, however many slots hold them
    cache.release(0, [*prompt, 9])
    cache.release(1, [*prompt[:48], 8, 8])
    cache.check_integrity()
    with pytest.raises(IntegrityError):
        cache.grow(2, prompt, hashes)  # free
    cache.take(2, 0)
    cache.take(0, 3)
    with pytest.raises(IntegrityError):
        cache.adopt(2, 0, 4)  # slot 0 now keeps only 3 blocks


@pytest.mark.parametrize("prefix_first, want", [(0, (0, 80)), (1, (80, 0)), (4, (80, 80))])
async def test_a_request_reusing_a_freed_slots_prefix_goes_first(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory, prefix_first: int,
    want: tuple[int, int],
) -> None:  # fmt: skip
    """Two slots, both busy: A (a long answer) and C (an app prompt S of five blocks and a
    question). B (unrelated) waits, then D1 and D2 (S and other questions). When C ends, its
    slot keeps S: in strict arrival order B takes it and overwrites S, so D1 prefills S again
    (and D2 reuses D1's); admitted first, D1 reuses it, and D2 too unless B has been passed
    its limit (``prefix_first``) by then and overwrites S when D1 ends. D1's greedy tokens
    match a cold run."""
    root = tmp_path_factory.getbasetemp() / "edge-onnx"
    root.mkdir(exist_ok=True)
    folder = ensure_export(tiny_model_path, "fp32", "gqa", root=root).folder
    s, q1, q3, qd1, qd2, a, b = _prompts(80, 8, 8, 8, 8, 40, 40, seed=31)
    warm = await _engine(folder, prefix_first=prefix_first)
    cold = await _engine(folder, prefix_reuse=False, slots=1)
    try:
        assert (await _run(warm, s + q1)).cached == 0  # slot 0 keeps S
        runs = [(a, 100), (s + q3, 8), (b, 6), (s + qd1, 8), (s + qd2, 6)]
        done = await asyncio.gather(*(_collect(warm, p, new) for p, new in runs))
        assert done[1][1] == 80  # C reused the kept S
        assert done[2][1] == 0
        assert (done[3][1], done[4][1]) == want
        assert warm._require_started().cache.check_integrity() is None
        assert done[3][0] == (await _run(cold, s + qd1, new=8)).tokens
    finally:
        await warm.shutdown()
        await cold.shutdown()


def test_a_slot_keeping_a_prefix_two_requests_used_goes_last() -> None:
    """Slot 0 keeps an app's prompt that a second request reused (shared blocks); slot 1 a
    one-off chat freed later. A prompt of another app takes slot 1, not the least recently
    freed slot 0 (which would lose the app's prompt); a request of the app still takes slot
    0. A copy from a busy slot shares both slots' blocks."""
    cache = SlotCache(slots=3, seed=model_seed("m"), max_kept=200)
    app, chat = list(range(3, 3 + 64)), list(range(500, 540))
    for s in (0, 1, 2):
        cache.take(s, 0)
    cache.release(0, [*app, 1, 2])
    cache.release(2, [])
    prompt = [*app, 9, 9]
    hashes = cache.hashes(prompt)
    assert cache.choose([0], prompt, hashes, limit=4) == (0, 4)
    cache.take(0, 4)  # the app's second user reuses its four blocks
    cache.release(0, [*prompt, 5])
    cache.release(1, chat)
    cache.check_integrity()
    assert (cache.entries[0].shared, cache.entries[1].shared) == (4, 0)
    other = [7] * 40
    assert cache.choose([0, 1], other, cache.hashes(other), limit=2) == (1, 0)
    assert cache.choose([0, 1], prompt, hashes, limit=4) == (0, 4)
    # a copy out of a busy slot: the source's blocks are shared too, the copy's are
    fresh = list(range(900, 948))
    cache.take(1, 0)
    cache.grow(1, fresh, cache.hashes(fresh))
    cache.take(2, 0)
    cache.adopt(2, 1, 2)
    assert (cache.entries[1].shared, cache.entries[2].shared) == (2, 2)
    cache.check_integrity()
