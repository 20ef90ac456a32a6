"""Admission on the edge: which waiting request goes into a free slot next, and into which.

The slot loop (``edge_runtime.scheduler``) asks, at the top of an iteration and under its lock,
for the next waiting request and a placement for it; this module decides both from the queue and
what the slots keep (``edge_runtime.slot_cache``), and never runs the model.

Invariants:
- Queue order is priority, then arrival. With prefix reuse, a waiting request whose prompt has
  ``PREFIX_FIRST_MIN_BLOCKS`` more leading blocks held on the node (kept in a free slot, or
  written so far in a busy one, which admission copies) than every request ahead of it of its
  priority goes first (``routing.admission.prefix_first``): under a queue one slot frees at a
  time, and the request at the head would overwrite the kept prefix another one waits for.
  Each request it goes ahead of counts one pass; none is passed more than ``prefix_first``
  times (0: strict order), so none starves.
- A request takes the free slot holding the longest run of its leading blocks (at most
  ``(prompt - 1) // 16``, so one prompt token at least is computed; see ``SlotCache.choose``).
  When another slot holds a longer run, those blocks are copied into its slot: the placement
  names the copy, which the loop runs before anything else (only the loop thread runs or
  admits, so no run writes the source's prefix meanwhile).
- Catch-up: before a request's next prompt chunk, the leading blocks of its prompt another slot
  (busy, or free and kept) holds beyond its own are copied in the same way.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import takewhile

from edge_runtime.slot_cache import SlotCache
from edge_runtime.slot_request import SlotRequest
from routing.admission import PREFIX_FIRST_WINDOW, prefix_first
from routing.blocks import reusable_blocks


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy the KV of the leading ``blocks`` blocks of slot ``source`` into slot ``target``."""

    source: int
    target: int
    blocks: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where an admitted request starts: its ``slot`` and the leading prompt ``blocks`` it
    starts with (kept there, or brought by ``copy``, which then brings ``copied`` of them)."""

    slot: int
    blocks: int
    copy: Copy | None = None
    copied: int = 0


class Admission:
    """The wait queue and the slot choice of one slot loop (called under its lock, but for
    :meth:`hash`). ``cache`` None: prefix reuse off (strict order, the lowest free slot)."""

    def __init__(self, cache: SlotCache | None, prefix_first: int = 4) -> None:
        self.cache = cache
        self.prefix_first = max(0, prefix_first)
        self._waiting: list[tuple[tuple[int, float], int, SlotRequest]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def hash(self, r: SlotRequest) -> None:
        """Fill ``r.hashes`` (no shared state: called outside the lock)."""
        if self.cache is not None:
            r.hashes = self.cache.hashes(r.request.prompt_token_ids, r.request.cache_salt)

    def push(self, r: SlotRequest) -> None:
        heapq.heappush(self._waiting, (r.sort_key(), self._seq, r))
        self._seq += 1

    def remove(self, request_id: str) -> SlotRequest | None:
        """Take a waiting request out of the queue; None if it is not waiting."""
        for i, (_, _, r) in enumerate(self._waiting):
            if r.request.request_id == request_id:
                self._waiting.pop(i)
                heapq.heapify(self._waiting)
                return r
        return None

    def clear(self) -> list[SlotRequest]:
        """Empty the queue; returns what waited."""
        waiting = [w[2] for w in self._waiting]
        self._waiting.clear()
        return waiting

    def next_request(self) -> SlotRequest:
        """Take the waiting request to admit next: the first in order unless a later one of
        the same priority has several more leading blocks held on the node."""
        if self.cache is None or self.prefix_first == 0 or len(self._waiting) == 1:
            return heapq.heappop(self._waiting)[2]
        order = heapq.nsmallest(PREFIX_FIRST_WINDOW, self._waiting)
        top = order[0][2].request.priority  # never ahead of a request of higher priority
        same = takewhile(lambda e: e[2].request.priority == top, order)
        best = prefix_first(((self._held(e[2]), e[2].passed) for e in same), self.prefix_first)
        if best == 0:
            return heapq.heappop(self._waiting)[2]
        for _, _, r in order[:best]:
            r.passed += 1
        chosen = order[best]
        self._waiting.remove(chosen)
        heapq.heapify(self._waiting)
        return chosen[2]

    def place(self, r: SlotRequest, free: list[int]) -> Placement:
        """Choose ``r``'s slot among ``free`` (non-empty) and take it in the cache: the free
        slot keeping most of its leading blocks, topped up by a copy from a slot holding
        more; without prefix reuse the lowest free slot."""
        if self.cache is None:
            return Placement(free[0], 0)
        prompt, limit = r.request.prompt_token_ids, reusable_blocks(r.prompt_len)
        slot, blocks = self.cache.choose(free, prompt, r.hashes, limit)
        self.cache.take(slot, blocks, r.request.cache_salt)
        source, more = self.cache.best_source(prompt, r.hashes, limit, exclude=slot)
        if more <= blocks:
            return Placement(slot, blocks)
        self.cache.adopt(slot, source, more)
        return Placement(slot, more, Copy(source, slot, more), more - blocks)

    def catch_up(self, r: SlotRequest) -> Copy | None:
        """Before ``r``'s next chunk: the copy of the leading blocks of its prompt another slot
        holds (busy, or free and kept) beyond the ``r.filled`` positions it has, taken in the
        cache; None when no slot holds more."""
        if self.cache is None:
            return None
        prompt, limit = r.request.prompt_token_ids, reusable_blocks(r.prompt_len)
        source, blocks = self.cache.best_source(
            prompt, r.hashes, limit, exclude=r.slot, free_too=True
        )
        if blocks * self.cache.block_size <= r.filled:
            return None
        self.cache.adopt(r.slot, source, blocks)
        return Copy(source, r.slot, blocks)

    def _held(self, r: SlotRequest) -> int:
        """The most leading blocks of ``r`` the node holds, in a free slot (kept) or a busy one
        (written so far): what :meth:`place` gives it."""
        assert self.cache is not None
        limit = reusable_blocks(r.prompt_len)
        prompt = r.request.prompt_token_ids
        return self.cache.best_source(prompt, r.hashes, limit, exclude=-1, free_too=True)[1]
