"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

One :meth:`Scheduler.schedule` call plans one forward pass under a token budget:

1. Running sequences, most important first (priority, then arrival): each gets its remaining
   tokens (one for a decode, the next chunk for a prompt being prefilled), capped by the budget.
   When the pool cannot hold a sequence's next tokens, the least important running sequence
   (the newest of the lowest priority) is preempted: its blocks are released (full ones stay in
   the prefix cache), its output so far is kept, and it goes back to the waiting queue to be
   recomputed.
2. If nothing was preempted, waiting sequences in (priority, arrival) order are admitted while
   the budget, ``max_running`` and the pool allow: each reuses every leading block found in the
   prefix cache and prefills (a chunk of) the rest. The first sequence that does not fit stops
   admission (no overtaking), so the queue order is honoured. A choice of an ``n > 1`` request
   waits until its leader (the first choice) has computed the prompt, then reuses its blocks;
   a sequence that asks for prompt logprobs reuses none (it needs every position's logits).

While any running sequence decodes, the prompt tokens of a batch (chunks of running prompts
and admissions) are capped at ``prefill_beside_decode`` when the engine sets it (the stall
ratio of ``routing.prefill_budget``): each decode row then waits at most that chunk's time
between two of its tokens, whatever arrives. A prompt the cap leaves out waits for the next
step; it never blocks the decode rows behind it.

Invariants: a sequence appears at most once in a batch, and never in a batch while it is
``in_flight`` in an earlier one (pipeline parallelism keeps several batches in flight); after ``schedule`` every scheduled
sequence owns blocks for ``num_computed + num_new`` tokens; a batch never exceeds
``max_tokens_per_step`` tokens or ``max_running`` sequences.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from cloud_engine.block_manager import BlockManager
from cloud_engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running: int = 64
    max_tokens_per_step: int = 2048
    max_waiting: int = 1024
    watermark_blocks: int = 0  # admission leaves this many blocks for running sequences to grow


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens to compute: token_ids[start : start + num_new]
    start: int  # seq.num_computed when scheduled (absolute position of the first new token)
    samples: bool  # the chunk reaches the end of the known tokens: its last logits sample


@dataclass(slots=True)
class ScheduledBatch:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(it.num_new for it in self.items)

    @property
    def is_decode_only(self) -> bool:
        return all(it.num_new == 1 and it.samples for it in self.items)

    def __len__(self) -> int:
        return len(self.items)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.bs = blocks.block_size
        self.running: list[Sequence] = []
        self._waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap; lazy deletion
        self._num_waiting = 0
        self.prefill_beside_decode: int | None = None  # set by the engine before each step

    # -- queue -----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.sort_key, seq))
        self._num_waiting += 1

    def _peek_waiting(self) -> Sequence | None:
        while self._waiting and self._waiting[0][1].status is not SeqStatus.WAITING:
            heapq.heappop(self._waiting)  # aborted while waiting
        return self._waiting[0][1] if self._waiting else None

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out of the engine (finished or aborted) and release its blocks at once."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self._num_waiting -= 1
        self._free(seq)
        seq.status = SeqStatus.FINISHED

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        return -(-(seq.num_computed + num_new) // self.bs) - len(seq.block_table)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.preemptions += 1
        self.add(seq)

    # -- planning --------------------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None) -> ScheduledBatch:
        """``max_seqs``: at most this many sequences in the batch (pipeline parallelism splits
        the running set into one batch per stage)."""
        cfg = self.config
        cap = max_seqs if max_seqs is not None else cfg.max_running
        batch = ScheduledBatch()
        budget = cfg.max_tokens_per_step
        # A sequence in a batch still in the pipe is neither planned again nor preempted.
        queue = sorted((s for s in self.running if not s.in_flight), key=lambda s: s.sort_key)
        prompt_budget = budget
        cut = self.prefill_beside_decode
        if cut is not None and any(s.num_tokens - s.num_computed == 1 for s in queue):
            prompt_budget = min(budget, max(1, cut))
        i = 0
        while i < len(queue) and budget > 0 and len(batch.items) < cap:
            seq = queue[i]
            left = seq.num_tokens - seq.num_computed
            n = min(left, budget) if left == 1 else min(left, budget, prompt_budget)
            if n <= 0:  # a prompt beyond this step's prompt tokens: the next step
                i += 1
                continue
            need = self._blocks_needed(seq, n)
            while need > self.blocks.num_available:
                victim = queue.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            if need > 0:
                seq.block_table.extend(self.blocks.allocate(need))
            batch.items.append(
                ScheduledSeq(seq, n, seq.num_computed, seq.num_computed + n == seq.num_tokens)
            )
            budget -= n
            if left > 1:
                prompt_budget -= n
            i += 1
        if batch.preempted:
            return batch
        while (
            min(budget, prompt_budget) > 0
            and len(self.running) < cfg.max_running
            and len(batch.items) < cap
        ):
            seq = self._peek_waiting()
            if seq is None or not self._admit(seq, min(budget, prompt_budget), batch):
                break
            budget -= batch.items[-1].num_new
            prompt_budget -= batch.items[-1].num_new
        return batch

    def _admit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> bool:
        if seq.waits_for_leader:  # another choice computes the prompt; its blocks come next
            return False
        # Reuse leading cached blocks, but always leave at least one token to compute: its
        # logits give the next token. Prompt logprobs need every prompt position's logits.
        usable = 0 if seq.needs_prompt_logprobs else (seq.num_tokens - 1) // self.bs
        matched = self.blocks.match_prefix(seq.hashes[:usable], seq.token_ids)
        cached = len(matched) * self.bs
        n = min(seq.num_tokens - cached, budget)
        need = -(-(cached + n) // self.bs) - len(matched)
        # The watermark keeps room for running sequences to grow; with none running it would
        # only stop a request that needs the whole pool from ever starting.
        reserve = self.config.watermark_blocks if self.running else 0
        if not self.blocks.can_allocate(need, matched, reserve=reserve):
            return False
        self.blocks.acquire(matched)
        seq.block_table = matched + self.blocks.allocate(need)
        seq.num_computed = cached
        seq.num_registered = len(matched)
        if seq.num_cached < 0:
            seq.num_cached = min(cached, seq.num_prompt)
        heapq.heappop(self._waiting)
        self._num_waiting -= 1
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        batch.items.append(ScheduledSeq(seq, n, cached, cached + n == seq.num_tokens))
        return True

    def commit(self, item: ScheduledSeq) -> None:
        """After the forward pass: the chunk's KV is written; publish newly full blocks."""
        seq = item.seq
        seq.num_computed = item.start + item.num_new
        full = min(seq.num_computed // self.bs, len(seq.hashes))
        for i in range(seq.num_registered, full):
            toks = seq.token_ids[i * self.bs : (i + 1) * self.bs]
            self.blocks.register(seq.block_table[i], seq.hashes[i], toks)
        seq.num_registered = max(seq.num_registered, full)
