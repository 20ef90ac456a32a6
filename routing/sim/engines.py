"""Simulated engines: one event per engine step (a run of identical decode steps is one event,
cut short when something arrives that would change the plan).

- :class:`EdgeSim` mirrors ``edge_runtime.scheduler``: FCFS admission into ``slots``, but
  for a request that reuses 4+ more blocks held on the node (kept in a free slot, or
  written so far in a busy one) than those ahead of it (``routing.admission``); a new request
  takes the free slot holding most of its leading blocks (its kept KV), else an empty slot,
  else the least recently freed, with a longer run a busy slot holds copied into it (a
  running request offers its prompt's blocks as its prefill writes them, and before each chunk
  a request copies a longer run one wrote since its admission); each loop runs one prefill
  chunk of the oldest request still prefilling (cut beside decoding rows as
  ``routing.prefill_budget`` says, from the node's own EWMAs), then one decode step of every
  decoding row. A slot keeps its request's prompt blocks when it ends (``stored``) and drops
  those a new occupant does not reuse (``removed``), counted per slot.
- :class:`CloudSim` mirrors ``cloud_engine.scheduler``: continuous batching, decodes first, then
  chunked prefill of running and newly admitted requests under ``max_tokens_per_step``;
  admission stops at ``slots`` running or when the KV pool cannot hold the prompt; a row that
  cannot grow preempts the newest running request (recomputed later). :class:`KvPool` keeps
  freed full prompt blocks as an LRU prefix cache.

Invariants:
- ``now`` never moves backwards; a request's ``first_s <= end_s``; ``generated`` ends equal to
  the request's ``output_tokens``.
- Reused prefixes are whole blocks, at most ``(prompt - 1) // 16`` of them (as the engines).
- ``KvPool``: free + cached + held == total at every step boundary (``check``).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from routing.admission import PREFIX_FIRST_WINDOW, prefix_first
from routing.blocks import BLOCK_SIZE, reusable_blocks
from routing.ewma import Ewma
from routing.fleet.state import EngineTraits, StepCost
from routing.prefill_budget import (
    chunk_beside_decode,
    short_chunk_extra_ms,
)
from routing.sim.profiles import ProfileCost
from routing.step_cost import StepCostFit


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request's life in the simulator (times in simulated seconds)."""

    idx: int
    prompt: int
    output: int
    blocks: Sequence[int]  # keys of its full 16-token prompt blocks
    arrival_s: float = 0.0  # at the client
    node_arrival_s: float = 0.0
    cached: int = 0  # prompt tokens reused at the node
    filled: int = 0  # prompt tokens in the KV (cached + prefilled)
    generated: int = 0
    first_s: float = -1.0
    end_s: float = -1.0
    slot: int = -1
    held: int = 0  # cloud: unhashed blocks held
    refs: list[int] = field(default_factory=list)  # cloud: hashed blocks referenced
    preempted: int = 0
    passed: int = 0  # edge: times a later request was admitted before it (prefix_first)
    # compute of its own prompt chunks, as the node reports it (the cloud: its token share of
    # each step that ran them, beyond the decode rows' time)
    prefill_ms: float = 0.0
    payload: object = None  # the simulator's bookkeeping

    @property
    def prefilling(self) -> bool:
        return self.filled < self.prompt


EventSink = Callable[[list[int], list[int]], None]  # stored, removed


class _Node:
    """What both engines share: a wait queue, a clock, counters and the reported EWMAs."""

    device = ""  # as the node reports it (the profile's device, else its name)
    max_context = 0
    prefix_cache = False

    def __init__(self, node_id: str, cost: ProfileCost, slots: int, on_blocks: EventSink) -> None:
        self.id = node_id
        self.cost = cost
        self.slots = slots
        self.on_blocks = on_blocks
        self.waiting: deque[SimRequest] = deque()
        self.now = 0.0
        self.version = 0  # bumps when the pending step event is superseded
        self.busy = False
        # a run of identical decode steps in progress: start, step length, steps
        self.run: tuple[float, float, int] | None = None
        self.prefill_rate = Ewma()  # prompt tokens per second, as the node reports it
        self.decode_rate = Ewma()  # ms per decode step, as the node reports it
        self.served = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.busy_s = 0.0
        self.steps = 0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_rate.value

    @property
    def decode_ms(self) -> float:
        return self.decode_rate.value

    def seed_rates(self, prefill_tps: float, decode_ms: float) -> None:
        """Start the reported rates at these values (a live node's, measured beforehand)."""
        self.prefill_rate = Ewma(value=prefill_tps, n=1)
        self.decode_rate = Ewma(value=decode_ms, n=1)

    def _record_rates(self, prefill_tokens: float, prefill_ms: float, decode_ms: float) -> None:
        if prefill_tokens > 0 and prefill_ms > 0:
            self.prefill_rate.add(1000.0 * prefill_tokens / prefill_ms)
        if decode_ms > 0:
            self.decode_rate.add(decode_ms)

    def warm(self, prompts: Sequence[int], decode_tokens: int) -> None:
        """Seed the reported rates as this node would report them after serving ``prompts``
        one at a time, each alone, followed by ``decode_tokens - 1`` decode steps: what a live
        node warmed that way (``bench/sim_validate.py --warm``) reports before the trace. Only
        the rates change: no cache, counter or clock."""
        for n in prompts:
            self._record_rates(n, self.cost.prefill_ms(n), 0.0)
            for k in range(1, decode_tokens):
                self._record_rates(0, 0.0, self.cost.decode_ms(1, n + k))

    def reported_chunks(self) -> tuple[int, int]:
        """(prefill chunk, chunk beside decoding rows) as the node reports them; 0: unsaid."""
        return 0, 0

    def traits(self) -> EngineTraits:
        """Its engine's traits as the engine it models reports them."""
        chunk, decoding = self.reported_chunks()
        return EngineTraits(
            device=self.device,
            max_batch=self.slots,
            prefix_cache=self.prefix_cache,
            prefill_chunk=chunk,
            prefill_chunk_decoding=decoding,
        )

    def fitted_step_cost(self) -> StepCost | None:
        """The step cost the node fits on its own steps and reports (None: it fits none)."""
        return None

    def _finish(self, r: SimRequest, t: float) -> None:
        r.end_s = t
        self.served += 1
        self.prompt_tokens += r.prompt
        self.cached_tokens += r.cached

    def enqueue(self, r: SimRequest) -> None:
        """``r`` reaches the node and waits behind every request already waiting."""
        self.waiting.append(r)


class EdgeSim(_Node):
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

    def interrupt(self, t: float) -> float | None:
        """An arrival at ``t`` during a run: cut the run at the next step boundary. Returns
        the new end of the run (the time of the next step) or None if nothing changed."""
        if self.run is None:
            return None
        t0, d, k = self.run
        m = min(k, max(1, math.ceil((t - t0) / d - 1e-9)))
        if m >= k:
            return None
        back = k - m
        for r in self._pending_rows:
            r.generated -= back
        self.steps -= back
        self.busy_s -= back * d
        self.run = None
        return t0 + m * d

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


class CloudSim(_Node):
    """A cloud replica: continuous batching with chunked prefill over a finite KV pool."""

    kind = "cloud"

    def __init__(
        self,
        node_id: str,
        cost: ProfileCost,
        slots: int,
        max_tokens_per_step: int,
        kv_blocks: int,
        on_blocks: EventSink,
        prefix_cache: bool = True,
        stall_ratio: float | None = None,
    ) -> None:
        super().__init__(node_id, cost, slots, on_blocks)
        self.budget = max_tokens_per_step
        self.stall_ratio = stall_ratio  # the engine's prefill_stall_ratio (None: off)
        self.pool = KvPool(kv_blocks, on_blocks)
        self.prefix_cache = prefix_cache
        self.order: list[SimRequest] = []
        self._pending_rows: list[SimRequest] = []
        self._pending_pre: list[tuple[SimRequest, int]] = []
        self.step_fit = StepCostFit()  # as the engine: fitted on its steps and reported

    def chunk_beside_decode(self) -> int | None:
        """Prompt tokens a step takes beside decode rows, as the engine cuts them (with its
        fitted step cost once it has one: ``cloud_engine.core.EngineCore``)."""
        if self.stall_ratio is None:
            return None
        fit = self.step_fit.latest
        if fit is not None:
            context = sum(r.prompt + r.generated for r in self.order)
            decode_ms = fit.step_ms(len(self.order), 0, context)
            return chunk_beside_decode(
                self.budget, self.stall_ratio, decode_ms, fit.ms_per_prompt_token
            )
        per_token = 1000.0 / self.prefill_tps if self.prefill_tps > 0 else 0.0
        return chunk_beside_decode(self.budget, self.stall_ratio, self.decode_ms, per_token)

    def fitted_step_cost(self) -> StepCost | None:
        return self.step_fit.latest

    def reported_chunks(self) -> tuple[int, int]:
        # one step's token budget and its prompt tokens beside rows, as the engine reports them
        return self.budget, self.chunk_beside_decode() or 0

    @property
    def running(self) -> int:
        return len(self.order)

    def kv(self) -> tuple[int, int]:
        return self.pool.used, self.pool.total

    def waiting_admissible(self) -> bool:
        if not self.waiting or len(self.order) >= self.slots:
            return False
        r = self.waiting[0]
        return math.ceil(r.prompt / BLOCK_SIZE) <= self.pool.available() + r.cached // BLOCK_SIZE

    def wants_step_on_arrival(self) -> bool:
        return self.waiting_admissible()

    def _blocks_needed(self, r: SimRequest) -> int:
        return math.ceil((r.prompt + 1) / BLOCK_SIZE) - len(r.refs) - r.held

    def _try_admit(self, r: SimRequest, reserve: int = 0) -> bool:
        limit = reusable_blocks(r.prompt)
        hit = self.pool.match(r.blocks, limit) if self.prefix_cache else []
        need = math.ceil((r.prompt + 1) / BLOCK_SIZE) - len(hit)
        if need + reserve > self.pool.available() or not self.pool.alloc(need):
            self.pool.unmatch(hit)
            return False
        r.refs = hit
        r.held = need
        if r.preempted == 0 or r.cached == 0:
            r.cached = len(hit) * BLOCK_SIZE
        r.filled = len(hit) * BLOCK_SIZE
        return True

    def _preempt_newest(self) -> None:
        r = self.order.pop()
        self.pool.release(r)
        r.preempted += 1
        r.filled = 0
        self.waiting.appendleft(r)

    def _grow(self, rows: list[SimRequest], k: int) -> int:
        """Blocks ``rows`` need to decode ``k`` more steps."""
        n = 0
        for r in rows:
            ctx = r.prompt + r.generated
            n += max(0, math.ceil((ctx + k) / BLOCK_SIZE) - len(r.refs) - r.held)
        return n

    def step(self, t: float) -> float | None:
        self.now = t
        cost = self.cost
        while True:
            rows = [r for r in self.order if not r.prefilling and r.generated < r.output]
            if not rows or self._grow(rows, 1) <= self.pool.available():
                break
            self._preempt_newest()
        reserve = self._grow(rows, 1)
        budget = self.budget - len(rows)
        cut = self.chunk_beside_decode() if rows else None
        if cut is not None:
            budget = min(budget, cut)
        pre: list[tuple[SimRequest, int]] = []
        pre_ms = 0.0
        pre_tokens = 0
        for r in self.order:
            if budget <= 0:
                break
            if r.prefilling:
                c = min(budget, r.prompt - r.filled)
                pre.append((r, c))
                budget -= c
        while budget > 0 and self.waiting and len(self.order) < self.slots:
            r = self.waiting[0]
            if not self._try_admit(r, reserve):
                break
            self.waiting.popleft()
            self.order.append(r)
            c = min(budget, r.prompt - r.filled)
            if c <= 0:  # everything but the last token cached: one token to compute
                c = 1
                r.filled = r.prompt - 1
            pre.append((r, c))
            budget -= c
        if not self.order:
            return None
        for r, c in pre:
            pre_ms += cost.chunk_ms(r.filled, c)
            pre_tokens += c
        k = 1
        dec = 0.0
        if rows:
            if not pre and not self.waiting_admissible():
                k = min(r.output - r.generated for r in rows)
                avail = self.pool.available()
                if self._grow(rows, k) > avail:
                    lo, hi = 1, k
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        if self._grow(rows, mid) <= avail:
                            lo = mid
                        else:
                            hi = mid - 1
                    k = lo
            ctx = sum(r.prompt + r.generated for r in rows) / len(rows) + 0.5 * k
            dec = cost.decode_ms(len(rows), ctx)
        step_ms = cost.overhead_ms + pre_ms + dec
        if pre_tokens:
            beside = cost.overhead_ms + dec if rows else 0.0
            for r, c in pre:
                r.prefill_ms += (step_ms - beside) * c / pre_tokens
        self.run = (t, step_ms / 1000.0, k) if k > 1 else None
        # the KV its steps read: each row's context (its middle step's, for a run of k)
        context = sum(r.prompt + r.generated for r in rows) + len(rows) * (k - 1) / 2.0
        context += sum(r.filled + c for r, c in pre)
        self.step_fit.add(len(rows), pre_tokens, int(context), step_ms, t + k * step_ms / 1000.0)
        for r in rows:
            r.generated += k
            need = math.ceil((r.prompt + r.generated) / BLOCK_SIZE) - len(r.refs) - r.held
            if need > 0:
                self.pool.alloc(need)
                r.held += need
        self._record_rates(pre_tokens, pre_ms, dec)
        self._pending_rows = rows
        self._pending_pre = pre
        self.steps += k
        dt = k * step_ms / 1000.0
        self.busy_s += dt
        return t + dt

    def interrupt(self, t: float) -> float | None:
        if self.run is None:
            return None
        t0, d, k = self.run
        m = min(k, max(1, math.ceil((t - t0) / d - 1e-9)))
        if m >= k:
            return None
        back = k - m
        for r in self._pending_rows:
            r.generated -= back  # blocks taken for the undone steps stay held (harmless)
        self.steps -= back
        self.busy_s -= back * d
        self.run = None
        return t0 + m * d

    def end_step(self, t: float, finished: list[SimRequest]) -> None:
        self.now = t
        self.run = None
        for r, c in self._pending_pre:
            r.filled += c
            if not r.prefilling:
                if self.prefix_cache:
                    self.pool.publish(r, r.blocks[len(r.refs) : reusable_blocks(r.prompt + 1)])
                if r.first_s < 0:
                    r.first_s = t
                    r.generated = max(r.generated, 1)
        self._pending_pre = []
        keep = []
        for r in self.order:
            if not r.prefilling and r.generated >= r.output:
                self.pool.release(r)
                self._finish(r, t)
                finished.append(r)
            else:
                keep.append(r)
        self.order = keep
