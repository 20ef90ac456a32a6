"""What a node has to do before a new request's first and last token: a replay of its engine.

Both engines run one loop: admit waiting requests into free slots (first come, first served),
compute one prefill chunk of the oldest request still prefilling, then one decode step of every
request already decoding. :func:`replay` runs that loop forward, in time only, over the work a
node has in hand (what this gateway sent it and has not seen finish, plus what other gateways
sent, as counts) and the new request, and says when the new request's first token comes out
and when its last does.

Invariants:
- Time only moves forward; each loop costs ``chunk tokens * prefill_ms_per_token`` plus one
  decode step ``decode_step_ms(rows, context)`` when any request decodes, ``context`` being
  the tokens every decoding row attends to (its prompt and its output so far, summed over the
  rows: each decode step adds one to each row's); a prompt's first chunk also
  costs ``prefill_fixed_ms`` (its admission: rendering, tokenizing, the first step's setup).
  A chunk is ``chunk_tokens`` with nothing decoding and ``chunk_tokens_decoding`` beside
  decoding rows (what the node reports: ``routing.prefill_budget``).
- A request's first token comes out when its last prefill chunk is done; it then needs
  ``decode_steps`` more steps (its expected output minus that first token). With
  ``mixed_steps`` (the cloud engine: one forward pass holds the decode rows and chunks) a loop
  is one step that prefills the oldest prompts, several if they fit, in what the step's
  ``chunk(rows)`` tokens leave beside its decode rows (one token each); the prompts it finishes get their first
  tokens at the end of that step and decode from the next. Work in hand with
  nothing left (predicted done, not yet seen to finish) holds no slot.
- Runs of identical decode steps are jumped over in one move (to the next finish), so the loop
  runs once per prefill chunk and once per finish, not once per token, and each run costs
  O(log rows): decoding requests share one step counter and wait in a heap by finishing step.
- ``stalled_others_ms`` sums, over the new request's prefill chunks, each chunk's time times
  the requests decoding while it ran: the delay its prefill adds to the others.
- With :class:`Arrivals` the node keeps the population it usually has: once the new request
  has its first token, whenever fewer than ``population`` requests are left (the new one
  included), one more with the usual work joins the queue, behind the new request and never
  ahead of it. Requests that come later can only slow its decode (their prefill chunks between
  its steps, their rows in its batch); none shares the steps of its prompt, which come first.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class Work:
    """One request's remaining work on a node: prompt tokens still to prefill, decode steps
    after its first token, and the tokens its KV holds at its next decode step (its whole
    prompt and what it has generated: what that step attends to)."""

    prefill_tokens: float
    decode_steps: float
    started: bool = False  # its prefill is under way (its fixed cost is paid)
    context: float = 0.0
    shared: SharedPrefix | None = None  # prompt blocks an earlier request in hand computes


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Leading prompt blocks a request has in common with an earlier request in hand: once that
    one's prefill is done the node holds them, and ``tokens`` of the request's prompt are
    cached instead of computed (those beyond what the prefix index credited it)."""

    source: int  # the earlier request's index in the work in hand
    tokens: float


@dataclass(frozen=True, slots=True)
class Arrivals:
    """The requests expected on the node after the decision: it is kept at ``population``
    requests in hand (what it has had on average lately), each newcomer with ``work`` (the mean
    of what was sent there lately). A closed loop of clients replaces each finished request
    this way, and an open stream at a steady rate holds its population near its mean."""

    population: int
    work: Work

    def __post_init__(self) -> None:
        if not self.work.prefill_tokens >= 1:
            raise ValueError("an arriving request computes at least one prompt token")


@dataclass(frozen=True, slots=True)
class EngineShape:
    """How a node's engine spends time (all measured or learned, see ``routing.latency``)."""

    slots: int
    chunk_tokens: int
    prefill_ms_per_token: float
    decode_step_ms_b1: float  # one decode step with one row (of no context)
    batch_slope: float  # a step of b rows takes decode_step_ms_b1 * (1 + slope * (b - 1))
    prefill_fixed_ms: float = 0.0  # once per prompt, with its first chunk
    chunk_tokens_decoding: int = 0  # the chunk while rows decode (0: ``chunk_tokens``)
    mixed_steps: bool = False  # a chunk and the decode rows run as one step (first token after)
    # what one token of context adds to a decode step (reading its KV), summed over the rows
    decode_ms_per_context_token: float = 0.0
    cached_token_ms: float = 0.0  # what a cached prompt token still costs its prompt's prefill
    # a request takes the prefix an earlier one in hand writes before each of its chunks
    # (NodeState.prefix_catch_up), not only at admission
    catch_up: bool = False

    def chunk(self, decoding: int) -> float:
        """Prompt tokens of the next chunk with ``decoding`` rows decoding beside it."""
        if decoding and self.chunk_tokens_decoding > 0:
            return self.chunk_tokens_decoding
        return max(1, self.chunk_tokens)

    def decode_step_ms(self, rows: float, context: float = 0.0) -> float:
        """One step of ``rows`` rows (a mean batch may be fractional) attending to ``context``
        tokens in all."""
        return self.decode_step_ms_b1 * (
            1.0 + self.batch_slope * max(0.0, rows - 1)
        ) + self.decode_ms_per_context_token * max(0.0, context)

    def decode_steps_ms(self, k: float, rows: int, context: float) -> tuple[float, float]:
        """``k`` decode steps of ``rows`` rows, the first attending to ``context`` tokens (one
        more per row each step): their time and the context they attend to, summed."""
        ctx = k * context + rows * k * (k - 1.0) / 2.0
        return k * self.decode_step_ms(rows) + self.decode_ms_per_context_token * ctx, ctx


@dataclass(frozen=True, slots=True)
class Replayed:
    """The new request's predicted times from now (ms) and the rows it decoded alongside."""

    queue_ms: float  # until it entered a slot
    first_token_ms: float
    last_token_ms: float
    mean_batch: float  # mean rows of the decode steps it took part in (itself included)
    # the time its own prefill chunks held up the others' decode steps: each chunk's time
    # times the requests decoding while it ran (what it costs them, summed)
    stalled_others_ms: float = 0.0
    mean_context: float = 0.0  # mean context its decode steps attended to (all rows, summed)
    reused_tokens: float = 0.0  # prefill work it took from an earlier request's (``shared``)


@dataclass(slots=True)
class _Req:
    prefill: float
    steps: float
    new: bool = False
    started: bool = False  # its first prefill chunk has run (the fixed cost is paid)
    ctx: float = 0.0  # tokens its next decode step attends to
    reuse: float = 0.0  # prefill work an earlier request's prefix saves it (``Work.shared``)
    source: _Req | None = None  # that request (None: its prefill is done)
    reused: float = 0.0  # what it saved, once in a slot


def _requests(shape: EngineShape, ahead: Sequence[Work], new: Work) -> tuple[list[_Req], _Req]:
    """The replay's requests: those of ``ahead`` with work left, in order, and the new one,
    each linked to the earlier request whose prefix it shares (``Work.shared``) with the
    prefill work that saves it."""
    reqs = [_req(w) for w in ahead]
    target = _req(new, new=True)
    per_token = max(shape.prefill_ms_per_token, 1e-9)
    saves = max(0.0, 1.0 - shape.cached_token_ms / per_token)
    for i, (w, r) in enumerate((*zip(ahead, reqs, strict=True), (new, target))):
        if w.shared is not None and 0 <= w.shared.source < i:
            r.reuse = max(0.0, w.shared.tokens) * saves
            r.source = reqs[w.shared.source]
    kept = [
        r for w, r in zip(ahead, reqs, strict=True) if w.prefill_tokens > 0 or w.decode_steps > 0
    ]
    return kept, target


def _take_slot(r: _Req, catch_up: bool) -> None:
    """``r`` enters a slot: it reuses the prefix its source wrote if that one's prefill is done
    (the engines match a prefix at admission), or with ``catch_up`` in any case (the edge
    copies it before each chunk, and the source, older, prefills first); at least one token
    is still computed."""
    done = r.source is None or r.source.prefill <= 0 or catch_up
    if r.reuse > 0 and done and r.prefill > 1.0:
        r.reused = min(r.reuse, r.prefill - 1.0)
        r.prefill -= r.reused
    r.reuse, r.source = 0.0, None


def _run_chunk(r: _Req, shape: EngineShape, chunk: float) -> float:
    """Prefill ``r``'s next chunk (at most ``chunk`` tokens); returns the time it takes (its
    fixed cost with the first). The rate is the one fitted on what the node said each prompt's
    compute took, short chunks beside decoding rows included, so a short chunk's dearer run
    is in it already (no :func:`routing.prefill_budget.short_chunk_extra_ms` here: measured,
    adding it over-predicted the edge's TTFT by a median 17-27% at concurrency 4 and 16)."""
    c = min(float(chunk), r.prefill)
    r.prefill -= c
    ms = c * shape.prefill_ms_per_token
    if not r.started:
        r.started = True
        ms += shape.prefill_fixed_ms
    return ms


def _run_step_chunks(
    prompts: Iterable[_Req], shape: EngineShape, rows: int
) -> tuple[float, float, list[_Req]]:
    """A mixed step's prefill: chunks of ``prompts`` (oldest first) in what the step's token
    budget leaves beside ``rows`` decode rows, at most ``chunk_tokens_decoding`` prompt tokens
    beside any (the cloud engine's cut). Returns its time, the new request's share of it (0
    when it got none) and the prompts it finished, in order."""
    budget = float(max(1, shape.chunk_tokens - rows))
    if rows and shape.chunk_tokens_decoding > 0:
        budget = min(budget, float(shape.chunk_tokens_decoding))
    total = own = 0.0
    finished: list[_Req] = []
    for r in prompts:
        c = min(budget, r.prefill)
        ms = _run_chunk(r, shape, c)
        total += ms
        if r.new:
            own = ms
        budget -= c
        if r.prefill <= 0:
            finished.append(r)
        if budget <= 0:
            break
    return total, own, finished


class _Clock(NamedTuple):
    """A replay's scalars between loops (see :func:`_advance`)."""

    t: float = 0.0  # ms from the decision
    done: float = 0.0  # decode steps run (the decoding rows' shared counter)
    base: float = 0.0  # the decoding rows' context less the count each started at, summed
    queue_ms: float = -1.0
    first: float = -1.0
    target_end: float = -1.0  # the step count the new request finishes at, once it decodes
    row_steps: float = 0.0
    steps: float = 0.0
    stall: float = 0.0
    ctx_steps: float = 0.0
    seq: int = 0


@dataclass(slots=True)
class _Loop:
    """A replay paused between two loops: what waits, prefills and decodes, and its clock."""

    waiting: deque[_Req]
    prefilling: deque[_Req]  # in slots, prompt not done, oldest first
    # heap of (step count it finishes at, tiebreak, its context less the count it started at)
    decoding: list[tuple[float, int, float]]
    target: _Req
    loops: int  # loops left before it gives up
    clock: _Clock = field(default_factory=_Clock)

    @classmethod
    def start(
        cls,
        shape: EngineShape,
        ahead: Sequence[Work],
        new: Work,
        max_loops: int,
    ) -> _Loop:
        kept, target = _requests(shape, ahead, new)
        return cls(deque((*kept, target)), deque(), [], target, max_loops)

    def fork(self) -> _Loop:
        """An independent copy (requests not yet decoding are copied: chunks change them, and
        a waiting one's source is its copy's)."""
        copies = {id(r): replace(r) for r in (*self.waiting, *self.prefilling)}
        for r in copies.values():
            if r.source is not None:
                r.source = copies.get(id(r.source), r.source)
        return _Loop(
            deque(copies[id(r)] for r in self.waiting),
            deque(copies[id(r)] for r in self.prefilling),
            list(self.decoding),
            copies.get(id(self.target), self.target),
            self.loops,
            self.clock,
        )


def replay(
    shape: EngineShape,
    ahead: Sequence[Work],
    new: Work,
    max_loops: int = 4096,
    arrivals: Arrivals | None = None,
) -> Replayed:
    """Run the engine forward over ``ahead`` (in arrival order) with ``new`` last, then the
    ``arrivals`` that keep the node's population."""
    loop = _Loop.start(shape, ahead, new, max_loops)
    r = _advance(shape, loop, arrivals, pause_at_first=False)
    assert r is not None  # only a pausing run stops short
    return r


def replay_pair(
    shape: EngineShape,
    ahead: Sequence[Work],
    new: Work,
    arrivals: Arrivals,
    max_loops: int = 4096,
) -> tuple[Replayed, Replayed]:
    """``replay`` without ``arrivals`` and with them, equal to two calls: arrivals join only
    once the new request has its first token, so both run the same loops until then; those
    run once, and the rest forks."""
    loop = _Loop.start(shape, ahead, new, max_loops)
    shared = _advance(shape, loop, None, pause_at_first=True)
    if shared is not None:  # done by its first token (no decode, or out of loops)
        return shared, shared
    held = loop.fork()
    without = _advance(shape, loop, None, pause_at_first=False)
    with_arrivals = _advance(shape, held, arrivals, pause_at_first=False)
    assert without is not None and with_arrivals is not None
    return without, with_arrivals


def _advance(
    shape: EngineShape, loop: _Loop, arrivals: Arrivals | None, pause_at_first: bool
) -> Replayed | None:
    """Run ``loop`` on to the new request's last token; with ``pause_at_first``, stop instead
    before the first loop that begins after its first token (where arrivals would join),
    save the clock in ``loop`` and return None.

    Every decoding request advances one step per decode step, so they share one step counter
    (``done``) and each is a heap entry keyed by the count at which it finishes: a step, a jump
    to the next finish and a finish each cost O(log rows), never a pass over the rows. Their
    context likewise: a row that started decoding at count ``s`` with context ``c`` attends to
    ``c + done - s`` tokens, so the rows' sum is ``base + rows * done`` with ``base`` the sum
    of their ``c - s``.
    """
    waiting, prefilling, decoding, target = (
        loop.waiting,
        loop.prefilling,
        loop.decoding,
        loop.target,
    )
    t, done, base, queue_ms, first, target_end, row_steps, steps, stall, ctx_steps, seq = loop.clock
    slots = max(1, shape.slots)

    def start_decoding(r: _Req) -> None:
        nonlocal seq, target_end, base
        heapq.heappush(decoding, (done + r.steps, seq, r.ctx - done))
        base += r.ctx - done
        seq += 1
        if r.new:
            target_end = done + r.steps

    def finish_decoding() -> None:
        nonlocal base
        while decoding and decoding[0][0] <= done:
            base -= heapq.heappop(decoding)[2]

    def result(last: float) -> Replayed:
        if steps <= 0:
            return Replayed(queue_ms, first, last, 1.0, stall, reused_tokens=target.reused)
        return Replayed(
            queue_ms, first, last, row_steps / steps, stall, ctx_steps / steps, target.reused
        )

    for ran in range(loop.loops):
        if first >= 0:
            if pause_at_first:
                loop.loops -= ran
                loop.clock = _Clock(t, done, base, queue_ms, first, target_end, row_steps,
                                    steps, stall, ctx_steps, seq)  # fmt: skip
                return None
            if arrivals is not None:
                for _ in range(
                    arrivals.population - len(waiting) - len(prefilling) - len(decoding)
                ):
                    waiting.append(_req(arrivals.work))
        while waiting and len(prefilling) + len(decoding) < slots:
            r = waiting.popleft()
            _take_slot(r, shape.catch_up)
            if r.new:
                queue_ms = t
            if r.prefill > 0:
                prefilling.append(r)
            elif r.steps > 0:
                start_decoding(r)
        pre = prefilling[0] if prefilling else None
        if pre is not None and shape.mixed_steps:
            # one step: chunks of the oldest prompts under the budget, and the decode rows
            ms, own, finished = _run_step_chunks(prefilling, shape, len(decoding))
            t += ms
            if own > 0:
                stall += own * len(decoding)
            for _ in finished:  # the finished ones are the oldest
                prefilling.popleft()
            n = len(decoding)
            if n:
                ms, ctx = shape.decode_steps_ms(1.0, n, base + n * done)
                t += ms
                if target_end >= 0:
                    row_steps += n
                    ctx_steps += ctx
                    steps += 1.0
                done += 1.0
                if target_end >= 0 and target_end <= done:
                    return result(t)
                finish_decoding()
            for r in finished:  # their first tokens end the step; they decode from the next
                if r.new:
                    first = t
                    if target.steps <= 0:
                        return result(first)
                if r.steps > 0:
                    start_decoding(r)
            continue
        if pre is not None:
            ms = _run_chunk(pre, shape, shape.chunk(len(decoding)))
            t += ms
            if pre.new:
                stall += ms * len(decoding)
            if pre.prefill <= 0:
                prefilling.popleft()
                if pre.new:
                    first = t
                    if target.steps <= 0:
                        return result(first)
                if pre.steps > 0:  # its first token came out of the prefill; it decodes now
                    start_decoding(pre)
        if not decoding:
            if pre is None and not waiting:
                break
            continue
        n = len(decoding)
        # With nothing left to prefill, identical steps repeat until the next finish: jump
        # (to that finish's count exactly, so that float rounding never adds a step).
        after = done + 1.0
        if not prefilling and pre is None:
            after = max(after, decoding[0][0])
        k = after - done
        ms, ctx = shape.decode_steps_ms(k, n, base + n * done)
        t += ms
        if target_end >= 0:
            row_steps += k * n
            ctx_steps += ctx
            steps += k
        done = after
        if target_end >= 0 and target_end <= done:
            return result(t)
        finish_decoding()
    # Out of loops (a pathological backlog): finish the target alone from here.
    rows = len(prefilling) + len(decoding)
    if first < 0:
        first = t + target.prefill * shape.prefill_ms_per_token + shape.prefill_fixed_ms
    left = target_end - done if target_end >= 0 else target.steps
    last = first + left * shape.decode_step_ms(rows or 1, (rows or 1) * target.ctx)
    return Replayed(
        max(queue_ms, 0.0), first, last, float(rows or 1), stall, reused_tokens=target.reused
    )


def _req(w: Work, new: bool = False) -> _Req:
    """A replay's request from ``w`` (the new one computes at least one prompt token; work in
    hand whose prefill is under way has paid its fixed cost)."""
    prefill = max(1.0, w.prefill_tokens) if new else max(0.0, w.prefill_tokens)
    return _Req(prefill, max(0.0, w.decode_steps), new, w.started and not new, max(0.0, w.context))
