"""What each slot's KV cache still holds after its request ended, for prefix reuse.

Multi-turn chat resends the whole conversation each turn. When a request ends, the KV of its
sequence stays in its slot; a later request whose leading 16-token blocks match a free slot's
kept tokens takes that slot and prefills only the rest. Blocks are named by the same chained
hashes as the gateway and the cloud engine (``routing.blocks``, seeded by the model identity).

Each slot has one :class:`SlotEntry`: the token ids whose KV is valid at positions
``0..len(tokens)-1`` of the slot, and the hashes of their full blocks. A slot is either

- **free**: it holds the whole kept sequence of the request that last ran in it (or nothing),
  and is offered for reuse (:meth:`SlotCache.match`);
- **busy**: a request runs in it; the entry keeps the leading blocks that request reused (its
  other blocks were reported removed when the slot was taken), growing by each full block of
  its prompt as its prefill writes them (:meth:`SlotCache.grow`). They are never taken from
  it while it runs, but a new request that shares them may have them copied into its own slot
  (:meth:`SlotCache.best_source`, :meth:`SlotCache.adopt`): two users of one system prompt at
  once both skip it. The request's whole sequence comes back when it ends.

Invariants (checked by :meth:`SlotCache.check_integrity`):

- ``entry.hashes == block_hashes(entry.tokens, scope_seed(seed, entry.salt))`` for every slot
  (full blocks only; ``entry.salt``: the cache scope of the request that wrote it, so a slot
  is reused only within its scope);
- a free slot keeps at most ``max_kept`` tokens (``context - 1``: a decode step writes one
  dummy position at a free slot's kept length, so that position must lie past the kept KV and
  inside the context);
- a busy slot keeps whole blocks only;
- ``entry.shared <= len(entry.hashes)``: its leading blocks that two requests have used (one
  reused or copied them from another), which :meth:`SlotCache.choose` protects;
- ``_count`` is the multiset of all slots' hashes; the held hashes are its keys. A hash is
  reported *stored* when its count goes 0 -> 1 and *removed* when it goes 1 -> 0 (two slots may
  hold the same prefix, e.g. one system prompt); pending events are latest-wins per hash.

A reuse match compares the token ids of every matched block, not only the hashes, so a 64-bit
collision is a miss, never wrong KV.

Threading: everything but :meth:`drain_events` is called under the scheduler's lock (the
scheduler thread and the asyncio side both take it); the pending events have a lock of their
own, so a drain never waits for a scheduler step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from routing.admission import PREFIX_FIRST_MIN_BLOCKS
from routing.blocks import BLOCK_SIZE, BlockEvents, block_hashes, hash_block, scope_seed


class IntegrityError(AssertionError):
    pass


@dataclass(slots=True)
class SlotEntry:
    tokens: list[int] = field(default_factory=list)  # KV valid at positions 0..len-1
    hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    busy: bool = False
    released: int = 0  # the cache's clock when the slot last became free (LRU order)
    shared: int = 0  # leading blocks of ``hashes`` two requests have used (an app's prompt)
    salt: str = ""  # the cache scope its tokens were written in (routing.blocks.scope_seed)


class SlotCache:
    """Kept KV of ``slots`` slots, their block hashes and the events a fleet index needs."""

    def __init__(
        self,
        slots: int,
        seed: int,
        max_kept: int,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        if max_kept < 0:
            raise ValueError("max_kept must be >= 0")
        self.seed, self.max_kept, self.block_size = seed, max_kept, block_size
        self.entries = [SlotEntry() for _ in range(slots)]
        self._count: dict[int, int] = {}
        self._clock = 0
        self._pending: dict[int, bool] = {}  # hash -> True stored / False removed (latest wins)
        self._events_lock = threading.Lock()

    # --- hashing (no state: callable outside the lock) ------------------------------------------

    def hashes(self, tokens: Sequence[int], salt: str = "") -> list[int]:
        """The chained hashes of every full block of ``tokens`` in cache scope ``salt``."""
        return block_hashes(tokens, scope_seed(self.seed, salt), self.block_size)

    def extend(self, tokens: Sequence[int], known: Sequence[int], salt: str = "") -> list[int]:
        """The hashes of every full block of ``tokens`` in scope ``salt``, given ``known``: the
        hashes of a prefix of them (e.g. of the prompt, when ``tokens`` is the prompt plus its
        output)."""
        bs, n = self.block_size, len(tokens) // self.block_size
        out = list(known[:n])
        parent = out[-1] if out else scope_seed(self.seed, salt)
        for i in range(len(out), n):
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    # --- choosing a slot -------------------------------------------------------------------------

    def match(self, slot: int, tokens: Sequence[int], hashes: Sequence[int], limit: int) -> int:
        """How many leading blocks of ``tokens`` (whose block hashes are ``hashes``) free
        ``slot`` holds, at most ``limit``; 0 for a busy slot."""
        e = self.entries[slot]
        return 0 if e.busy else self._leading(e, tokens, hashes, limit)

    def best_source(
        self,
        tokens: Sequence[int],
        hashes: Sequence[int],
        limit: int,
        exclude: int,
        free_too: bool = False,
    ) -> tuple[int, int]:
        """``(slot, blocks)``: the busy slot (or, ``free_too``, any slot) other than
        ``exclude`` holding the longest run of leading blocks of ``tokens`` (at most
        ``limit``), to copy from; ``(-1, 0)`` if none."""
        best, most = -1, 0
        for slot, e in enumerate(self.entries):
            if (e.busy or free_too) and slot != exclude and len(e.hashes) > most:
                n = self._leading(e, tokens, hashes, limit)
                if n > most:
                    best, most = slot, n
        return best, most

    def _leading(
        self, e: SlotEntry, tokens: Sequence[int], hashes: Sequence[int], limit: int
    ) -> int:
        bs, n, most = self.block_size, 0, min(limit, len(hashes), len(e.hashes))
        while n < most and e.hashes[n] == hashes[n]:
            n += 1
        if e.tokens[: n * bs] != list(tokens[: n * bs]):  # a collision: stop at its block
            n = next(
                i
                for i in range(n)
                if e.tokens[i * bs : (i + 1) * bs] != list(tokens[i * bs : (i + 1) * bs])
            )
        return n

    def choose(
        self, free: Sequence[int], tokens: Sequence[int], hashes: Sequence[int], limit: int
    ) -> tuple[int, int]:
        """``(slot, blocks)``: of the ``free`` slots, the one holding the longest run of
        leading blocks of ``tokens`` (at most ``limit``); without any match, an empty slot,
        else the least recently freed one, so that kept KV survives as long as possible.

        While any slot is busy, a match fewer than ``PREFIX_FIRST_MIN_BLOCKS`` blocks short of
        the longest counts as the longest (a few blocks are not worth a row more in every
        decode step after), and of those the slot that widens the busy slots' span least goes
        first: a decode step runs every slot from the lowest busy one to the highest
        (``edge_runtime.scheduler``), so a free slot inside that span costs no more per step.

        A slot whose shared blocks (``SlotEntry.shared``: two requests used them, as an app's
        system prompt) the request would overwrite goes after those of as long a match
        (before the span's rule), so one prompt of another app does not take the only copy of
        a prefix its next user would then compute cold."""
        if not free:
            raise ValueError("no free slot")
        matched = [(s, self.match(s, tokens, hashes, limit)) for s in free]
        busy = [i for i, e in enumerate(self.entries) if e.busy]
        most = max(n for _, n in matched)
        best, best_n, best_key = free[0], 0, None
        for s, n in matched:
            e = self.entries[s]
            loses = e.shared > n
            if busy and n > most - PREFIX_FIRST_MIN_BLOCKS:
                widen = max(busy[-1], s) - min(busy[0], s) - (busy[-1] - busy[0])
                key = (0, loses, widen, -n, bool(e.tokens), e.released, s)
            else:  # longest match first; then shared blocks kept, nothing to lose (empty),
                # then least recently freed
                key = (1 if busy else 0, -n, loses, 0, bool(e.tokens), e.released, s)
            if best_key is None or key < best_key:
                best, best_n, best_key = s, n, key
        return best, best_n

    # --- slot life cycle -------------------------------------------------------------------------

    def take(self, slot: int, blocks: int, salt: str = "") -> None:
        """A request of cache scope ``salt`` starts in free ``slot`` reusing its leading
        ``blocks`` blocks (matched by hash, so of that scope): the rest of the kept KV is
        overwritten, so its hashes leave the cache."""
        e = self.entries[slot]
        if e.busy:
            raise IntegrityError(f"slot {slot} taken twice")
        if blocks > len(e.hashes):
            raise IntegrityError(f"slot {slot} holds {len(e.hashes)} blocks, not {blocks}")
        self._drop(e.hashes[blocks:])
        e.tokens = e.tokens[: blocks * self.block_size]
        e.hashes = e.hashes[:blocks]
        e.busy = True
        e.salt = salt
        e.shared = blocks  # its last request's and this one's

    def grow(self, slot: int, tokens: Sequence[int], hashes: Sequence[int]) -> None:
        """The request in busy ``slot`` has written the KV of ``tokens`` (its prompt so far;
        ``hashes``: its prompt's block hashes): their full blocks join what the slot keeps."""
        e = self.entries[slot]
        if not e.busy:
            raise IntegrityError(f"slot {slot} grown while free")
        n = min(len(tokens) // self.block_size, len(hashes))
        have = len(e.hashes)
        if n <= have:
            return
        self._add(hashes[have:n])
        e.tokens = list(tokens[: n * self.block_size])
        e.hashes = list(hashes[:n])

    def adopt(self, slot: int, source: int, blocks: int) -> None:
        """Busy ``slot`` (just taken, or before its request's next chunk) now holds the
        leading ``blocks`` blocks of ``source`` (busy, or free and kept), whose KV the caller
        copies into it before anything can take or write ``source``; the blocks ``slot`` holds
        already must be the same ones."""
        e, s = self.entries[slot], self.entries[source]
        if not e.busy or slot == source:
            raise IntegrityError(f"adopt from slot {source} into {slot}: it must be busy")
        if blocks > len(s.hashes) or s.hashes[: len(e.hashes)] != e.hashes:
            raise IntegrityError(f"slot {source} does not hold {blocks} blocks {slot} extends")
        if blocks <= len(e.hashes):
            return
        self._add(s.hashes[len(e.hashes) : blocks])
        e.tokens = s.tokens[: blocks * self.block_size]
        e.hashes = s.hashes[:blocks]
        e.shared = blocks
        s.shared = max(s.shared, blocks)

    def release(self, slot: int, tokens: Sequence[int], known: Sequence[int] = ()) -> None:
        """The request in ``slot`` ended with the KV of ``tokens`` written (its prompt and the
        generated tokens that were fed back; ``known``: hashes of a prefix of them). The slot
        becomes free and offers them (at most ``max_kept`` tokens)."""
        e = self.entries[slot]
        if not e.busy:
            raise IntegrityError(f"slot {slot} released while free")
        kept = list(tokens[: self.max_kept])
        if kept[: len(e.tokens)] != e.tokens:
            raise IntegrityError(f"slot {slot}: the request did not extend the reused prefix")
        new = self.extend(kept, known, e.salt)
        self._add(new)  # before the drop: the reused leading blocks never leave the cache
        self._drop(e.hashes)
        e.tokens, e.hashes, e.busy = kept, new, False
        e.shared = min(e.shared, len(new))
        self._clock += 1
        e.released = self._clock

    def reset(self) -> None:
        """Every slot free and empty (the scheduler emptied them all: a failed step left
        their contents unknown, or the engine stops); their hashes leave the cache."""
        for e in self.entries:
            self._drop(e.hashes)
            e.tokens, e.hashes, e.busy, e.shared = [], [], False, 0

    def kept_len(self, slot: int) -> int:
        """Positions of ``slot`` holding kept KV (a free slot's dummy decode row writes here)."""
        return len(self.entries[slot].tokens)

    def _add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            c = self._count.get(h, 0)
            self._count[h] = c + 1
            if c == 0:
                self._event(h, True)

    def _drop(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            c = self._count[h] - 1
            if c:
                self._count[h] = c
            else:
                del self._count[h]
                self._event(h, False)

    # --- events ----------------------------------------------------------------------------------

    def _event(self, block_hash: int, stored: bool) -> None:
        with self._events_lock:
            self._pending[block_hash] = stored

    def held_hashes(self) -> list[int]:
        """Every hash some slot holds now (free slots' kept blocks, and the leading blocks a
        running request reused): what the events so far add up to."""
        return list(self._count)

    def drain_events(self) -> BlockEvents:
        """Stored/removed hashes since the last drain (thread-safe, latest wins per hash)."""
        with self._events_lock:
            pending, self._pending = self._pending, {}
        return BlockEvents(
            stored=[h for h, s in pending.items() if s],
            removed=[h for h, s in pending.items() if not s],
        )

    # --- integrity -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless every entry's hashes are its tokens' block
        hashes, free slots keep at most ``max_kept`` tokens, busy slots whole blocks, no entry
        counts more shared blocks than it keeps, and the hash counts are the multiset of all
        entries' hashes."""
        counts: dict[int, int] = {}
        for slot, e in enumerate(self.entries):
            if e.hashes != self.hashes(e.tokens, e.salt):
                raise IntegrityError(f"slot {slot}: hashes do not match its tokens")
            if not e.busy and len(e.tokens) > self.max_kept:
                raise IntegrityError(f"slot {slot} keeps {len(e.tokens)} > {self.max_kept}")
            if e.busy and len(e.tokens) % self.block_size:
                raise IntegrityError(f"busy slot {slot} keeps a partial block")
            if not 0 <= e.shared <= len(e.hashes):
                raise IntegrityError(f"slot {slot}: {e.shared} shared of {len(e.hashes)} blocks")
            for h in e.hashes:
                counts[h] = counts.get(h, 0) + 1
        if counts != self._count:
            raise IntegrityError("hash counts out of sync with the slots")
