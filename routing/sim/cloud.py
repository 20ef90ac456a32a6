"""The simulated cloud replica, :class:`CloudSim`, mirroring ``cloud_engine.scheduler`` one
event per engine step (a run of identical decode steps is one event, cut short when something
arrives that would change the plan): continuous batching, decodes first, then chunked prefill of
running and newly admitted requests under ``max_tokens_per_step``; admission stops at ``slots``
running or when the KV pool (:class:`routing.sim.kv_pool.KvPool`) cannot hold the prompt; a row
that cannot grow preempts the newest running request (recomputed later). Invariant: reused
prefixes are whole blocks, at most ``(prompt - 1) // 16`` of them (as the engine).
"""

from __future__ import annotations

import math

from routing.blocks import BLOCK_SIZE, reusable_blocks
from routing.fleet.state import StepCost
from routing.prefill_budget import chunk_beside_decode
from routing.sim.kv_pool import KvPool
from routing.sim.node import EventSink, SimNode, SimRequest
from routing.sim.profiles import ProfileCost
from routing.step_cost import StepCostFit


class CloudSim(SimNode):
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
