"""Block manager: ref counts, prefix reuse, LRU eviction, collision guard, integrity, events."""

from __future__ import annotations

import pytest

from cloud_engine.block_manager import BlockManager, IntegrityError
from routing.blocks import block_hashes, model_seed

SEED = model_seed("test-model")


def toks(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_allocate_release_and_integrity() -> None:
    bm = BlockManager(8)
    a = bm.allocate(3)
    assert bm.num_used == 3 and bm.num_available == 5
    bm.check_integrity()
    bm.release(a)
    assert bm.num_used == 0 and bm.num_available == 8 and bm.num_cached == 0
    bm.check_integrity()
    with pytest.raises(IntegrityError):
        bm.release(a[:1])  # double free
    with pytest.raises(MemoryError):
        bm.allocate(9)


def test_prefix_reuse_and_lru_eviction() -> None:
    bm = BlockManager(6)
    ids = toks(48)
    hs = block_hashes(ids, SEED)
    blocks = bm.allocate(3)
    for b, h, i in zip(blocks, hs, range(3), strict=True):
        assert bm.register(b, h, ids[16 * i : 16 * (i + 1)])
    # A second request with the same first 32 tokens reuses exactly two leading blocks.
    other = toks(32) + toks(16, base=1000)
    m = bm.match_prefix(block_hashes(other, SEED), other)
    assert m == blocks[:2]
    bm.acquire(m)
    assert bm.ref_count(blocks[0]) == 2
    bm.release(blocks)  # first request done: block 2 becomes cached, blocks 0-1 still shared
    assert bm.num_cached == 1 and bm.num_used == 2
    bm.release(m)
    assert bm.num_cached == 3 and bm.num_used == 0
    bm.check_integrity()
    # Free blocks go first; then cached ones in LRU order: the deepest block was released first.
    fresh = bm.allocate(4)
    assert set(fresh[:3]).isdisjoint(blocks) and fresh[3] == blocks[2]
    assert bm.match_prefix(hs, ids) == blocks[:2]  # the leading blocks survived
    ev = bm.drain_events()
    assert set(ev.stored) == set(hs) - {hs[2]} and ev.removed == [hs[2]]
    assert not bm.drain_events()
    bm.check_integrity()


def test_collision_guard_compares_token_ids() -> None:
    bm = BlockManager(4)
    (b,) = bm.allocate(1)
    assert bm.register(b, 12345, toks(16))
    # Same (forged) hash, different tokens: no reuse.
    assert bm.match_prefix([12345], toks(16, base=7)) == []
    assert bm.match_prefix([12345], toks(16)) == [b]
    # A second block under an existing hash stays private.
    (c,) = bm.allocate(1)
    assert not bm.register(c, 12345, toks(16, base=7))
    bm.release([b, c])
    assert bm.num_cached == 1
    bm.check_integrity()


def test_integrity_detects_corruption() -> None:
    bm = BlockManager(4)
    bm.allocate(1)
    bm._free.append(bm._free[-1])  # a block listed twice
    with pytest.raises(IntegrityError):
        bm.check_integrity()
