"""The naive twin of :func:`routing.backlog.replay`: the oracle its tests compare against (and
the peer ``bench/decision_cost.py`` times it against)."""

from __future__ import annotations

from collections.abc import Sequence

from routing.backlog import (
    Arrivals,
    EngineShape,
    Replayed,
    Work,
    _Req,
    _req,
    _requests,
    _run_chunk,
    _run_step_chunks,
    _take_slot,
)


def replay_literal(
    shape: EngineShape,
    ahead: Sequence[Work],
    new: Work,
    max_loops: int = 4096,
    arrivals: Arrivals | None = None,
) -> Replayed:
    """The engine loop of :func:`routing.backlog.replay` run literally, one pass over the rows
    for every step. Work with nothing left is dropped before it takes a slot, as ``replay``
    does."""
    waiting, target = _requests(shape, ahead, new)
    waiting.append(target)
    waiting.reverse()  # pop() takes the oldest
    running: list[_Req] = []
    slots = max(1, shape.slots)
    t = 0.0
    queue_ms = first = -1.0
    row_steps = steps = stall = ctx_steps = 0.0

    def result(last: float) -> Replayed:
        if steps <= 0:
            return Replayed(queue_ms, first, last, 1.0, stall, reused_tokens=target.reused)
        return Replayed(
            queue_ms, first, last, row_steps / steps, stall, ctx_steps / steps, target.reused
        )

    def decode(rows: list[_Req], k: float) -> None:
        """``k`` steps of ``rows``: each attends to its context, one token more each step."""
        nonlocal t, row_steps, steps, ctx_steps
        ctx = sum(k * r.ctx + k * (k - 1.0) / 2.0 for r in rows)
        t += k * shape.decode_step_ms(len(rows)) + shape.decode_ms_per_context_token * ctx
        for r in rows:
            r.steps -= k
            r.ctx += k
        if target in rows:
            row_steps += k * len(rows)
            ctx_steps += ctx
            steps += k

    for _ in range(max_loops):
        if arrivals is not None and first >= 0:
            for _ in range(arrivals.population - len(waiting) - len(running)):
                waiting.insert(0, _req(arrivals.work))
        while waiting and len(running) < slots:
            r = waiting.pop()
            _take_slot(r, shape.catch_up)
            if r.new:
                queue_ms = t
            running.append(r)
        pre = next((r for r in running if r.prefill > 0), None)
        if pre is not None and shape.mixed_steps:
            rows = [r for r in running if r.prefill <= 0 and r.steps > 0]
            prompts = (r for r in running if r.prefill > 0)
            ms, own, finished = _run_step_chunks(prompts, shape, len(rows))
            t += ms
            if own > 0:
                stall += own * len(rows)
            if rows:
                decode(rows, 1.0)
                if target in rows and target.steps <= 0:
                    return result(t)
            if target in finished:
                first = t
                if target.steps <= 0:
                    return result(first)
            running = [r for r in running if r.prefill > 0 or r.steps > 0]
            continue
        if pre is not None:
            rows_n = sum(1 for r in running if r.prefill <= 0 and r.steps > 0)
            ms = _run_chunk(pre, shape, shape.chunk(rows_n))
            t += ms
            if pre.new:
                stall += ms * rows_n
            if pre.prefill <= 0 and pre.new:
                first = t
                if target.steps <= 0:
                    return result(first)
        decoding = [r for r in running if r.prefill <= 0 and r.steps > 0 and r is not pre]
        if pre is not None and pre.prefill <= 0 and pre.steps > 0:
            decoding.append(pre)  # its first token came out of the prefill; it decodes now
        if not decoding:
            running = [r for r in running if r.prefill > 0 or r.steps > 0]
            if pre is None and not waiting:
                break
            continue
        # With nothing left to prefill, identical steps repeat until the next finish: jump.
        k = 1.0
        if not any(r.prefill > 0 for r in running) and pre is None:
            k = max(1.0, min(r.steps for r in decoding))
        decode(decoding, k)
        if first >= 0 and target.steps <= 0:
            return result(t)
        running = [r for r in running if r.prefill > 0 or r.steps > 0]
    # Out of loops (a pathological backlog): finish the target alone from here.
    if first < 0:
        first = t + target.prefill * shape.prefill_ms_per_token + shape.prefill_fixed_ms
    rows_n = len(running) or 1
    last = first + target.steps * shape.decode_step_ms(rows_n, rows_n * target.ctx)
    return Replayed(
        max(queue_ms, 0.0), first, last, float(rows_n), stall, reused_tokens=target.reused
    )
