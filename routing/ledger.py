"""What this gateway has in flight on each node, so a decision can replay each node's work.

Invariants:
- Entries are kept per node sorted by dispatch time (the clock's order); each node is taken to
  serve them in that order.
- A request whose first token was not seen is still before it, however late against its
  prediction; one not finished is still decoding, however late.
- Recent finishes are kept ``keep_finished_s``: a node's state taken before they finished
  still counts them as running.
- A request of ``n`` choices is ``n`` rows, as a node counts it: ``n`` items of ``work`` (its
  own first, the others decoding beside it from its first token) and ``n`` in the counts.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from routing.backlog import SharedPrefix, Work
from routing.blocks import BLOCK_SIZE
from routing.latency import Estimate
from routing.latency.priors import ARRIVAL_WINDOW_S, OVERRUN_LEFT


@dataclass(slots=True)
class _InFlight:
    dispatched_at: float
    estimate: Estimate
    output_tokens: float
    first_token_at: float | None = None
    tokens_seen: int = 0  # completion tokens the gateway has relayed (streams), 0: none seen
    hashes: Sequence[int] = ()  # its prompt's leading block hashes, as far as a node reuses
    rows: int = 1  # its choices (n): rows it decodes at once, sharing its prompt


def _holders(entries: Iterable[_InFlight]) -> dict[int, int]:
    """Block hash -> the index in :meth:`DispatchLedger.work` (where each entry is its
    ``rows`` items, its own first) of the first entry whose prompt has it."""
    held: dict[int, int] = {}
    i = 0
    for e in entries:
        for h in e.hashes:
            held.setdefault(h, i)
        i += e.rows
    return held


def _shared(hashes: Sequence[int], held: Mapping[int, int]) -> tuple[int, int]:
    """``(blocks, index)``: the longest run of ``hashes``' leading blocks an entry of ``held``
    has, and the first such entry (-1: none). Hashes are chained, so an entry holding a block
    holds every block before it: the run is found by bisection."""
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo, held[hashes[lo - 1]] if lo else -1


class DispatchLedger:
    """Requests in flight per node, with their dispatch times (sorted, as the clock is) and
    what was predicted for them, so a decision can replay the work each node has in hand."""

    def __init__(self, keep_finished_s: float = 30.0) -> None:
        self._times: dict[str, list[tuple[float, int]]] = {}
        self._entries: dict[int, _InFlight] = {}
        # (dispatched at, finished at, rows) of recent finishes per node: a node's state taken
        # before they finished still counts them as running
        self._finished: dict[str, collections.deque[tuple[float, float, int]]] = {}
        self.keep_finished_s = keep_finished_s
        # (dispatched at, prefill work tokens, decode steps, prompt tokens) of recent dispatches
        # per node: its typical newcomer (``typical``)
        self._sent: dict[str, collections.deque[tuple[float, float, float, float]]] = {}
        # (finished at, its prompt's block hashes) of recent finishes per node, in that order
        self._left: dict[str, collections.deque[tuple[float, Sequence[int]]]] = {}
        self._rows: dict[int, int] = {}  # ticket -> its rows, while in flight
        self._node_rows: dict[str, int] = {}  # node -> rows of its requests in flight
        # called with a node's id whenever its rows in flight change (an in-flight board)
        self.on_change: Callable[[str], None] | None = None

    def add(
        self,
        node_id: str,
        at: float,
        ticket_id: int,
        estimate: Estimate | None = None,
        output_tokens: float = 0.0,
        hashes: Sequence[int] = (),
        rows: int = 1,
    ) -> None:
        """Count a dispatch; ``rows``: its choices, each a row on the node (``n``)."""
        bisect.insort(self._times.setdefault(node_id, []), (at, ticket_id))
        self._rows[ticket_id] = rows
        self._node_rows[node_id] = self._node_rows.get(node_id, 0) + rows
        if self.on_change is not None:
            self.on_change(node_id)
        if estimate is not None:
            self._entries[ticket_id] = _InFlight(
                at, estimate, output_tokens, hashes=hashes, rows=rows
            )
            work = estimate.basis.prefill_work_tokens or float(estimate.uncached_tokens)
            sent = self._sent.setdefault(node_id, collections.deque(maxlen=1024))
            sent.append((at, work, max(0.0, output_tokens - 1.0), float(estimate.prompt_tokens)))

    def remove(self, node_id: str, at: float, ticket_id: int, now: float | None = None) -> bool:
        entry = self._entries.pop(ticket_id, None)
        rows = self._rows.pop(ticket_id, 1)
        items = self._times.get(node_id)
        if not items:
            return False
        i = bisect.bisect_left(items, (at, ticket_id))
        if i < len(items) and items[i] == (at, ticket_id):
            del items[i]
            self._node_rows[node_id] = self._node_rows.get(node_id, rows) - rows
            if self.on_change is not None:
                self.on_change(node_id)
            if now is not None and entry is not None and entry.hashes:
                left = self._left.setdefault(node_id, collections.deque(maxlen=256))
                left.append((now, entry.hashes))
            if now is not None:
                done = self._finished.setdefault(node_id, collections.deque())
                done.append((at, now, rows))
                while done and (now - done[0][1] > self.keep_finished_s or len(done) > 4096):
                    done.popleft()
            return True
        return False

    def mean_in_flight(self, node_id: str, start: float, end: float) -> float:
        """The mean number of rows of this gateway's requests the node had in hand over
        ``[start, end]`` (clock seconds): each one dispatched before ``end`` and not finished
        before ``start`` counts its rows for the part of the span it was there (finishes older
        than ``keep_finished_s`` are forgotten). 0 for an empty span."""
        span = end - start
        if span <= 0:
            return 0.0
        held = 0.0
        for at, ticket_id in self._times.get(node_id, ()):
            if at >= end:  # sorted by dispatch time
                break
            held += (end - max(at, start)) * self._rows.get(ticket_id, 1)
        for at, finished, rows in reversed(self._finished.get(node_id, ())):
            if finished <= start:  # appended in finishing order: the rest finished earlier
                break
            if at < end:
                held += (min(finished, end) - max(at, start)) * rows
        return held / span

    def in_flight_at(self, node_id: str, t: float) -> int:
        """Rows of our requests the node had in hand at time ``t`` (a NodeState's timestamp,
        whose counts are rows): dispatched before it, and still in flight or finished after
        it; a request of ``n`` choices counts ``n``."""
        items = self._times.get(node_id, ())
        k = bisect.bisect_right(items, (t, float("inf"))) if items else 0
        n = sum(self._rows.get(ticket_id, 1) for _, ticket_id in items[:k])
        for at, finished, rows in reversed(self._finished.get(node_id, ())):
            if finished <= t:  # appended in finishing order: every older one finished before t
                break
            if at <= t:
                n += rows
        return n

    def _queue(self, node_id: str) -> list[_InFlight]:
        """Our requests in hand on the node (those with a prediction), in dispatch order."""
        return [
            e
            for _, ticket_id in self._times.get(node_id, ())
            if (e := self._entries.get(ticket_id)) is not None
        ]

    def slots_taken_without(self, node_id: str, prefix: Sequence[int], slots: int) -> bool:
        """Whether all ``slots`` of the node went to prompts without ``prefix`` (leading block
        hashes): at least that many of our requests in hand lack it, each sent after the last
        one with it left the node (among the recent finishes kept), and none in hand has it
        (one that does holds it, or writes it). False when a request in hand is not known."""
        want, n = list(prefix), len(prefix)
        if n == 0 or slots <= 0 or len(self._times.get(node_id, ())) < slots:
            return False
        last = -math.inf
        for finished, hashes in reversed(self._left.get(node_id, ())):
            if list(hashes[:n]) == want:
                last = finished
                break
        count = 0
        for at, ticket_id in self._times.get(node_id, ()):
            e = self._entries.get(ticket_id)
            if e is None or list(e.hashes[:n]) == want:
                return False
            count += at > last
        return count >= slots

    def first_token(self, ticket_id: int, at: float) -> None:
        entry = self._entries.get(ticket_id)
        if entry is not None and entry.first_token_at is None:
            entry.first_token_at = at

    def progress(self, ticket_id: int, tokens: int) -> None:
        """``tokens`` completion tokens of the ticket's reply have been relayed (a stream)."""
        entry = self._entries.get(ticket_id)
        if entry is not None and tokens > entry.tokens_seen:
            entry.tokens_seen = tokens

    def in_flight(self, node_id: str) -> int:
        return len(self._times.get(node_id, ()))

    def rows_in_flight(self, node_id: str) -> int:
        """Rows of this gateway's requests in flight on the node now (``n`` per request)."""
        return self._node_rows.get(node_id, 0)

    def typical(self, node_id: str, now: float, window_s: float = ARRIVAL_WINDOW_S) -> Work | None:
        """The typical request this gateway sent the node over the last ``window_s`` (at
        most ``keep_finished_s``): the median prefill work, decode steps and prompt of those
        sent; None when none was."""
        sent = self._sent.get(node_id)
        start = now - min(window_s, self.keep_finished_s)
        while sent and sent[0][0] < start:
            sent.popleft()
        if not sent:
            return None
        return Work(
            max(1.0, statistics.median(s[1] for s in sent)),
            statistics.median(s[2] for s in sent),
            context=statistics.median(s[3] for s in sent),
        )

    def since(self, node_id: str, t: float) -> int:
        """In-flight requests dispatched after ``t`` (not yet visible in a state taken at ``t``)."""
        items = self._times.get(node_id)
        if not items:
            return 0
        return len(items) - bisect.bisect_right(items, (t, float("inf")))

    def work(self, node_id: str, now: float, overrun_left: float = OVERRUN_LEFT) -> list[Work]:
        """What each request in flight on the node still has to do, oldest first, as far as
        its prediction and what was seen of it (its first token) tell; its context is its
        prompt and the tokens it is taken to have generated (a stream's, those relayed so far,
        and one more at most while it runs). Every reply's first token is seen
        (a stream's first chunk; a whole reply's headers, which nodes send with it), so one
        not seen yet is still before it, however late against its prediction (a token of its
        prompt left at least: its last chunk); one not finished is still decoding, however
        late. How far along a late one is, is not known:
        ``overrun_left`` of its prefill work or its decode steps is taken as left (at least one
        step)."""
        out: list[Work] = []
        held: dict[int, int] = {}  # block hash -> the first request in hand with it
        for e in self._queue(node_id):
            index = len(out)
            blocks, source = _shared(e.hashes, held)
            for h in e.hashes:
                held.setdefault(h, index)
            est = e.estimate
            elapsed = (now - e.dispatched_at) * 1000.0
            steps = max(0.0, e.output_tokens - 1.0)
            t_first = est.ttft_ms - est.rtt_ms
            prompt = float(est.prompt_tokens)
            if e.first_token_at is not None:
                since_first = (now - e.first_token_at) * 1000.0
                done = since_first / max(est.decode_ms_per_token, 1e-3)
                if e.tokens_seen:
                    # a stream: the tokens relayed after its first, and one more at most
                    done = min(max(done, e.tokens_seen - 1.0), float(e.tokens_seen), steps)
                elif done >= steps:  # past its predicted last token, not finished: still at it
                    done = steps * (1.0 - overrun_left)
                left = max(1.0, steps - done) if steps else 0.0
                out += [Work(0.0, left, context=prompt + 1.0 + steps - left)] * e.rows
            else:
                left = (t_first - elapsed) / max(est.own_prefill_ms, 1e-3)
                if left <= 0:  # past its predicted first token, none seen: still prefilling
                    left = overrun_left
                tokens = est.basis.prefill_work_tokens or float(est.uncached_tokens)
                started = left < 1.0
                beyond = blocks * BLOCK_SIZE - est.cached_tokens
                shared = None
                if beyond > 0 and not started:  # replayed afresh: what it may take, and from
                    tokens += est.reused_tokens
                    shared = SharedPrefix(source, beyond)
                # its last chunk is still to run, however late: at least one token of it (and
                # the step it rides: an eager pass on a GPU, 12-20 ms)
                prefill = max(min(1.0, tokens), tokens * min(1.0, left))
                out.append(Work(prefill, steps, started, prompt, shared))
                # its other choices decode beside it from its first token (one prefill)
                out += [Work(0.0, steps, True, prompt)] * (e.rows - 1)
        return out

    def shared_prefix(self, node_id: str, hashes: Sequence[int]) -> SharedPrefix | None:
        """The longest run of leading blocks of a new prompt (its block ``hashes``) that a
        request of ours in hand on the node has too, as ``SharedPrefix(index in
        :meth:`work`, its prompt tokens)``; None when none shares a block."""
        blocks, source = _shared(hashes, _holders(self._queue(node_id)))
        return SharedPrefix(source, float(blocks * BLOCK_SIZE)) if blocks else None
