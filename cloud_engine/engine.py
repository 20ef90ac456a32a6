"""``CloudEngine``: the async :class:`routing.engine.Engine` over :class:`EngineCore`.

The core runs in one dedicated thread (the *step thread*) that owns it: requests and aborts
reach it through an inbox, and each step's token events go back to the asyncio loop of each
request in one callback per loop per step, scheduled through a :class:`routing.handoff.Handoff`
(so the step thread does not wait for the consumers' Python before its next step).

Invariants:
- Only the step thread touches the core's mutable state (scheduler, blocks, runner); other
  threads read counters only (``stats``, ``check``).
- Leaving a ``generate`` iterator early (``aclose``, task cancelled, client gone) queues an
  abort; the step thread releases the request's blocks at the next step boundary, before it
  plans another batch.
- ``abort(request_id)`` ends the request's stream with ``FinishReason.ABORT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from cloud_engine.block_manager import BlockEvents
from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.outputs import SeqOutput
from cloud_engine.sequence import Sequence
from routing.choices import MAX_CHOICES
from routing.engine import (
    EngineStats,
    EngineTraits,
    FinishReason,
    GenerationRequest,
    QueueFull,
    TokenEvent,
    TokenLogprob,
)
from routing.fleet.state import Capability
from routing.handoff import Handoff
from routing.token_stream import relay_events

log = logging.getLogger(__name__)

_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[TokenEvent]"]


def _event(
    seq: Sequence,
    tokens: list[int],
    reason: FinishReason | None,
    logprobs: list[TokenLogprob] | None = None,
) -> TokenEvent:
    """The event of ``tokens``; the request's first carries its prompt logprobs."""
    prompt_lps = None
    if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
        seq.prompt_logprobs_sent = True
        prompt_lps = seq.prompt_logprobs
    return TokenEvent(
        request_id=seq.request_id,
        token_ids=tokens,
        completion_tokens=seq.num_output,
        prompt_tokens=seq.num_prompt,
        cached_tokens=max(seq.num_cached, 0),
        finish_reason=reason,
        prefill_ms=seq.prefill_ms,
        logprobs=logprobs,
        prompt_logprobs=prompt_lps,
    )


class CloudEngine:
    """The cloud tier's engine (kind ``"cloud"``). Build it with :meth:`from_model`."""

    kind = "cloud"

    def __init__(self, core: EngineCore, parallel: Mapping[str, object] | None = None) -> None:
        self.core = core
        self.parallel = dict(parallel or {})  # a parallel engine's traits: tp, pp, devices
        self.model_id = core.identity
        self.max_context = core.max_context
        self._inbox: deque[tuple[str, object]] = deque()
        self._pending_adds = 0
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._handoff: Handoff | None = None  # token events to the consumers' loops
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_model(
        cls,
        model: str | os.PathLike[str],
        device: str = "cpu",
        *,
        kv_memory_bytes: int | None = None,
        kv_memory_fraction: float | None = None,
        config: EngineConfig | None = None,
    ) -> CloudEngine:
        """Load a model (a store name or an HF folder) onto ``device`` and size the KV pool
        from the budget: ``kv_memory_bytes``, else (CUDA) ``kv_memory_fraction`` of the free
        device memory once the weights are loaded."""
        from cloud_engine.model.loader import load_model
        from routing.model_store import resolve

        info = resolve(model)
        cfg = replace(config or EngineConfig(), device=device)
        if kv_memory_bytes is not None:
            cfg = replace(cfg, kv_memory_bytes=kv_memory_bytes)
        if kv_memory_fraction is not None:
            cfg = replace(cfg, kv_memory_fraction=kv_memory_fraction)
        cfg = cfg.resolved()
        assert cfg.dtype is not None
        from cloud_engine.parallel.moe import read_config

        if read_config(info.path)[1] is not None:  # mixture of experts: the parallel loader
            from cloud_engine.parallel.build import single_process_core

            return cls(single_process_core(info.path, info.identity, cfg))
        weights = load_model(Path(info.path), dtype=cfg.dtype, device=device)
        return cls(EngineCore(weights, info.identity, cfg))

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        warm = getattr(self.core.runner, "capture_graphs", None)
        if warm is not None:
            await asyncio.get_running_loop().run_in_executor(None, warm)
        self._stop = False
        self._handoff = Handoff("cloud-engine-handoff")
        self._thread = threading.Thread(target=self._run, name="cloud-engine-step", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        await asyncio.get_running_loop().run_in_executor(None, self._stop_ranks)
        for rid in list(self._streams):
            seq = self.core.abort(rid)
            if seq is not None:
                self._deliver_threadsafe([(rid, _event(seq, [], FinishReason.ABORT))])
        handoff, self._handoff = self._handoff, None
        if handoff is not None:  # after the last events: they are delivered
            await asyncio.get_running_loop().run_in_executor(None, handoff.close)

    def _stop_ranks(self) -> None:
        """A parallel engine: the other ranks stop (STOP through the pipe), then their
        processes are reaped; a rank exiting now is expected, not fatal."""
        runner = self.core.runner
        local = getattr(runner, "local_ranks", None)
        sup = getattr(local, "supervisor", None)
        if sup is not None:
            sup.expect_exits()
        drain = getattr(self.core, "drain", None)  # pipeline batches still in flight
        stop = getattr(runner, "stop", None)
        if stop is not None:
            try:
                if drain is not None:
                    drain()
                stop()
            except Exception:
                log.exception("stopping the other ranks failed")
        if sup is not None:
            for ended in sup.stop():
                log.info(ended.describe())

    # -- requests --------------------------------------------------------------------------
    def check(self, request: GenerationRequest) -> None:
        self.core.check(request)
        sched = self.core.scheduler
        # requests not yet running take the free running places first, then the queue
        free = max(0, self.core.config.max_running - sched.num_running)
        waiting = max(0, sched.num_waiting + self._pending_adds - free)
        if waiting >= self.core.config.max_waiting:
            raise QueueFull(f"{waiting} requests waiting", retry_after_s=self.core.retry_after_s())

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.check(request)
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"duplicate request id {rid}")
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), queue)
        self._submit("add", request)
        events = relay_events(
            queue,
            on_abandon=lambda: self._submit("abort", rid),
            on_exit=lambda: self._streams.pop(rid, None),
        )
        async with contextlib.aclosing(events):  # leaving early ends it at once
            async for ev in events:
                yield ev

    async def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    def _submit(self, kind: str, payload: object) -> None:
        with self._lock:
            self._inbox.append((kind, payload))
            if kind == "add":
                self._pending_adds += 1
        self._wake.set()

    # -- observation -----------------------------------------------------------------------
    def _capabilities(self) -> list[str]:
        """Grammars where its runner applies their masks (every runner does); logprobs from the
        single-process runners (not the parallel ones yet)."""
        caps = [Capability.GRAMMAR] if self.core.runner_samples_grammar else []
        if not self.parallel:
            caps += Capability.LOGPROB_KINDS
        return caps

    def stats(self) -> EngineStats:
        c = self.core
        traits = EngineTraits(
            device=str(c.pool.device),
            max_batch=c.scheduler.config.max_running,
            prefix_cache=True,
            kv_dtype=c.pool.spec.kv_dtype,
            prefill_chunk=c.scheduler.config.max_tokens_per_step,  # one step's token budget
            prefill_chunk_decoding=c.chunk_beside_decode() or 0,  # its prompt tokens beside rows
            capabilities=self._capabilities(),
            # the choices share the prompt's blocks; those beyond the running rows wait
            max_n=min(MAX_CHOICES, c.scheduler.config.max_running + c.config.max_waiting),
            **self.parallel,
        )
        return EngineStats(
            traits=traits,
            running=c.scheduler.num_running,
            waiting=c.scheduler.num_waiting + self._pending_adds,
            kv_blocks_used=c.blocks.num_used,
            kv_blocks_total=c.blocks.num_blocks,
            prefill_tokens_per_s=c.counters.prefill_tok_s.value,
            decode_ms_per_token=c.counters.decode_ms.value,
            prefix_hit_rate=c.prefix_hit_rate,
            step_cost=c.step_fit.latest,
        )

    def drain_block_events(self) -> BlockEvents:
        """Prefix-cache hashes stored and removed since the last call (thread-safe); the node
        app forwards them to ``FleetStore.record_blocks(node_id, ev.stored, ev.removed)``."""
        return self.core.drain_block_events()

    def held_blocks(self) -> list[int]:
        """Every block hash the prefix cache holds now (a snapshot for a fleet index that
        starts over); events drained later only move it forward."""
        return self.core.held_blocks()

    # -- the step thread -------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        idle = getattr(core.runner, "idle", None)
        on_error = getattr(core.runner, "on_error", None)
        with torch.inference_mode():
            while not self._stop:
                self._drain_inbox()
                if not core.has_work():
                    if idle is not None:  # a parallel runner keeps its ranks' waits alive
                        idle()
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    outs = core.step()
                except Exception as exc:  # a failed step must not strand its requests
                    log.exception("engine step failed; aborting the running requests")
                    if on_error is not None:  # a parallel engine with a rank gone: fatal
                        on_error(exc)
                    outs = [
                        SeqOutput(s, [], FinishReason.ABORT)
                        for s in list(core.seqs.values())
                        if core.abort(s.request_id) is not None
                    ]
                self._deliver_threadsafe(
                    [
                        (
                            o.seq.request_id,
                            _event(o.seq, o.new_token_ids, o.finish_reason, o.logprobs),
                        )
                        for o in outs
                    ]
                )

    def _drain_inbox(self) -> None:
        with self._lock:
            cmds = list(self._inbox)
            self._inbox.clear()
        aborted: list[tuple[str, TokenEvent]] = []
        for kind, payload in cmds:
            if kind == "add":
                req = payload
                assert isinstance(req, GenerationRequest)
                with self._lock:
                    self._pending_adds -= 1
                if req.request_id in self._streams:
                    self.core.add(req)
            else:
                rid = str(payload)
                seq = self.core.abort(rid)
                if seq is not None:
                    aborted.append((rid, _event(seq, [], FinishReason.ABORT)))
        if aborted:
            self._deliver_threadsafe(aborted)

    def _deliver_threadsafe(self, events: list[tuple[str, TokenEvent]]) -> None:
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]
        ] = {}
        for rid, ev in events:
            stream = self._streams.get(rid)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], ev))
        handoff = self._handoff
        assert handoff is not None  # set while the step thread runs and until shutdown ends
        for loop, items in by_loop.items():
            handoff.put(loop, _put_all, items)


def _put_all(items: list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]) -> None:
    for q, ev in items:
        q.put_nowait(ev)
