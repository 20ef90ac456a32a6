"""Block manager: ref-counted KV blocks with a prefix cache keyed by ``routing.blocks`` hashes.

Every block of the pool is in exactly one of three states:

- **free**: ref count 0, no hash, in ``_free`` (reused before anything cached is evicted);
- **cached**: ref count 0, holds a full block of tokens under its chained hash, in the LRU
  ``_lru`` (oldest release first); evicted only when the pool needs room;
- **in use**: ref count > 0 (a block shared by several sequences through the prefix cache has a
  ref per sequence); it may also carry a hash, so later requests can share it.

Invariants (checked by :meth:`check_integrity`): free + cached + in use == total, the three sets
are disjoint, and ``_by_hash`` maps exactly the hashed blocks (free-list blocks carry no hash).

A hash maps to at most one block. The collision guard keeps each hashed block's token ids and
compares them before reuse: a 64-bit collision is then a cache miss, never wrong KV.

Every hash that enters the cache is reported as *stored* and every hash that leaves it as
*removed* (see :meth:`drain_events`); the node app forwards them to the fleet store's
``record_blocks``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from routing.blocks import BLOCK_SIZE, BlockEvents


class IntegrityError(AssertionError):
    pass


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        on_events: Callable[[BlockEvents], None] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives block 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pending: dict[int, bool] = {}  # hash -> True stored / False removed (latest wins)
        self._events_lock = threading.Lock()
        self._on_events = on_events

    # -- counts ----------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks that an allocation can take now (free, or cached and evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    # -- prefix cache ----------------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[int], token_ids: Sequence[int]) -> list[int]:
        """The cached blocks holding the leading full blocks of ``token_ids`` (whose chained
        hashes are ``hashes``), stopping at the first miss. Takes no reference."""
        out: list[int] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            b = self._by_hash.get(h)
            if b is None or self._tokens[b] != tuple(token_ids[i * bs : (i + 1) * bs]):
                break
            out.append(b)
        return out

    def num_evictable_in(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the LRU (taking them shrinks ``num_available``)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def can_allocate(self, num_new: int, reuse: Sequence[int] = (), reserve: int = 0) -> bool:
        """Whether ``num_new`` fresh blocks can be taken after acquiring ``reuse``, leaving
        ``reserve`` blocks available."""
        return self.num_available - self.num_evictable_in(reuse) - num_new >= reserve

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on blocks found by :meth:`match_prefix`."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with ref count 1: free ones first, then the least recently released
        cached ones (their hashes are removed from the cache)."""
        if n > self.num_available:
            raise MemoryError(f"need {n} KV blocks, {self.num_available} available")
        out: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                self._unhash(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def register(self, block: int, block_hash: int, token_ids: Sequence[int]) -> bool:
        """Publish an in-use, now full block under its chained hash. Returns False (and leaves
        the block private) when the hash is already cached: a duplicate computed concurrently,
        or a collision."""
        if self._ref[block] <= 0:
            raise IntegrityError(f"register of block {block} that is not in use")
        if self._hash[block] is not None or block_hash in self._by_hash:
            return False
        self._hash[block] = block_hash
        self._tokens[block] = tuple(token_ids)
        self._by_hash[block_hash] = block
        self._event(block_hash, True)
        return True

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, last block first, so that a sequence's deeper
        blocks are evicted before its leading ones (which more requests share)."""
        for b in reversed(blocks):
            r = self._ref[b] - 1
            if r < 0:
                raise IntegrityError(f"double free of block {b}")
            self._ref[b] = r
            if r == 0:
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._lru[b] = None

    def _unhash(self, b: int) -> None:
        h = self._hash[b]
        if h is not None:
            del self._by_hash[h]
            self._hash[b] = None
            self._tokens[b] = None
            self._event(h, False)

    def reset_cache(self) -> int:
        """Forget every cached (unreferenced) block; returns how many were dropped."""
        n = 0
        while self._lru:
            b, _ = self._lru.popitem(last=False)
            self._unhash(b)
            self._free.append(b)
            n += 1
        return n

    # -- events ----------------------------------------------------------------------------
    def _event(self, block_hash: int, stored: bool) -> None:
        with self._events_lock:
            self._pending[block_hash] = stored

    def held_hashes(self) -> list[int]:
        """Every hash the cache holds now (cached or in use): a full snapshot of what the
        events so far add up to, for a fleet index that has to start over."""
        return list(self._by_hash)

    def drain_events(self) -> BlockEvents:
        """Stored/removed hashes since the last drain (thread-safe); also sent to ``on_events``."""
        with self._events_lock:
            pending, self._pending = self._pending, {}
        ev = BlockEvents(
            stored=[h for h, s in pending.items() if s],
            removed=[h for h, s in pending.items() if not s],
        )
        if ev and self._on_events is not None:
            self._on_events(ev)
        return ev

    # -- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless free + cached + in use == total, the states are
        disjoint, and the hash index matches the blocks' hashes."""
        free, cached = set(self._free), set(self._lru)
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        if len(free) != len(self._free):
            raise IntegrityError("a block is on the free list twice")
        if free & cached or free & used or cached & used:
            raise IntegrityError("a block is in two states at once")
        if len(free) + len(cached) + len(used) != self.num_blocks:
            raise IntegrityError(
                f"free {len(free)} + cached {len(cached)} + in use {len(used)} != {self.num_blocks}"
            )
        if any(self._ref[b] < 0 for b in range(self.num_blocks)):
            raise IntegrityError("negative ref count")
        if any(self._hash[b] is not None for b in free):
            raise IntegrityError("a free-list block carries a hash")
        if any(self._hash[b] is None for b in cached):
            raise IntegrityError("a cached block has no hash")
        hashed = {b for b in range(self.num_blocks) if self._hash[b] is not None}
        if {self._by_hash[h] for h in self._by_hash} != hashed or any(
            self._hash[b] != h for h, b in self._by_hash.items()
        ):
            raise IntegrityError("hash index out of sync")
