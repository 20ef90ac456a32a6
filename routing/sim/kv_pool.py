"""The simulated cloud replica's KV pool, :class:`KvPool`: a finite pool of 16-token blocks
in which freed full prompt blocks stay cached (LRU) as a prefix cache until an allocation needs
them, reporting blocks it stores and evicts to its ``EventSink``. Invariant: free + cached +
referenced + held == total at every step boundary (``check``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from routing.sim.node import EventSink, SimRequest


class KvPool:
    """A finite pool of 16-token blocks; freed hashed blocks stay cached (LRU) until needed."""

    def __init__(self, total: int, on_blocks: EventSink) -> None:
        self.total = total
        self.free = total
        self.refs: dict[int, int] = {}  # hashed blocks in use -> refcount
        self.cached: OrderedDict[int, None] = OrderedDict()  # hashed, unreferenced (LRU first)
        self.held = 0  # unhashed blocks in use
        self.on_blocks = on_blocks
        self.hits = 0

    @property
    def used(self) -> int:
        return self.total - self.free - len(self.cached)

    def available(self) -> int:
        return self.free + len(self.cached)

    def check(self) -> None:
        assert self.free + len(self.cached) + len(self.refs) + self.held == self.total, (
            self.free,
            len(self.cached),
            len(self.refs),
            self.held,
            self.total,
        )

    def alloc(self, n: int) -> bool:
        """Take ``n`` unhashed blocks, evicting cached ones (LRU) if needed."""
        if n > self.free + len(self.cached):
            return False
        removed = []
        while self.free < n:
            k, _ = self.cached.popitem(last=False)
            removed.append(k)
            self.free += 1
        self.free -= n
        self.held += n
        if removed:
            self.on_blocks([], removed)
        return True

    def match(self, keys: Sequence[int], limit: int) -> list[int]:
        """Reference the longest run of leading ``keys`` the pool holds (at most ``limit``)."""
        out = []
        refs, cached = self.refs, self.cached
        for k in keys[:limit]:
            n = refs.get(k)
            if n is not None:
                refs[k] = n + 1
            elif k in cached:
                del cached[k]
                refs[k] = 1
            else:
                break
            out.append(k)
        return out

    def unmatch(self, keys: Sequence[int]) -> None:
        for k in keys:
            n = self.refs[k] - 1
            if n:
                self.refs[k] = n
            else:
                del self.refs[k]
                self.cached[k] = None

    def publish(self, r: SimRequest, keys: Sequence[int]) -> None:
        """After ``r``'s prefill: its computed full prompt blocks become hashed blocks."""
        stored = []
        for k in keys:
            if r.held <= 0:
                break
            if k in self.refs:  # computed twice at once: keep one copy
                self.refs[k] += 1
                self.free += 1
            elif k in self.cached:
                del self.cached[k]
                self.refs[k] = 1
                self.free += 1
            else:
                self.refs[k] = 1
                stored.append(k)
            r.held -= 1
            self.held -= 1
            r.refs.append(k)
        if stored:
            self.on_blocks(stored, [])

    def release(self, r: SimRequest) -> None:
        self.unmatch(r.refs)
        r.refs = []
        self.free += r.held
        self.held -= r.held
        r.held = 0
