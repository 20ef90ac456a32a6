"""The slot scheduler: the blocking generation loop of the edge engine, in its own thread.

Like llama.cpp's server slots: a fixed number of slots, each holding one sequence's KV cache.
Requests wait in a bounded queue (priority, then arrival order) until a slot is free. Each loop
iteration runs at most one prefill chunk (of the oldest request still prefilling) and then
decode steps that advance every decoding slot by one token in a single batched run: one step
while a prompt is still prefilling, and otherwise as many as run before anything changes which
requests run or wait (the plan of rows is kept; only tokens and lengths move between steps).
While any slot decodes, a chunk is cut to ``stall_ratio`` decode steps' worth of prompt tokens
(``routing.prefill_budget``): a later prompt slows the answers already decoding by a bounded
factor instead of holding each of their tokens for a whole 256-token chunk. A chunk is never
shorter than one 16-token block.

Invariants:
- All bookkeeping (slots, queue, request state) changes under ``lock``; ONNX runs happen outside
  it. A slot is handed to a new request only at the top of an iteration, so a run in flight
  never shares a slot with a newer request.
- ``cancel`` frees the slot at once (the running count drops before it returns); a step that
  was in flight for that request is discarded when it completes.
- Every submitted request gets exactly one event with ``finish_reason`` set (ABORT if cancelled
  or the engine stops), except that ``cancel(..., notify=False)`` sends none (the caller left).
- A stop token id ends a request with STOP and is not emitted; ``completion_tokens`` counts the
  emitted tokens.
- Tokens reach the consumer in order, none twice, none lost, each in an event of its own as
  soon as it is sampled (the last with the final event).
- Prefix reuse (with a ``SlotCache``): a request that ends (finished or cancelled) leaves its
  KV in its slot; which waiting request is admitted next, into which slot and with which
  copied prefix, is ``edge_runtime.admission``'s choice. Copies run after the lock is released
  and before anything else runs on the loop thread. A decode step's dummy row of a free slot
  writes at that slot's kept length, never inside its kept KV.
- Logprobs (``edge_runtime.logprobs``) come from the very logits a token was sampled from, for
  the requests that ask; a request that asks for prompt logprobs computes its whole prompt
  (every position's logits), reusing no kept or copied KV.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from edge_runtime.admission import Admission, Copy
from edge_runtime.decoder import Decoder
from edge_runtime.logprobs import next_token_logprobs, token_logprob
from edge_runtime.slot_cache import SlotCache
from edge_runtime.slot_request import SlotRequest
from routing.blocks import BLOCK_SIZE
from routing.engine import FinishReason, QueueFull, TokenLogprob
from routing.ewma import Ewma
from routing.prefill_budget import chunk_beside_decode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerSnapshot:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefill_tokens_per_s: float
    decode_ms_per_step: float
    soonest_free_tokens: int  # fewest tokens any running request may still generate
    prefix_hit_rate: float = 0.0  # cached prompt tokens / prompt tokens of admitted requests
    prefill_chunk: int = 0  # prompt tokens per chunk with nothing decoding
    prefill_chunk_decoding: int = 0  # the chunk the measured rates give while rows decode


class SlotScheduler:
    def __init__(
        self,
        decoder: Decoder,
        max_waiting: int = 16,
        prefill_chunk: int = 256,
        cache: SlotCache | None = None,
        stall_ratio: float | None = 1.0,
        prefix_first: int = 4,
    ) -> None:
        self.decoder = decoder
        # a chunk beside decoding rows takes at most this many decode steps (None: full chunks)
        self.stall_ratio = stall_ratio
        self.cache = cache  # prefix reuse of kept slot KV; None: off
        # the wait queue, which request is admitted next and into which slot
        self.admission = Admission(cache, prefix_first)
        self.max_waiting = max_waiting
        self.prefill_chunk = max(1, prefill_chunk)
        self.slots: list[SlotRequest | None] = [None] * decoder.slots
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self._stopping = False
        # set under the lock by anything that changes which requests run or wait (submit,
        # cancel, stop, a finish); the loop re-plans only then (see _decode_steady)
        self._changed = True
        self._thread: threading.Thread | None = None
        self.prefill_tps = Ewma()
        self.decode_ms = Ewma()
        # decode step inputs, rows 0..B-1 rewritten by each plan (see _plan_decode)
        self._tokens = np.zeros(decoder.slots, np.int64)
        self._lengths = np.zeros(decoder.slots, np.int64)
        self._active = np.zeros(decoder.slots, bool)
        # counters since start (under the lock): prompt tokens run through prefill, and the
        # prompt tokens of admitted requests, all and served from kept KV
        self.prefilled_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.copied_tokens = 0  # of those cached, copied from a busy slot
        self._copies: list[Copy] = []  # due before the next run

    # --- called from any thread ------------------------------------------------------------

    def full(self) -> bool:
        with self.lock:
            return self._full()

    def _full(self) -> bool:
        # requests not yet admitted count against the free slots first, then the queue
        free = sum(s is None for s in self.slots)
        return len(self.admission) >= free + self.max_waiting

    def submit(self, r: SlotRequest) -> None:
        """Queue ``r``; raises QueueFull when every slot is busy and the queue is full."""
        self.admission.hash(r)  # outside the lock
        with self.lock:
            if self._stopping:
                raise RuntimeError("engine is stopped")
            if self._full():
                raise QueueFull("all slots busy and the wait queue is full")
            self.admission.push(r)
            self._changed = True
            self._wake.notify()

    def cancel(self, request_id: str, notify: bool = True) -> bool:
        """Drop a request, queued or running; its slot is free when this returns."""
        with self.lock:
            found = self._remove(request_id)
            self._changed = True
        if found is None:
            return False
        if notify:
            found.emit(found.event([], FinishReason.ABORT))
        return True

    def _remove(self, request_id: str) -> SlotRequest | None:
        for r in self.slots:
            if r is not None and r.request.request_id == request_id:
                self._vacate(r)
                return r
        return self.admission.remove(request_id)

    def snapshot(self) -> SchedulerSnapshot:
        with self.lock:
            busy = [r for r in self.slots if r is not None]
            remaining = [r.budget - r.generated for r in busy]
            per_slot = -(-self.decoder.context // BLOCK_SIZE)
            return SchedulerSnapshot(
                running=len(busy),
                waiting=len(self.admission),
                kv_blocks_used=sum(-(-r.filled // BLOCK_SIZE) for r in busy),
                kv_blocks_total=per_slot * len(self.slots),
                prefill_tokens_per_s=self.prefill_tps.value,
                decode_ms_per_step=self.decode_ms.value,
                soonest_free_tokens=min(remaining) if remaining else 0,
                prefix_hit_rate=self.cached_tokens / max(self.prompt_tokens, 1),
                prefill_chunk=self.prefill_chunk,
                prefill_chunk_decoding=self._chunk_beside_decode(),
            )

    def _prefill_ms_per_token(self) -> float:
        """Under the lock: the measured prefill cost of a prompt token (0 before any)."""
        tps = self.prefill_tps.value
        return 1000.0 / tps if tps > 0 else 0.0

    def _chunk_beside_decode(self) -> int:
        """Under the lock: the chunk to prefill while rows decode, from the measured rates."""
        return chunk_beside_decode(
            self.prefill_chunk, self.stall_ratio, self.decode_ms.value, self._prefill_ms_per_token()
        )

    def held_blocks(self) -> list[int]:
        """Every block hash the slots hold (see ``SlotCache.held_hashes``); [] when off."""
        with self.lock:
            return [] if self.cache is None else self.cache.held_hashes()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="edge-slots", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; every request still queued or running gets an ABORT event."""
        with self.lock:
            self._stopping = True
            self._changed = True
            pending = [r for r in self.slots if r is not None] + self.admission.clear()
            self.slots = [None] * len(self.slots)
            if self.cache is not None:
                self.cache.reset()
            self._wake.notify_all()
        for r in pending:
            r.emit(r.event([], FinishReason.ABORT))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # --- the loop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self._stopping and not self.admission and not any(self.slots):
                    self._wake.wait()
                if self._stopping:
                    return
                self._changed = False
                self._admit()
                first = self._oldest_prefilling()
                if first is not None:
                    self._catch_up(first)
                copies, self._copies = self._copies, []
                plan = None if first is not None else self._plan_decode()
                size = self.prefill_chunk
                if first is not None and any(
                    r is not None and not r.prefilling for r in self.slots
                ):
                    size = self._chunk_beside_decode()
            try:
                for c in copies:  # before any run that reads them
                    self.decoder.copy_prefix(c.source, c.target, c.blocks * BLOCK_SIZE)
                if first is not None:
                    self._prefill_chunk(first, size)
                    with self.lock:  # the chunk may have finished a prompt, or a cancel came
                        plan = self._plan_decode()
                if plan is not None:
                    self._decode_steady(*plan)
            except Exception:
                log.exception("edge generation step failed; aborting the running requests")
                self._abort_running()

    def _decode_steady(
        self, decoding: list[tuple[int, SlotRequest]], first: int, rows: int
    ) -> None:
        """Decode steps with one plan for as long as nothing changes which requests run or
        wait (no submit, cancel, finish or stop: ``_changed`` stays False), and no prompt is
        left to prefill; between two steps only the rows' tokens and lengths move. The first
        step always runs (the plan was just made under the lock)."""
        tokens, lengths = self._tokens, self._lengths
        steady = self._decode_step(decoding, first, rows)
        # a prompt still prefilling needs its next chunk between decode steps: re-plan then
        # (slots change only under the lock with _changed set; this loop alone moves `filled`)
        steady &= not any(r is not None and r.prefilling for r in self.slots)
        while steady:
            for i, r in decoding:
                tokens[i - first], lengths[i - first] = r.last_token, r.filled
            steady = self._decode_step(decoding, first, rows)

    def _admit(self) -> None:
        """Under the lock: waiting requests into free slots, as ``self.admission`` chooses."""
        free = [slot for slot, occupant in enumerate(self.slots) if occupant is None]
        while free and self.admission:
            r = self.admission.next_request()
            place = self.admission.place(r, free)
            if place.copy is not None:
                self._copies.append(place.copy)
                self.copied_tokens += place.copied * BLOCK_SIZE
            free.remove(place.slot)
            if log.isEnabledFor(logging.DEBUG):  # the queue's order, as `edgecloud -v` shows it
                log.debug(
                    "admitted %s to slot %d after %.1f ms: %d blocks reused, passed %d times, "
                    "%d waiting",
                    r.request.request_id, place.slot,
                    (time.monotonic() - r.request.arrival_time) * 1e3, place.blocks, r.passed,
                    len(self.admission),
                )  # fmt: skip
            r.slot, r.filled = place.slot, place.blocks * BLOCK_SIZE
            if r.wants_prompt_logprobs and place.copy is not None:  # every position computed
                self._copies.remove(place.copy)
                self.copied_tokens -= place.copied * BLOCK_SIZE
            if r.wants_prompt_logprobs:
                r.filled = 0
            r.cached = r.filled
            self.slots[place.slot] = r
            self.prompt_tokens += r.prompt_len
            self.cached_tokens += r.cached

    def _catch_up(self, r: SlotRequest) -> None:
        """Under the lock: before ``r``'s next chunk, the blocks of its prompt another slot
        holds beyond what it has filled are queued to copy, and count as cached (none for a
        request that asks for prompt logprobs)."""
        if r.wants_prompt_logprobs:
            return
        copy = self.admission.catch_up(r)
        if copy is None:
            return
        gained = copy.blocks * BLOCK_SIZE - r.filled
        self._copies.append(copy)
        r.filled += gained
        r.cached += gained
        self.copied_tokens += gained
        self.cached_tokens += gained

    def _vacate(self, r: SlotRequest) -> None:
        """Under the lock: ``r`` leaves its slot; the KV it wrote stays there for reuse."""
        self.slots[r.slot] = None
        if self.cache is not None:
            self.cache.release(r.slot, r.written(), r.hashes)

    def _prefill_chunk(self, r: SlotRequest, size: int) -> None:
        start = r.filled
        prompt = r.request.prompt_token_ids
        chunk = prompt[start : start + size]
        t0 = time.perf_counter()
        prompt_lps = None
        if r.prompt_logprobs is not None:  # every position's logits: prompt logprobs
            rows = self.decoder.prefill_all(r.slot, chunk, start)
            k = r.request.sampling.prompt_logprobs or 0
            prompt_lps = next_token_logprobs(rows, prompt[start + 1 : start + len(chunk) + 1], k)
            logits = rows[-1]
        else:
            logits = self.decoder.prefill(r.slot, chunk, start)
        dt = time.perf_counter() - t0
        done = start + len(chunk) == r.prompt_len
        token = r.sampler(logits) if done else -1
        lp = self._logprob(r, logits, token) if done else None
        with self.lock:
            if prompt_lps is not None and r.prompt_logprobs is not None:
                r.prompt_logprobs.extend(prompt_lps)
            self.prefilled_tokens += len(chunk)
            if self.slots[r.slot] is not r:
                return  # cancelled while the chunk ran
            r.filled += len(chunk)
            r.prefill_ms += dt * 1000.0
            if self.cache is not None:  # its prompt's blocks written so far: offered to copy
                self.cache.grow(r.slot, r.request.prompt_token_ids[: r.filled], r.hashes)
            self.prefill_tps.add(len(chunk) / max(dt, 1e-9))
            if done:
                self._accept(r, token, lp)

    def _oldest_prefilling(self) -> SlotRequest | None:
        """Under the lock: the request whose prompt goes next (priority, then arrival)."""
        first: SlotRequest | None = None
        for r in self.slots:
            if (
                r is not None
                and r.prefilling
                and (first is None or r.sort_key() < first.sort_key())
            ):
                first = r
        return first

    def _plan_decode(self) -> tuple[list[tuple[int, SlotRequest]], int, int] | None:
        """Under the lock: the decoding ``(slot, request)`` pairs, the first slot F and the
        row count B of the next decode step (slots ``F..F+B-1``: the lowest to the highest
        decoding slot), its inputs written to rows ``0..B-1`` of the step buffers (row
        ``slot - F``); None when no slot decodes.

        The buffers belong to the loop thread and are read by the step that follows (nothing
        else runs in between on that thread), so they are reused rather than reallocated."""
        decoding = [(i, r) for i, r in enumerate(self.slots) if r is not None and not r.prefilling]
        if not decoding:
            return None
        first = decoding[0][0]
        rows = decoding[-1][0] + 1 - first
        tokens, lengths, active = self._tokens, self._lengths, self._active
        if rows > 1:
            tokens[:rows] = 0
            lengths[:rows] = 0
            active[:rows] = False
            cache = self.cache
            for j in range(rows):
                r = self.slots[first + j]
                if r is not None:
                    lengths[j] = r.filled  # a prefilling row writes one harmless position
                elif cache is not None:
                    lengths[j] = cache.kept_len(first + j)  # past the kept KV of a free slot
        for i, r in decoding:
            tokens[i - first], lengths[i - first], active[i - first] = r.last_token, r.filled, True
        return decoding, first, rows

    def _decode_step(self, decoding: list[tuple[int, SlotRequest]], first: int, rows: int) -> bool:
        """One decode step of the planned rows; True while the plan still holds."""
        t0 = time.perf_counter()
        logits = self.decoder.decode(
            self._tokens[:rows], self._lengths[:rows], self._active[:rows], first
        )
        dt = time.perf_counter() - t0
        greedy = logits.argmax(axis=1) if len(decoding) > 1 else None  # one pass for all rows
        sampled = []
        for i, r in decoding:
            row = i - first
            greedy_row = greedy is not None and r.sampler.greedy
            token = int(greedy[row]) if greedy_row else r.sampler(logits[row])
            sampled.append((r, token, self._logprob(r, logits[row], token)))
        with self.lock:
            self.decode_ms.add(dt * 1e3)
            for r, token, lp in sampled:
                if self.slots[r.slot] is r:
                    r.filled += 1
                    self._accept(r, token, lp)
            return not self._changed

    @staticmethod
    def _logprob(r: SlotRequest, logits: np.ndarray, token: int) -> TokenLogprob | None:
        """``token``'s log-probabilities where ``r`` asks for them (edge_runtime.logprobs)."""
        k = r.request.sampling.logprobs
        return None if k is None else token_logprob(logits, token, k)

    def _accept(self, r: SlotRequest, token: int, lp: TokenLogprob | None = None) -> None:
        """Under the lock: a sampled token -> an event; frees the slot when r finishes."""
        if token in r.stops:
            self._finish(r, [], FinishReason.STOP)
            return
        r.generated += 1
        r.output.append(token)
        lps = None if lp is None else [lp]
        if r.generated >= r.budget or r.filled >= self.decoder.context:
            self._finish(r, [token], FinishReason.LENGTH, lps)
            return
        r.last_token = token
        r.emit(r.event([token], None, lps))

    def _finish(
        self,
        r: SlotRequest,
        tokens: list[int],
        reason: FinishReason,
        lps: list[TokenLogprob] | None = None,
    ) -> None:
        self._vacate(r)
        self._changed = True
        r.emit(r.event(tokens, reason, lps))

    def _abort_running(self) -> None:
        with self.lock:
            busy = [r for r in self.slots if r is not None]
            self.slots = [None] * len(self.slots)
            if self.cache is not None:  # what the failed step left in the slots is unknown
                self.cache.reset()
        for r in busy:
            r.emit(r.event([], FinishReason.ABORT))
