"""Requests waiting at a gateway for one of the fleet's slots, admitted by weighted fair
share across keys and by priority within a key (as llm-d's flow control orders by priority
band, then fairness across tenants, then order within a flow; here the priority is a key's
own, so no key can jump another's share with it).

Invariants:
- :meth:`FairQueue.acquire` returns an :class:`Admission` (one slot, given back exactly once
  by :meth:`Admission.release`) or raises a 429 (``queue_full`` at once, ``queue_timeout``
  after ``queue_timeout_s``); a caller cancelled while waiting (its client left) takes no
  slot and leaves no waiting mark behind, even when a slot was granted at that instant.
- Within a key, higher ``priority`` first, then arrival order; a request never passes an
  earlier one of its key with the same or higher priority.
- Across keys (this gateway's waiters), the most under-served key (fewest slots it holds
  here per unit of weight) tries first; whether it may take the slot is the fleet-wide rule
  (:func:`gateway.fair_share.verdict`), so order across gateways is each gateway's own while
  counts and shares are fleet-wide.
- A request that finds no one of its key waiting here tries at once (one count call); it
  waits only when its key's limit, its team's, its fair share or the fleet's slots say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from dataclasses import dataclass, field

from gateway.errors import too_many_requests
from gateway.fair_config import FairShareConfig
from gateway.fair_counts import Answer, FairCounts
from gateway.fair_share import KeyCount, Snapshot, Tenant, Verdict, fair_order

_EWMA = 0.2
_MAX_TRACKED = 10_000


@dataclass(slots=True, eq=False)
class Admission:
    """One slot held for one request: :meth:`release` gives it back (once; later calls do
    nothing). ``waited_ms``: how long the request waited for it."""

    queue: FairQueue
    tenant: Tenant
    answer: Answer
    waited_ms: float
    at: float = field(default_factory=time.monotonic)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.queue._released(self)


@dataclass(slots=True, eq=False)
class _Waiter:
    tenant: Tenant
    future: asyncio.Future[Admission]
    registered: bool
    since: float


class FairQueue:
    """See the module's docstring. ``capacity``: the fleet's slots, set from each fleet view
    (:meth:`observe_capacity`) unless ``config.fleet_slots`` fixes it."""

    def __init__(self, counts: FairCounts, config: FairShareConfig) -> None:
        self.counts = counts
        self.config = config
        self.capacity = config.fleet_slots or 1
        self._heaps: dict[str, list[tuple[int, int, _Waiter]]] = {}
        self._seq = itertools.count()
        self._held: dict[str, int] = {}  # key -> slots held by this gateway's requests
        self._hold_ms: dict[str, float] = {}  # key -> EWMA of how long its slots are held
        self._wake = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None
        self.admitted_total = 0
        self.queued_total = 0
        self.timeouts_total = 0

    # ---- capacity -------------------------------------------------------------------------------
    def observe_capacity(self, slots: int) -> None:
        """The fleet's slots as its latest view says (ignored when configured)."""
        if self.config.fleet_slots is None:
            self.capacity = max(1, int(slots))

    # ---- acquiring ------------------------------------------------------------------------------
    def waiting(self, key: str | None = None) -> int:
        if key is not None:
            return len(self._heaps.get(key, ()))
        return sum(len(h) for h in self._heaps.values())

    async def acquire(self, t: Tenant, priority: int = 0) -> Admission:
        """A slot for ``t``'s request (see the module's invariants)."""
        t0 = time.monotonic()
        registered = False
        if not self._heaps.get(t.key):
            ans = await self.counts.try_acquire(t, self.capacity, False)
            if ans.verdict is Verdict.ADMIT:
                return self._admitted(t, ans, t0)
            registered = ans.verdict is Verdict.FLEET
        elif self.waiting(t.key) >= self.config.max_queued_per_key:
            raise too_many_requests(
                f"this key already has {self.config.max_queued_per_key} requests waiting "
                "for a slot",
                1.0,
            )
        else:
            ans = Answer(Verdict.OWN_LIMIT, 0, 1)
        fut: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        w = _Waiter(t, fut, registered, t0)
        heapq.heappush(self._heaps.setdefault(t.key, []), (-priority, next(self._seq), w))
        self.queued_total += 1
        self._ensure_pump()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.config.queue_timeout_s)
        except TimeoutError:
            self.timeouts_total += 1
            self._abandon(w, ans)
            raise too_many_requests(
                f"no slot came free for this key within {self.config.queue_timeout_s:g} s",
                1.0,
            ) from None
        except BaseException:
            self._abandon(w, ans)
            raise

    def _abandon(self, w: _Waiter, ans: Answer) -> None:
        """``w`` stops waiting without using a slot: out of its heap, its mark or its slot
        given back."""
        heap = self._heaps.get(w.tenant.key)
        if heap is not None:
            kept = [e for e in heap if e[2] is not w]
            if len(kept) != len(heap):
                heapq.heapify(kept)
                if kept:
                    self._heaps[w.tenant.key] = kept
                else:
                    del self._heaps[w.tenant.key]
        if w.future.done() and not w.future.cancelled():
            w.future.result().release()  # granted at the instant it gave up
        else:
            w.future.cancel()
            if w.registered:
                self.counts.leave(w.tenant, ans)

    def _admitted(self, t: Tenant, ans: Answer, t0: float) -> Admission:
        self._held[t.key] = self._held.get(t.key, 0) + 1
        self.admitted_total += 1
        return Admission(self, t, ans, (time.monotonic() - t0) * 1000)

    def _released(self, a: Admission) -> None:
        key = a.tenant.key
        n = self._held.get(key, 0) - 1
        if n > 0:
            self._held[key] = n
        else:
            self._held.pop(key, None)
        held_ms = (time.monotonic() - a.at) * 1000
        if len(self._hold_ms) >= _MAX_TRACKED and key not in self._hold_ms:
            self._hold_ms.clear()
        prev = self._hold_ms.get(key)
        self._hold_ms[key] = held_ms if prev is None else prev + _EWMA * (held_ms - prev)
        self.counts.release(a.tenant, a.answer)
        self._wake.set()

    # ---- the pump: heads of the keys' queues try again ------------------------------------------
    def _ensure_pump(self) -> None:
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        """While any request waits: its key's head tries for a slot, keys in fair order,
        after every release here and every ``poll_s`` (a slot freed elsewhere)."""
        while self._heaps:
            self._wake.clear()
            if not await self._try_heads():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.poll_s)

    def _local_snapshot(self) -> Snapshot:
        return Snapshot(
            {
                k: KeyCount(held=self._held.get(k, 0), weight=self._heaps[k][0][2].tenant.weight)
                for k in self._heaps
            }
        )

    async def _try_heads(self) -> bool:
        """One round over the keys with waiters; True when any was admitted."""
        progressed = False
        for key in fair_order(self._local_snapshot(), list(self._heaps)):
            heap = self._heaps.get(key)
            if not heap:
                continue
            w = heap[0][2]
            if w.future.done():  # abandoned meanwhile
                continue
            ans = await self.counts.try_acquire(w.tenant, self.capacity, w.registered)
            if w.future.done():  # it gave up during the call: undo what the call did
                if ans.verdict is Verdict.ADMIT:
                    self.counts.release(w.tenant, ans)
                elif ans.verdict is Verdict.FLEET and not w.registered:
                    self.counts.leave(w.tenant, ans)
                continue
            if ans.verdict is Verdict.ADMIT:
                heapq.heappop(heap)
                if not heap:
                    del self._heaps[key]
                w.future.set_result(self._admitted(w.tenant, ans, w.since))
                progressed = True
            else:
                w.registered = ans.verdict is Verdict.FLEET
        return progressed

    # ---- what the latency model reads ----------------------------------------------------------
    async def expected_wait_ms(self, t: Tenant, service_ms: float) -> tuple[float, int]:
        """How long a request of ``t`` sent now would wait for a slot, and how many of its
        key's requests (it included) would wait: 0 when it would be admitted at once; else
        those requests times how long its key holds a slot (measured here; ``service_ms``,
        the router's predicted time on its node, until measured), over the slots its key may
        hold at once. Changes no count."""
        local = self.waiting(t.key)
        if local == 0:
            ans = await self.counts.try_acquire(t, self.capacity, False, peek=True)
            if ans.verdict is Verdict.ADMIT:
                return 0.0, 0
            ahead, allowed = max(ans.waiting, 1), ans.allowed
        else:
            ans = await self.counts.try_acquire(t, self.capacity, False, peek=True)
            ahead, allowed = max(ans.waiting, local + 1), ans.allowed
        hold = self._hold_ms.get(t.key, service_ms)
        return ahead * hold / max(1, allowed), ahead

    def health(self) -> dict[str, object]:
        return {
            "capacity": self.capacity,
            "held_here": sum(self._held.values()),
            "waiting_here": self.waiting(),
            "admitted_total": self.admitted_total,
            "queued_total": self.queued_total,
            "timeouts_total": self.timeouts_total,
            "counts": self.counts.health(),
        }

    async def close(self) -> None:
        if self._pump_task is not None:
            self._pump_task.cancel()
        await self.counts.close()
