"""Fleet-wide slot counts for fair share: the in-process store (one gateway) and the
interface the Redis one (:mod:`gateway.fair_redis`) shares.

Invariants (both implementations):
- :meth:`FairCounts.try_acquire` decides by :func:`gateway.fair_share.verdict` and updates the
  counts in the same step: ``ADMIT`` takes the slot (and drops the request's waiting mark if
  it had one); ``FLEET`` leaves (or puts) a waiting mark, so that other keys see it wait;
  ``OWN_LIMIT`` drops its waiting mark (a request its own key holds back asks for no slot).
- ``registered`` (what the caller passes) is True exactly when the request's last answer was
  ``FLEET``: the caller keeps it, and gives the mark back with :meth:`leave` when it stops
  waiting without a slot; every ``ADMIT`` is given back once with :meth:`release`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from gateway.fair_share import KeyCount, Snapshot, Tenant, Verdict, allowed_slots, verdict


@dataclass(frozen=True, slots=True)
class Answer:
    """One :meth:`FairCounts.try_acquire`: the verdict, how many of the key's requests wait
    for a fleet slot fleet-wide (this one included when it waits), and how many slots the key
    may hold now (:func:`gateway.fair_share.allowed_slots`). ``local``: decided by the
    in-process fallback (give it back there)."""

    verdict: Verdict
    waiting: int
    allowed: int
    local: bool = False


class FairCounts(abc.ABC):
    """Where held slots and waiting marks are counted (see the module's invariants)."""

    @abc.abstractmethod
    async def try_acquire(
        self, t: Tenant, capacity: int, registered: bool, *, peek: bool = False
    ) -> Answer:
        """Take a slot for ``t`` or mark it waiting; ``peek``: decide only, change nothing."""

    @abc.abstractmethod
    def release(self, t: Tenant, answer: Answer) -> None:
        """Give back an admitted request's slot (synchronous: may finish in the background)."""

    @abc.abstractmethod
    def leave(self, t: Tenant, answer: Answer) -> None:
        """Drop a waiting mark (the request gave up or its key now holds it back)."""

    def health(self) -> dict[str, Any]:
        return {"backend": "local"}

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and background work."""


class InProcessFairCounts(FairCounts):
    """The counts in this process's memory: exact for one gateway (its event loop is the only
    writer, so each call is atomic)."""

    def __init__(self) -> None:
        self.snap = Snapshot()

    def _count(self, t: Tenant) -> KeyCount:
        c = self.snap.keys.get(t.key)
        if c is None:
            c = self.snap.keys[t.key] = KeyCount()
        c.weight, c.max_concurrent = t.weight, t.max_concurrent
        c.team, c.team_weight = t.team, t.team_weight
        return c

    def _drop_idle(self, key: str) -> None:
        c = self.snap.keys.get(key)
        if c is not None and c.held <= 0 and c.waiting <= 0:
            del self.snap.keys[key]

    def decide(self, t: Tenant, capacity: int, registered: bool, peek: bool = False) -> Answer:
        """The synchronous core of :meth:`try_acquire`."""
        v = verdict(self.snap, t, capacity, registered=registered)
        allowed = allowed_slots(self.snap, t, capacity, registered=registered)
        mine = self.snap.keys.get(t.key)
        waiting = mine.waiting if mine else 0
        if peek:
            return Answer(v, waiting + (0 if registered else 1), allowed, local=True)
        c = self._count(t)
        if v is Verdict.ADMIT:
            c.held += 1
            if registered:
                c.waiting -= 1
        elif v is Verdict.FLEET:
            if not registered:
                c.waiting += 1
        elif registered:
            c.waiting -= 1
        out = Answer(v, c.waiting, allowed, local=True)
        self._drop_idle(t.key)
        return out

    async def try_acquire(
        self, t: Tenant, capacity: int, registered: bool, *, peek: bool = False
    ) -> Answer:
        return self.decide(t, capacity, registered, peek)

    def release(self, t: Tenant, answer: Answer) -> None:
        c = self.snap.keys.get(t.key)
        if c is not None:
            c.held -= 1
            self._drop_idle(t.key)

    def leave(self, t: Tenant, answer: Answer) -> None:
        c = self.snap.keys.get(t.key)
        if c is not None:
            c.waiting -= 1
            self._drop_idle(t.key)

    def held(self, key: str) -> int:
        c = self.snap.keys.get(key)
        return c.held if c else 0
