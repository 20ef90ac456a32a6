"""The simulated edge node, :class:`EdgeSim`, mirroring ``edge_runtime.scheduler`` one event
per engine step (a run of identical decode steps is one event, cut short when something arrives
that would change the plan): FCFS admission into ``slots``, but for a request that reuses 4+
more blocks held on the node (kept in a free slot, or written so far in a busy one) than those
ahead of it (``routing.admission``); a new request takes the free slot holding most of its
leading blocks (its kept KV), else an empty slot, else the least recently freed, with a longer
run a busy slot holds copied into it (a running request offers its prompt's blocks as its
prefill writes them, and before each chunk a request copies a longer run one wrote since its
admission); each loop runs one prefill chunk of the oldest request still prefilling (cut beside
decoding rows as ``routing.prefill_budget`` says, from the node's own EWMAs), then one decode
step of every decoding row. A slot keeps its request's prompt blocks when it ends (``stored``)
and drops those a new occupant does not reuse (``removed``), counted per slot. Invariant:
reused prefixes are whole blocks, at most ``(prompt - 1) // 16`` of them (as the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from routing.admission import PREFIX_FIRST_WINDOW, prefix_first
from routing.blocks import BLOCK_SIZE, reusable_blocks
from routing.fleet.state import EngineTraits
from routing.prefill_budget import (
    chunk_beside_decode,
    short_chunk_extra_ms,
)
from routing.sim.node import EventSink, SimNode, SimRequest
from routing.sim.profiles import ProfileCost


class EdgeSim(SimNode):
    """An edge node: slots with kept KV (see the module docstring)."""

    kind = "edge"

    def __init__(
        self,
        node_id: str,
        cost: ProfileCost,
        slots: int,
        chunk_tokens: int,
        on_blocks: EventSink,
        prefix_cache: bool = True,
        stall_ratio: float | None = 1.0,
        prefix_first: int = 4,
    ) -> None:
        super().__init__(node_id, cost, slots, on_blocks)
        self.chunk = chunk_tokens
        self.prefix_first = prefix_first
        self.stall_ratio = stall_ratio
        self.prefix_cache = prefix_cache
        self.occupant: list[SimRequest | None] = [None] * slots
        self.kept: list[Sequence[int]] = [()] * slots  # block keys each slot's KV holds
        self.freed_at: list[int] = [0] * slots
        # leading kept blocks two requests used, which the last free slot to go keeps (the
        # edge's --slot-order shared, its default: ``SlotCache.choose``)
        self.shared: list[int] = [0] * slots
        self._clock = 0
        self._count: dict[int, int] = {}
        self.order: list[SimRequest] = []  # running, in admission order

    @property
    def running(self) -> int:
        return len(self.order)

    def kv(self) -> tuple[int, int]:
        return 0, 0

    def _prefill_ms_per_token(self) -> float:
        return 1000.0 / self.prefill_tps if self.prefill_tps > 0 else 0.0

    def chunk_beside_decode(self) -> int:
        return chunk_beside_decode(
            self.chunk, self.stall_ratio, self.decode_ms, self._prefill_ms_per_token()
        )

    def reported_chunks(self) -> tuple[int, int]:
        return self.chunk, self.chunk_beside_decode()

    def traits(self) -> EngineTraits:
        traits = super().traits()
        traits.prefix_catch_up = self.prefix_cache
        traits.prefix_in_slots = self.prefix_cache
        return traits

    def wants_step_on_arrival(self) -> bool:
        return len(self.order) < self.slots

    def _drop(self, keys: Sequence[int], removed: list[int]) -> None:
        c = self._count
        for k in keys:
            n = c.get(k, 0) - 1
            if n <= 0:
                c.pop(k, None)
                removed.append(k)
            else:
                c[k] = n

    def _keep(self, keys: Sequence[int], stored: list[int]) -> None:
        c = self._count
        for k in keys:
            n = c.get(k, 0)
            if n == 0:
                stored.append(k)
            c[k] = n + 1

    @staticmethod
    def _leading(kept: Sequence[int], blocks: Sequence[int], limit: int) -> int:
        n = 0
        for a, b in zip(kept, blocks, strict=False):
            if a != b or n >= limit:
                break
            n += 1
        return n

    def _next_waiting(self) -> SimRequest:
        """Take the waiting request to admit next, as ``edge_runtime.scheduler`` does."""
        if not self.prefix_cache or self.prefix_first == 0 or len(self.waiting) == 1:
            return self.waiting.popleft()
        reuse = (  # kept in a free slot or written so far in a busy one (admission copies it)
            (
                max(self._leading(kept, r.blocks, reusable_blocks(r.prompt)) for kept in self.kept),
                r.passed,
            )
            for r in islice(self.waiting, PREFIX_FIRST_WINDOW)
        )
        best = prefix_first(reuse, self.prefix_first)
        if best == 0:
            return self.waiting.popleft()
        for r in islice(self.waiting, best):
            r.passed += 1
        chosen = self.waiting[best]
        del self.waiting[best]
        return chosen

    def _admit(self) -> None:
        removed: list[int] = []
        stored: list[int] = []
        while self.waiting and len(self.order) < self.slots:
            free = [i for i, o in enumerate(self.occupant) if o is None]
            r = self._next_waiting()
            best, best_n = -1, 0
            limit = reusable_blocks(r.prompt)
            if self.prefix_cache:
                for i in free:
                    n = self._leading(self.kept[i], r.blocks, limit)
                    if n > best_n:
                        best, best_n = i, n
            if best < 0:
                # nothing shared to lose, then an empty slot (the lowest), then the least
                # recently freed
                best = min(
                    free,
                    key=lambda i: (
                        self.shared[i] > 0,
                        bool(self.kept[i]),
                        self.freed_at[i] if self.kept[i] else i,
                    ),
                )
                best_n = 0
            kept = self.kept[best]
            if len(kept) > best_n:
                self._drop(kept[best_n:], removed)
            self.kept[best] = kept[:best_n]
            self.shared[best] = best_n
            if self.prefix_cache:  # a longer run in a busy slot is copied into this one
                best_n = self._copy_longest(r.blocks, best, best_n, limit, stored, False)
            self.occupant[best] = r
            r.slot = best
            r.cached = r.filled = best_n * BLOCK_SIZE
            self.order.append(r)
        if removed or stored:
            self.on_blocks(stored, removed)

    def step(self, t: float) -> float | None:
        """Run one loop (or a run of identical decode steps) from ``t``; returns when it ends,
        or None when there is nothing to do."""
        self.now = t
        self._admit()
        if not self.order:
            return None
        cost = self.cost
        dt = cost.overhead_ms
        pre = next((r for r in self.order if r.prefilling), None)
        pre_tokens = pre_ms = 0.0
        finished_prefill = False
        if pre is not None:
            decoding = any(not r.prefilling and r.generated < r.output for r in self.order)
            if self.prefix_cache:  # as the edge: another slot's longer run copied first
                self._catch_up(pre)
            size = self.chunk_beside_decode() if decoding else self.chunk
            c = min(size, pre.prompt - pre.filled)
            pre_ms = cost.chunk_ms(pre.filled, c)
            if pre.filled > pre.cached:  # a later chunk, its own run: dearer when short
                pre_ms += short_chunk_extra_ms(size, self.chunk, cost.decode_ms(1, pre.filled))
            pre.prefill_ms += pre_ms
            dt += pre_ms
            pre_tokens = c
            pre.filled += c
            if self.prefix_cache:  # its prompt's blocks written so far: offered to copy
                self._grow(pre)
            finished_prefill = not pre.prefilling
        rows = [r for r in self.order if not r.prefilling and r.generated < r.output]
        if pre is not None and finished_prefill:
            pre.first_s = t + dt / 1000.0
            pre.generated = 1
            if pre.generated >= pre.output:
                rows = [r for r in rows if r is not pre]
        k = 1
        dec = 0.0
        if rows:
            if pre is None and not self.waiting_admissible():
                k = min(r.output - r.generated for r in rows)
            ctx = sum(r.prompt + r.generated for r in rows) / len(rows) + 0.5 * k
            dec = cost.decode_ms(len(rows), ctx)
            dt += k * dec
        if pre is None and k > 1:
            self.run = (t, (cost.overhead_ms + dec) / 1000.0, k)
            dt = k * (cost.overhead_ms + dec)
        else:
            self.run = None
        for r in rows:
            r.generated += k
        self._record_rates(pre_tokens, pre_ms, dec)
        self.steps += k
        end = t + dt / 1000.0
        self.busy_s += dt / 1000.0
        self._pending_rows = rows
        self._pending_pre = pre
        return end

    def _grow(self, r: SimRequest) -> None:
        kept = self.kept[r.slot]
        n = min(r.filled // BLOCK_SIZE, len(r.blocks))
        if n > len(kept):
            stored: list[int] = []
            self._keep(r.blocks[len(kept) : n], stored)
            self.kept[r.slot] = list(r.blocks[:n])
            if stored:
                self.on_blocks(stored, [])

    def _copy_longest(
        self,
        blocks: Sequence[int],
        slot: int,
        have: int,
        limit: int,
        stored: list[int],
        free_too: bool,
    ) -> int:
        """The busy slot (or, ``free_too``, any slot) holding the longest run of ``blocks``
        beyond the ``have`` that ``slot`` holds has it copied into ``slot``, as
        ``SlotCache.best_source`` and ``adopt`` do; returns the blocks ``slot`` now holds."""
        for i, o in enumerate(self.occupant):
            if i != slot and (o is not None or free_too) and len(self.kept[i]) > have:
                n = self._leading(self.kept[i], blocks, limit)
                if n > have:
                    self._keep(self.kept[i][len(self.kept[slot]) : n], stored)
                    self.kept[slot] = list(self.kept[i][:n])
                    self.shared[slot] = n
                    self.shared[i] = max(self.shared[i], n)
                    have = n
        return have

    def _catch_up(self, r: SimRequest) -> None:
        """Before ``r``'s chunk: a longer run of its leading blocks another slot (busy or free)
        holds than it has filled is copied into its slot and counts as cached (the edge's
        catch-up)."""
        stored: list[int] = []
        have = self._copy_longest(
            r.blocks, r.slot, r.filled // BLOCK_SIZE, reusable_blocks(r.prompt), stored, True
        )
        if have * BLOCK_SIZE > r.filled:
            r.cached += have * BLOCK_SIZE - r.filled
            r.filled = have * BLOCK_SIZE
        if stored:
            self.on_blocks(stored, [])

    def waiting_admissible(self) -> bool:
        return bool(self.waiting) and len(self.order) < self.slots

    def end_step(self, t: float, finished: list[SimRequest]) -> None:
        """The step (or run) that ended at ``t``: settle finished requests."""
        self.now = t
        self.run = None
        stored: list[int] = []
        keep = []
        for r in self.order:
            if r.first_s < 0 and not r.prefilling:
                r.first_s = t
            if not r.prefilling and r.generated >= r.output:
                self._finish(r, t)
                finished.append(r)
                i = r.slot
                self.occupant[i] = None
                if self.prefix_cache:
                    full = list(r.blocks[: reusable_blocks(r.prompt + 1)])
                    have = len(self.kept[i])
                    self.kept[i] = full
                    self._keep(full[have:], stored)
                self._clock += 1
                self.freed_at[i] = self._clock
            else:
                keep.append(r)
        self.order = keep
        if stored:
            self.on_blocks(stored, [])
