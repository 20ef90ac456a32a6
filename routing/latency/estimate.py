"""One node's predicted timings for one request: a replay of its engine over the work in hand.

For one node and one request::

    ttft = rtt + overhead + queue wait (the step in flight, the requests ahead) + own prefill
    e2e  = ttft + decode steps at the batch and context the replay says they run at

Invariants:
- Predictions are finite and non-negative; a request computes at least one prompt token and
  is credited whole cached blocks only, as the engines do.
- Requests in hand are replayed in arrival order: each node orders its own queue.
- :class:`Estimate` is what callers read; :class:`Basis` is what the model's learning needs
  back from the prediction (it is carried along, never read by policies).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from routing.backlog import Arrivals, Replayed, SharedPrefix, Work, replay, replay_pair
from routing.blocks import BLOCK_SIZE, reusable_blocks
from routing.fleet.state import NodeState
from routing.latency.priors import ARRIVAL_WEIGHT

if TYPE_CHECKING:
    from routing.latency.rates import RateBook


@dataclass(frozen=True, slots=True)
class Basis:
    """What a prediction assumed, for learning from its outcome (private to the model)."""

    prefill_work_tokens: float = 0.0  # its prefill as uncached-token equivalents it computes
    mean_batch: float = 1.0  # mean rows of the decode steps it takes part in
    mean_context: float = 0.0  # mean tokens of context those steps attend to (all rows)
    step_ms: float = 0.0  # one decode step's own time at ``mean_batch`` (beyond: stalls)


@dataclass(frozen=True, slots=True)
class Estimate:
    """One node's predicted timings for one request (all times in ms)."""

    node_id: str
    rtt_ms: float
    queue_ms: float  # until it takes a slot
    prefill_ms: float  # from taking a slot to its first token
    ttft_ms: float
    decode_ms_per_token: float
    e2e_ms: float
    cached_tokens: int
    uncached_tokens: int
    batch: int = 1  # rows decoding alongside, itself included
    load: float = 0.0  # requests in hand (this one not counted) / slots
    own_prefill_ms: float = 0.0  # its own prompt's compute
    in_hand: int = 0  # requests taken to be ahead of it
    overhead_ms: float = 0.0  # beyond the engine and the RTT (in ``ttft_ms`` and ``e2e_ms``)
    stalled_others_ms: float = 0.0  # delay its prefill adds to the rows decoding beside it
    reused_tokens: float = 0.0  # prompt tokens taken from an earlier request's prefix in hand
    basis: Basis = Basis()

    @property
    def prompt_tokens(self) -> int:
        return self.cached_tokens + self.uncached_tokens


def _blend_decode(without: Replayed, held: Replayed, weight: float) -> Replayed:
    """``held`` (the replay with future arrivals) with its decode ``weight`` of the way from
    ``without``'s, geometrically: arrivals join after the first token, which both share."""
    d0 = max(without.last_token_ms - without.first_token_ms, 0.0)
    d1 = max(held.last_token_ms - held.first_token_ms, 0.0)
    decode = d0 ** (1.0 - weight) * d1**weight if d0 > 0 and d1 > 0 else d1
    return replace(
        held,
        last_token_ms=held.first_token_ms + decode,
        mean_batch=(1.0 - weight) * without.mean_batch + weight * held.mean_batch,
        mean_context=(1.0 - weight) * without.mean_context + weight * held.mean_context,
    )


def _delayed(r: Replayed, ms: float, queue: bool = True) -> Replayed:
    """``r`` with everything ``ms`` later (the queue wait too, unless ``queue`` is False)."""
    return replace(
        r,
        queue_ms=r.queue_ms + ms if queue else r.queue_ms,
        first_token_ms=r.first_token_ms + ms,
        last_token_ms=r.last_token_ms + ms,
    )


def predict(
    book: RateBook,
    node: NodeState,
    *,
    prompt_tokens: int,
    cached_tokens: int,
    expected_output_tokens: float,
    rtt_ms: float,
    extra_inflight: int = 0,
    ahead: Sequence[Work] | None = None,
    newcomer: Work | None = None,
    shared_prefix: SharedPrefix | None = None,
    choices: int = 1,
    prompt_cost: float = 1.0,
) -> Estimate:
    """Predict one request's timings on ``node`` from the rates in ``book``.

    ``cached_tokens``: what the prefix index says the node holds. ``ahead``: this gateway's
    work in hand there, in arrival order (``routing.ledger.DispatchLedger.work``);
    ``extra_inflight``: requests there ``ahead`` does not describe (other gateways'; without
    ``ahead``, the node's own counts), each taken as half a typical request's decode.
    ``newcomer``: the typical request sent there lately; the node is taken to stay at the
    population it holds now, a newcomer joining behind this request whenever one leaves.
    ``shared_prefix``: the leading blocks a request in ``ahead`` shares with this one; on a
    node with a prefix cache those beyond the credit are cached once that one has prefilled.
    ``choices``: its ``n``; the other choices decode beside it from its first token (one
    prefill: the cloud shares the prompt's blocks, the edge copies them between slots), as
    rows in hand, so its decode runs at their batch and they take slots.
    """
    blocks = min(cached_tokens // BLOCK_SIZE, reusable_blocks(prompt_tokens))
    cached = blocks * BLOCK_SIZE
    uncached = max(1, prompt_tokens - cached)
    shape = book.shape(node)
    if ahead is None:
        unknown = node.running + node.waiting + max(0, extra_inflight)
        work: list[Work] = []
    else:
        unknown = max(0, extra_inflight)
        work = list(ahead)
    reuse = node.prefix_cache
    shared = None
    if reuse and shared_prefix is not None and ahead is not None:
        beyond = shared_prefix.tokens - cached
        if beyond > 0:
            shared = SharedPrefix(shared_prefix.source + unknown, beyond)
    # what work in hand shares is counted from its index among what is replayed
    work = [
        w if w.shared is None
        else replace(w, shared=replace(w.shared, source=w.shared.source + unknown)
                     if reuse else None)
        for w in work
    ]  # fmt: skip
    if unknown:
        half = 0.5 * book.mean_output_tokens(node.id)
        typical = Work(0.0, half, context=book.mean_prompt_tokens(node.id) + half)
        work = [typical] * unknown + work
    out = max(1.0, expected_output_tokens)
    if choices > 1:
        work = work + [Work(0.0, out - 1.0, started=True, context=prompt_tokens)] * (choices - 1)
    if node.kv_blocks_total > 0 and work:
        need = math.ceil((prompt_tokens + out) / BLOCK_SIZE) - blocks
        if need > node.kv_blocks_total - node.kv_blocks_used:
            # no room in the KV cache: it starts when a request in hand finishes
            shape = replace(shape, slots=min(shape.slots, len(work)))
    # the cached tokens' cost as prefill work of the same rate (what replay schedules)
    work_tokens = (
        uncached * prompt_cost + cached * shape.cached_token_ms / shape.prefill_ms_per_token
    )
    new = Work(work_tokens, out - 1.0, context=prompt_tokens, shared=shared)
    if newcomer is not None:
        pair = replay_pair(shape, work, new, Arrivals(len(work) + 1, newcomer))
        r = _blend_decode(*pair, ARRIVAL_WEIGHT)
    else:
        r = replay(shape, work, new)
    work_tokens -= r.reused_tokens  # what it computes
    own_prefill = shape.prefill_fixed_ms + work_tokens * shape.prefill_ms_per_token
    # A prompt's last chunk is a forward pass: it reads every weight and the prompt's KV as a
    # decode step of one row does, however few its new tokens, so it takes at least that step.
    floor = shape.decode_step_ms(1, prompt_tokens)
    if own_prefill < floor:
        short = floor - (r.first_token_ms - r.queue_ms)
        if short > 0:
            r = _delayed(r, short, queue=False)
        own_prefill = floor
    # a busy engine takes a new request between steps: half the step in flight, on average
    if work:
        rows = work[: shape.slots]
        r = _delayed(r, 0.5 * shape.decode_step_ms(len(rows), sum(w.context for w in rows)))
    overhead = book.overhead_ms(node.id, idle=not work)
    rtt = max(0.0, rtt_ms) + overhead
    steps = out - 1.0
    per_token = (r.last_token_ms - r.first_token_ms) / steps if steps > 0 else 0.0
    step_ms = shape.decode_step_ms(r.mean_batch, r.mean_context)
    if per_token <= 0:
        per_token = shape.decode_step_ms(max(1, round(r.mean_batch)), r.mean_context)
    return Estimate(
        node_id=node.id,
        rtt_ms=rtt_ms,
        queue_ms=r.queue_ms,
        prefill_ms=r.first_token_ms - r.queue_ms,
        ttft_ms=rtt + r.first_token_ms,
        decode_ms_per_token=per_token,
        e2e_ms=rtt + r.last_token_ms,
        cached_tokens=cached,
        uncached_tokens=uncached,
        batch=max(1, round(r.mean_batch)),
        load=len(work) / shape.slots,
        own_prefill_ms=own_prefill,
        in_hand=len(work),
        overhead_ms=overhead,
        stalled_others_ms=r.stalled_others_ms,
        reused_tokens=r.reused_tokens,
        basis=Basis(
            prefill_work_tokens=work_tokens,
            mean_batch=r.mean_batch,
            mean_context=r.mean_context,
            step_ms=step_ms,
        ),
    )
