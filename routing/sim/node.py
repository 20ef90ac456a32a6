"""What both simulated engines share: :class:`SimRequest` (one request's life, in simulated
seconds), the ``EventSink`` a node reports stored and removed prefix blocks to, and
:class:`SimNode` (a wait queue, a clock, counters and the prefill and decode EWMAs the node
reports). Invariants: ``now`` never moves backwards; a request's ``first_s <= end_s`` and its
``generated`` ends equal to its ``output``; a node's reported rates change only through the
steps it runs (or ``seed_rates`` / ``warm`` before the trace).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from routing.ewma import Ewma
from routing.fleet.state import EngineTraits, StepCost
from routing.sim.profiles import ProfileCost


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


class SimNode:
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
        self._pending_rows: list[SimRequest] = []  # the decode rows of the run in progress
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

    def interrupt(self, t: float) -> float | None:
        """An arrival at ``t`` during a run: cut the run at the next step boundary, undoing the
        steps after it for the run's rows (``_pending_rows``; blocks a cloud row took for them
        stay held, harmlessly). Returns the new end of the run (the time of the next step) or
        None if nothing changed."""
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

    def _finish(self, r: SimRequest, t: float) -> None:
        r.end_s = t
        self.served += 1
        self.prompt_tokens += r.prompt
        self.cached_tokens += r.cached

    def enqueue(self, r: SimRequest) -> None:
        """``r`` reaches the node and waits behind every request already waiting."""
        self.waiting.append(r)
