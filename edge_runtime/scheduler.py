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
- Tokens reach the consumer in order, none twice, none lost: a request's first token and its
  final event go out at once; tokens in between go out as soon as ``stream_interval_s`` has
  passed since the request's previous event, several per event when steps are faster than that
  (0, the default, = one event per token). Every hand-over wakes the consumer's thread, which
  on a small CPU competes with ONNX Runtime's threads for the cores.
- Prefix reuse (with a ``SlotCache``): a request that ends (finished or cancelled) leaves its
  KV in its slot; a new request takes the free slot holding the longest run of its leading
  blocks (at most ``(prompt - 1) // 16``, so at least one prompt token is computed), starts
  with ``filled`` = those blocks' tokens and reports them as ``cached_tokens``; without a
  match it takes an empty slot, else the least recently freed one. When a busy slot holds a
  longer run (a request of the same app running, its prompt written so far), those blocks are
  copied into the new request's slot instead, after the lock is released and before anything
  else runs on the loop thread (no run can write the source's prefix meanwhile: only this
  thread runs or admits). A decode step's dummy row of a free slot writes at that slot's kept
  length, never inside its kept KV.
- Catch-up (with prefix reuse): before a request's prompt chunk runs, the leading blocks of its
  prompt that another slot (busy, or free and kept) holds beyond its own are copied in the
  same way (a request of its app admitted while the first still prefilled their shared
  prompt: prefill goes oldest first, so by its turn the first has written the prompt), and
  count as cached.
- Admission order (with prefix reuse): priority, then arrival, except that a waiting request
  whose prompt has 4+ more leading blocks held on the node (kept in a free slot, or written
  so far in a busy one, which admission copies) than every request ahead of it of its
  priority goes first (``routing.admission``): under a queue only one slot is free at a time,
  and the request at the head would overwrite the kept prefix another request waits for (at
  concurrency 16 on the embedded default half the shared prompts sent to the edge lost their
  1,136 cached tokens so, each then prefilled for ~2.5 s). Blocks in a busy slot count as
  the router's prefix index counts them: the node holds them.
  Each request it goes ahead of counts one pass; no request is passed more than
  ``prefix_first`` times (0: strict order), so none starves.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import takewhile

import numpy as np

from edge_runtime.decoder import Decoder
from edge_runtime.sampler import Sampler
from edge_runtime.slot_cache import SlotCache
from routing.admission import PREFIX_FIRST_WINDOW, prefix_first
from routing.blocks import reusable_blocks
from routing.engine import FinishReason, GenerationRequest, QueueFull, TokenEvent
from routing.prefill_budget import chunk_beside_decode

log = logging.getLogger(__name__)

KV_BLOCK = 16  # tokens per reported KV block (the prefix-block size of routing)


@dataclass
class SlotRequest:
    """One request as the loop tracks it."""

    request: GenerationRequest
    emit: Callable[[TokenEvent], None]  # thread-safe; delivers to the request's consumer
    budget: int  # tokens it may still generate in total
    sampler: Sampler = field(init=False)
    stops: frozenset[int] = field(init=False)
    slot: int = -1
    filled: int = 0  # positions of this sequence in the slot's KV cache
    generated: int = 0
    last_token: int = -1  # sampled, fed at the next decode step
    pending: list[int] = field(default_factory=list)  # generated, not yet handed over
    last_emit: float = 0.0  # perf_counter of the previous hand-over
    hashes: list[int] = field(default_factory=list)  # block hashes of the prompt (prefix reuse)
    cached: int = 0  # leading prompt tokens whose KV the slot already held (whole blocks)
    prefill_ms: float = 0.0  # compute time of its own prompt chunks
    output: list[int] = field(default_factory=list)  # generated tokens (no stop token)
    passed: int = 0  # times a later request was admitted before it (prefix_first)

    def __post_init__(self) -> None:
        params = self.request.sampling
        self.sampler = Sampler(params)
        self.stops = frozenset() if params.ignore_eos else frozenset(params.stop_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.filled < self.prompt_len

    def written(self) -> list[int]:
        """The tokens whose KV is in the slot: the prompt, then the generated tokens fed back
        (the last sampled one is not, until the next decode step)."""
        return (self.request.prompt_token_ids + self.output)[: self.filled]

    def sort_key(self) -> tuple[int, float]:
        return (self.request.priority, self.request.arrival_time)

    def event(self, tokens: list[int], reason: FinishReason | None) -> TokenEvent:
        """An event carrying the pending tokens, then ``tokens`` (pending is emptied)."""
        if self.pending:
            tokens, self.pending = self.pending + tokens, []
        return TokenEvent(
            request_id=self.request.request_id,
            token_ids=tokens,
            completion_tokens=self.generated,
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached,
            finish_reason=reason,
            prefill_ms=self.prefill_ms,
        )


class Ewma:
    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha, self.value = alpha, 0.0

    def update(self, x: float) -> None:
        self.value = x if self.value == 0.0 else self.value + self.alpha * (x - self.value)


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
        stream_interval_s: float = 0.0,
        cache: SlotCache | None = None,
        stall_ratio: float | None = 1.0,
        prefix_first: int = 4,
    ) -> None:
        self.decoder = decoder
        # how often a waiting request may be passed by one with more of its prefix held here
        self.prefix_first = max(0, prefix_first)
        # a chunk beside decoding rows takes at most this many decode steps (None: full chunks)
        self.stall_ratio = stall_ratio
        self.cache = cache  # prefix reuse of kept slot KV; None: off
        self.max_waiting = max_waiting
        self.prefill_chunk = max(1, prefill_chunk)
        self.stream_interval_s = max(0.0, stream_interval_s)
        self.slots: list[SlotRequest | None] = [None] * decoder.slots
        self._waiting: list[tuple[tuple[int, float], int, SlotRequest]] = []
        self._seq = 0
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
        self._copies: list[tuple[int, int, int]] = []  # (from slot, to slot, positions) due

    # --- called from any thread ------------------------------------------------------------

    def full(self) -> bool:
        with self.lock:
            return self._full()

    def _full(self) -> bool:
        # requests not yet admitted count against the free slots first, then the queue
        free = sum(s is None for s in self.slots)
        return len(self._waiting) >= free + self.max_waiting

    def submit(self, r: SlotRequest) -> None:
        """Queue ``r``; raises QueueFull when every slot is busy and the queue is full."""
        if self.cache is not None:  # hashed here, outside the lock
            r.hashes = self.cache.hashes(r.request.prompt_token_ids)
        with self.lock:
            if self._stopping:
                raise RuntimeError("engine is stopped")
            if self._full():
                raise QueueFull("all slots busy and the wait queue is full")
            heapq.heappush(self._waiting, (r.sort_key(), self._seq, r))
            self._seq += 1
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
        for i, (_, _, r) in enumerate(self._waiting):
            if r.request.request_id == request_id:
                self._waiting.pop(i)
                heapq.heapify(self._waiting)
                return r
        return None

    def snapshot(self) -> SchedulerSnapshot:
        with self.lock:
            busy = [r for r in self.slots if r is not None]
            remaining = [r.budget - r.generated for r in busy]
            per_slot = -(-self.decoder.context // KV_BLOCK)
            return SchedulerSnapshot(
                running=len(busy),
                waiting=len(self._waiting),
                kv_blocks_used=sum(-(-r.filled // KV_BLOCK) for r in busy),
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
            pending = [r for r in self.slots if r is not None] + [w[2] for w in self._waiting]
            self.slots = [None] * len(self.slots)
            if self.cache is not None:
                self.cache.reset()
            self._waiting.clear()
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
                while not self._stopping and not self._waiting and not any(self.slots):
                    self._wake.wait()
                if self._stopping:
                    return
                self._changed = False
                self._admit()
                first = self._oldest_prefilling()
                if first is not None and self.cache is not None:
                    self._catch_up(first)
                copies, self._copies = self._copies, []
                plan = None if first is not None else self._plan_decode()
                size = self.prefill_chunk
                if first is not None and any(
                    r is not None and not r.prefilling for r in self.slots
                ):
                    size = self._chunk_beside_decode()
            try:
                for src, dst, n in copies:  # before any run that reads them
                    self.decoder.copy_prefix(src, dst, n)
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
        """Under the lock: waiting requests into free slots, best first. With prefix reuse a
        request takes the free slot holding most of its leading blocks (see ``SlotCache``)
        and starts after them; without, the lowest free slot."""
        free = [slot for slot, occupant in enumerate(self.slots) if occupant is None]
        while free and self._waiting:
            r = self._next_waiting()
            slot, blocks = free[0], 0
            if self.cache is not None:
                prompt, limit = r.request.prompt_token_ids, reusable_blocks(r.prompt_len)
                slot, blocks = self.cache.choose(free, prompt, r.hashes, limit)
                self.cache.take(slot, blocks)
                source, more = self.cache.best_source(prompt, r.hashes, limit, exclude=slot)
                if more > blocks:
                    self.cache.adopt(slot, source, more)
                    self._copies.append((source, slot, more * KV_BLOCK))
                    self.copied_tokens += (more - blocks) * KV_BLOCK
                    blocks = more
            free.remove(slot)
            if log.isEnabledFor(logging.DEBUG):  # the queue's order, as `edgecloud -v` shows it
                log.debug(
                    "admitted %s to slot %d after %.1f ms: %d blocks reused, passed %d times, "
                    "%d waiting",
                    r.request.request_id, slot, (time.monotonic() - r.request.arrival_time) * 1e3,
                    blocks, r.passed, len(self._waiting),
                )  # fmt: skip
            r.slot, r.filled = slot, blocks * KV_BLOCK
            r.cached = r.filled
            self.slots[slot] = r
            self.prompt_tokens += r.prompt_len
            self.cached_tokens += r.cached

    def _catch_up(self, r: SlotRequest) -> None:
        """Under the lock: before ``r``'s next chunk, the leading blocks of its prompt another
        slot holds (busy, or free and kept: nothing takes it before the copy runs) beyond what
        ``r`` has filled are copied into its slot (queued with the admissions' copies) and
        count as cached."""
        assert self.cache is not None
        prompt, limit = r.request.prompt_token_ids, reusable_blocks(r.prompt_len)
        source, blocks = self.cache.best_source(
            prompt, r.hashes, limit, exclude=r.slot, free_too=True
        )
        gained = blocks * KV_BLOCK - r.filled
        if gained <= 0:
            return
        self.cache.adopt(r.slot, source, blocks)
        self._copies.append((source, r.slot, blocks * KV_BLOCK))
        r.filled += gained
        r.cached += gained
        self.copied_tokens += gained
        self.cached_tokens += gained

    def _next_waiting(self) -> SlotRequest:
        """Under the lock: take the waiting request to admit next (``routing.admission``:
        the first in order unless a later one of the same priority has several more leading
        blocks held on the node)."""
        if self.cache is None or self.prefix_first == 0 or len(self._waiting) == 1:
            return heapq.heappop(self._waiting)[2]
        order = heapq.nsmallest(PREFIX_FIRST_WINDOW, self._waiting)
        top = order[0][2].request.priority  # never ahead of a request of higher priority
        same = takewhile(lambda e: e[2].request.priority == top, order)
        best = prefix_first(((self._reuse(e[2]), e[2].passed) for e in same), self.prefix_first)
        chosen = order[best]
        if best == 0:
            return heapq.heappop(self._waiting)[2]
        for _, _, r in order[:best]:
            r.passed += 1
        self._waiting.remove(chosen)
        heapq.heapify(self._waiting)
        return chosen[2]

    def _reuse(self, r: SlotRequest) -> int:
        """Under the lock: the most leading blocks of ``r`` the node holds, in a free slot
        (kept) or a busy one (written so far): what ``_admit`` gives it, by taking that free
        slot or copying from that busy one."""
        assert self.cache is not None
        limit = reusable_blocks(r.prompt_len)
        prompt = r.request.prompt_token_ids
        return self.cache.best_source(prompt, r.hashes, limit, exclude=-1, free_too=True)[1]

    def _vacate(self, r: SlotRequest) -> None:
        """Under the lock: ``r`` leaves its slot; the KV it wrote stays there for reuse."""
        self.slots[r.slot] = None
        if self.cache is not None:
            self.cache.release(r.slot, r.written(), r.hashes)

    def _prefill_chunk(self, r: SlotRequest, size: int) -> None:
        start = r.filled
        chunk = r.request.prompt_token_ids[start : start + size]
        t0 = time.perf_counter()
        logits = self.decoder.prefill(r.slot, chunk, start)
        dt = time.perf_counter() - t0
        done = start + len(chunk) == r.prompt_len
        token = r.sampler(logits) if done else -1
        with self.lock:
            self.prefilled_tokens += len(chunk)
            if self.slots[r.slot] is not r:
                return  # cancelled while the chunk ran
            r.filled += len(chunk)
            r.prefill_ms += dt * 1000.0
            if self.cache is not None:  # its prompt's blocks written so far: offered to copy
                self.cache.grow(r.slot, r.request.prompt_token_ids[: r.filled], r.hashes)
            self.prefill_tps.update(len(chunk) / max(dt, 1e-9))
            if done:
                self._accept(r, token)

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
            sampled.append((r, int(greedy[row]) if greedy_row else r.sampler(logits[row])))
        with self.lock:
            self.decode_ms.update(dt * 1e3)
            for r, token in sampled:
                if self.slots[r.slot] is r:
                    r.filled += 1
                    self._accept(r, token)
            return not self._changed

    def _accept(self, r: SlotRequest, token: int) -> None:
        """Under the lock: a sampled token -> an event; frees the slot when r finishes."""
        if token in r.stops:
            self._finish(r, [], FinishReason.STOP)
            return
        r.generated += 1
        r.output.append(token)
        if r.generated >= r.budget or r.filled >= self.decoder.context:
            self._finish(r, [token], FinishReason.LENGTH)
            return
        r.last_token = token
        r.pending.append(token)
        if not self.stream_interval_s:  # every token at once: no clock to read
            r.emit(r.event([], None))
            return
        now = time.perf_counter()
        if r.generated == 1 or now - r.last_emit >= self.stream_interval_s:
            r.last_emit = now
            r.emit(r.event([], None))

    def _finish(self, r: SlotRequest, tokens: list[int], reason: FinishReason) -> None:
        self._vacate(r)
        self._changed = True
        r.emit(r.event(tokens, reason))

    def _abort_running(self) -> None:
        with self.lock:
            busy = [r for r in self.slots if r is not None]
            self.slots = [None] * len(self.slots)
            if self.cache is not None:  # what the failed step left in the slots is unknown
                self.cache.reset()
        for r in busy:
            r.emit(r.event([], FinishReason.ABORT))
