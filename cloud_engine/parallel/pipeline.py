"""The batch queue: as many batches in flight as there are pipeline stages.

:class:`PipelineCore` is :class:`cloud_engine.core.EngineCore` whose ``step`` first fills the
queue (plans and launches batches while fewer than ``depth`` are in flight and the scheduler
has something that is not in flight), then collects the oldest batch. Each batch takes at most ``ceil((running + waiting) / depth)``
sequences, so the running set splits into one batch per stage. So while stage 1 runs
batch A, the driver plans batch B and runs its stage 0: every stage works at once once the
load fills two batches.

Invariants: a sequence is in at most one in-flight batch (``Sequence.in_flight``; the
scheduler skips and never preempts such sequences); batches are collected in launch order; a
sequence aborted while in flight is dropped from its batch's results (as a look-ahead step's).
"""

from __future__ import annotations

import time
from collections import deque

from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.inflight import Launch, live
from cloud_engine.outputs import SeqOutput
from cloud_engine.runner import ModelRunner


class PipelineCore(EngineCore):
    def __init__(
        self, model, identity: str, config: EngineConfig, runner: ModelRunner, depth: int
    ) -> None:  # type: ignore[no-untyped-def]
        super().__init__(model, identity, config, runner)
        self.depth = depth
        self._queue: deque[Launch] = deque()
        self.max_in_flight = 0  # the most batches ever in flight at once

    def has_work(self) -> bool:
        return super().has_work() or bool(self._queue)

    @property
    def in_flight(self) -> int:
        return len(self._queue)

    def _step(self) -> list[SeqOutput]:
        if self.config.debug_checks:
            self.blocks.check_integrity()
        while len(self._queue) < self.depth:
            sched = self.scheduler
            share = -(-(sched.num_running + sched.num_waiting) // self.depth)
            sched.prefill_beside_decode = self.chunk_beside_decode()
            batch = sched.schedule(max_seqs=max(1, share))
            for seq in batch.preempted:
                self.runner.release(seq)
                self.counters.preemptions += 1
            if not batch.items:
                break
            for it in batch.items:
                it.seq.in_flight = True
            t0 = time.perf_counter()
            self._queue.append(Launch(batch, self.runner.launch(batch), t0))
            self.max_in_flight = max(self.max_in_flight, len(self._queue))
        if not self._queue:
            return []
        cur = self._queue.popleft()
        sampled = cur.launched.read()
        for it in cur.batch.items:
            it.seq.in_flight = False
        now = time.perf_counter()
        dt = now - max(cur.t0, self._last_collect)
        self._last_collect = now
        batch, sampled, _ = live(cur.batch, sampled)  # no logprobs: none are computed here
        outputs = self._commit(batch, sampled)
        self._account(batch, dt)
        if self.config.debug_checks:
            self.blocks.check_integrity()
        return outputs

    def drain(self) -> None:
        """Read every in-flight batch's result and drop it (before stopping the ranks: no
        result may still be on its way to the driver when the stop messages are exchanged)."""
        while self._queue:
            cur = self._queue.popleft()
            cur.launched.read()
            for it in cur.batch.items:
                it.seq.in_flight = False
