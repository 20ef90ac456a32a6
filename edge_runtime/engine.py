"""``EdgeEngine``: the edge tier's :class:`routing.engine.Engine` over an ONNX decoder graph.

The asyncio side only queues requests and relays events; the ONNX Runtime loop runs in the
scheduler's own thread (``edge_runtime.scheduler``), so the event loop never blocks on a run.

Build one from a model name or folder (exported and cached on first use)::

    engine = EdgeEngine.from_model("smollm2-135m-instruct", variant="int8")
    await engine.start()

or from an exported graph folder, ours or one exported elsewhere in the same layout::

    engine = EdgeEngine("path/to/graph-folder", EdgeEngineConfig(slots=4, threads=2))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from edge_runtime import openvino
from edge_runtime.decoder import Decoder
from edge_runtime.graph_info import GRAPH_FILE, ExportMeta, GraphInfo, read_graph_info
from edge_runtime.huge_pages import CollapseReport, anonymous_ranges, collapse_new
from edge_runtime.providers import (
    ProviderChoice,
    ProviderSpec,
    SessionFactory,
    create_session,
    first_offered,
    session_options,
)
from edge_runtime.scheduler import SlotScheduler
from edge_runtime.slot_cache import SlotCache
from edge_runtime.slot_request import SlotRequest
from routing.blocks import BlockEvents, model_seed
from routing.engine import (
    EngineError,
    EngineStats,
    EngineTraits,
    GenerationRequest,
    QueueFull,
    RequestTooLong,
    SamplingParams,
    TokenEvent,
)
from routing.fleet.state import Capability
from routing.handoff import Handoff
from routing.token_stream import relay_events

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 2048


class InvalidRequest(EngineError):
    """The request can never run (empty prompt, token id outside the vocabulary): HTTP 400."""


@dataclass(frozen=True)
class EdgeEngineConfig:
    """How an edge engine runs its graph.

    ``context`` is the KV capacity per slot (default: the model's context, at most 2048); the
    KV cache takes ``slots * context`` tokens of memory, allocated and committed at start;
    ``providers`` is the execution-provider preference (default: NPUs first, then CPU);
    ``threads`` is ONNX Runtime's intra-op thread count (default: CPUs available, at most 8);
    ``huge_pages``: back the session's memory and the KV cache with transparent huge pages
    once loaded, where the kernel allows (``edge_runtime.huge_pages``);
    ``prefix_reuse``: a finished request's KV stays in its slot, a later request whose leading
    16-token blocks a slot holds reuses them, and a request copies the blocks of its prompt
    another slot holds before each of its chunks (``edge_runtime.slot_cache``); off: no reuse,
    no block events, no held blocks;
    ``prefill_stall_ratio``: while answers decode, a prompt is prefilled in chunks of at most
    this many decode steps' time, so a later prompt slows each of their tokens by at most
    ``1 + ratio`` (``routing.prefill_budget``; None: full ``prefill_chunk`` chunks always);
    ``prefix_first``: with ``prefix_reuse``, a waiting request that reuses several more blocks
    than those ahead of it is admitted first, passing each at most this many times (0: strict
    priority-then-arrival order; ``edge_runtime.admission``).
    """

    slots: int = 4
    context: int | None = None
    max_waiting: int = 16
    prefill_chunk: int = 256
    threads: int | None = None
    providers: tuple[str | ProviderSpec, ...] | None = None
    spin: bool = True
    warmup: bool = True
    huge_pages: bool = True
    prefix_reuse: bool = True
    prefill_stall_ratio: float | None = 1.0
    prefix_first: int = 4


class EdgeEngine:
    """An :class:`routing.engine.Engine` of kind ``"edge"``, and a
    :class:`routing.engine.PrefixCacheEngine` (with ``prefix_reuse``): block hashes are
    seeded by ``model_id`` (the export's model identity; for a graph exported elsewhere the
    folder name, or what the caller passes), as the gateway and the cloud engine seed them."""

    kind = "edge"

    def __init__(
        self,
        graph_dir: str | os.PathLike[str],
        config: EdgeEngineConfig | None = None,
        *,
        model_id: str | None = None,
        session_factory: SessionFactory | None = None,
    ) -> None:
        self.folder = Path(graph_dir)
        self.config = config or EdgeEngineConfig()
        self.meta = ExportMeta.read(self.folder)
        graph_file = self.meta.graph_file if self.meta else GRAPH_FILE
        self.graph_path = self.folder / graph_file
        if not self.graph_path.is_file():
            raise FileNotFoundError(f"no {graph_file} in {self.folder}")
        self.info: GraphInfo = read_graph_info(self.graph_path)
        model_ctx = self.meta.context_length if self.meta else self.info.context_length
        if self.config.context and model_ctx and self.config.context > model_ctx:
            raise ValueError(f"context {self.config.context} exceeds the model's {model_ctx}")
        self.max_context = self.config.context or min(model_ctx or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
        self.model_id = model_id or (self.meta.model_identity if self.meta else self.folder.name)
        self.vocab_size = self.info.vocab_size or (self.meta.vocab_size if self.meta else None)
        self._session_factory = session_factory
        self.provider: ProviderChoice | None = None
        self.kv_bytes = 0  # KV cache memory, known once started (slots x context x per token)
        self.huge_pages = CollapseReport(note="off" if not self.config.huge_pages else "unstarted")
        self.weights = self.meta.variant if self.meta else ""  # what stats() reports
        self._scheduler: SlotScheduler | None = None
        self._handoff: Handoff | None = None  # token events to the consumers' loops
        self._start_lock = asyncio.Lock()

    @classmethod
    def from_model(
        cls,
        model: str | os.PathLike[str],
        variant: str = "auto",
        attention: str | None = None,
        config: EdgeEngineConfig | None = None,
        **kwargs: object,
    ) -> EdgeEngine:
        """Export ``model`` (a store name or HF folder) if not cached, then build the engine;
        ``variant`` "auto" is the quality gate's pick for this CPU (``edge_runtime.quality_gate``);
        ``attention`` None is the graph form the first offered provider runs whole
        (``edge_runtime.openvino.attention_for``: ``concat`` on OpenVINO, else ``gqa``).

        Blocking: the first export of a model takes about a minute (torch is imported then), the
        first quality gate on a CPU a few minutes more.
        """
        from edge_runtime.export import ensure_export

        verdict = ""
        if variant == "auto":
            from edge_runtime.quality_gate import choose_variant

            gate = choose_variant(model, threads=(config or EdgeEngineConfig()).threads)
            variant, verdict = gate.chosen, f"quality gate: {gate.summary()}"
        if attention is None:
            providers = (config or EdgeEngineConfig()).providers
            attention = openvino.attention_for(first_offered(providers))
        graph = ensure_export(model, variant, attention)
        engine = cls(graph.folder, config, **kwargs)  # type: ignore[arg-type]
        engine.weights = verdict or variant
        return engine

    @property
    def tokenizer_dir(self) -> Path:
        """Folder with tokenizer.json and the chat template (the export copies them)."""
        return (self.folder / (self.meta.tokenizer_dir if self.meta else ".")).resolve()

    @property
    def device(self) -> str:
        """What the session really runs on ("CPU", "OpenVINO:CPU", ...), once started."""
        if self.provider is None:
            return "unstarted"
        return self.provider.label

    @property
    def prefix_reuse(self) -> bool:
        """Whether requests reuse kept prefixes: configured, and not off for a stateful
        compile (its KV cache lives inside the compiled model)."""
        stateful = self.provider is not None and self.provider.stateful
        return self.config.prefix_reuse and not stateful

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        async with self._start_lock:
            if self._scheduler is not None:
                return
            self._scheduler = await asyncio.to_thread(self._load)
            self._handoff = Handoff("edge-engine-handoff")
            self._scheduler.start()

    def _load(self) -> SlotScheduler:
        cfg = self.config
        t0 = time.perf_counter()
        kwargs = {} if self._session_factory is None else {"session_factory": self._session_factory}
        before = anonymous_ranges(min_resident=0.0) if cfg.huge_pages else []
        session, self.provider = create_session(
            self.graph_path,
            cfg.providers,
            options_factory=lambda: session_options(cfg.threads, cfg.spin),
            **kwargs,  # type: ignore[arg-type]
        )
        info = self.info
        if self.provider.active == openvino.OPENVINO:
            info = openvino.decoder_info(info)
        decoder = Decoder(session, info, cfg.slots, self.max_context)
        cache = None
        if self.prefix_reuse:
            cache = SlotCache(cfg.slots, model_seed(self.model_id), self.max_context - 1)
        scheduler = SlotScheduler(
            decoder,
            cfg.max_waiting,
            cfg.prefill_chunk,
            cache,
            stall_ratio=cfg.prefill_stall_ratio,
            prefix_first=cfg.prefix_first,
        )
        if cfg.warmup:
            _warm_up(decoder, scheduler)
        self.kv_bytes = decoder.kv_bytes
        if cfg.huge_pages:  # after the warm-up: its runs allocate ONNX Runtime's buffers too
            self.huge_pages = collapse_new(before)
        log.info(
            "edge engine %s: %s, %d slots x %d tokens (KV %.0f MB), huge pages %.0f MB%s, "
            "loaded in %.1f s",
            self.model_id,
            self.provider.label,
            cfg.slots,
            self.max_context,
            decoder.kv_bytes / 1e6,
            self.huge_pages.collapsed_mb,
            f" ({self.huge_pages.note})" if self.huge_pages.note else "",
            time.perf_counter() - t0,
        )
        return scheduler

    async def shutdown(self) -> None:
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            await asyncio.to_thread(scheduler.stop)
        handoff, self._handoff = self._handoff, None
        if handoff is not None:  # after the scheduler: its last events are delivered
            await asyncio.to_thread(handoff.close)

    # --- requests -------------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        n = len(request.prompt_token_ids)
        if n == 0:
            raise InvalidRequest("empty prompt")
        if self.vocab_size is not None:
            ids = request.prompt_token_ids
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise InvalidRequest(f"token ids must lie in [0, {self.vocab_size})")
        wanted = n + request.sampling.max_tokens
        if wanted > self.max_context:
            raise RequestTooLong(
                f"prompt ({n} tokens) plus max_tokens ({request.sampling.max_tokens}) is "
                f"{wanted} tokens, over this node's context of {self.max_context}"
            )
        scheduler = self._require_started()
        if scheduler.full():
            raise QueueFull("all slots are busy and the queue is full", self._retry_after())

    def _retry_after(self) -> float:
        snap = self._require_started().snapshot()
        step_s = (snap.decode_ms_per_step or 50.0) / 1e3
        return float(min(60.0, max(0.1, snap.soonest_free_tokens * step_s)))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.check(request)
        scheduler = self._require_started()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        handoff = self._handoff
        assert handoff is not None  # started with the scheduler

        def emit(event: TokenEvent) -> None:
            handoff.put(loop, queue.put_nowait, event)

        n = len(request.prompt_token_ids)
        budget = min(request.sampling.max_tokens, self.max_context - n)
        scheduler.submit(SlotRequest(request, emit, budget))
        events = relay_events(
            queue, on_abandon=lambda: scheduler.cancel(request.request_id, notify=False)
        )
        async with contextlib.aclosing(events):  # leaving early ends it at once
            async for event in events:
                yield event

    async def abort(self, request_id: str) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel(request_id)

    def stats(self) -> EngineStats:
        cfg, reuse = self.config, self.prefix_reuse
        traits = EngineTraits(
            device=self.device,
            max_batch=cfg.slots,
            prefix_cache=reuse,
            prefix_catch_up=reuse,
            prefix_in_slots=reuse,
            weights=self.weights,
            prefill_chunk=cfg.prefill_chunk,
            prefill_chunk_decoding=cfg.prefill_chunk,
            # grammar masks and logprobs: numpy over the logits ORT returns
            capabilities=list(Capability.ALL),
            max_n=cfg.slots,  # each choice takes a slot
        )
        if self._scheduler is None:
            return EngineStats(traits, 0, 0, 0, 0, 0.0, 0.0)
        snap = self._scheduler.snapshot()
        traits.prefill_chunk = snap.prefill_chunk
        traits.prefill_chunk_decoding = snap.prefill_chunk_decoding
        return EngineStats(
            traits=traits,
            running=snap.running,
            waiting=snap.waiting,
            kv_blocks_used=snap.kv_blocks_used,
            kv_blocks_total=snap.kv_blocks_total,
            prefill_tokens_per_s=snap.prefill_tokens_per_s,
            decode_ms_per_token=snap.decode_ms_per_step,
            prefix_hit_rate=snap.prefix_hit_rate,
        )

    def drain_block_events(self) -> BlockEvents:
        """Block hashes the slots' kept KV stored and removed since the last call
        (thread-safe, latest wins per hash); empty when ``prefix_reuse`` is off."""
        scheduler = self._scheduler
        if scheduler is None or scheduler.cache is None:
            return BlockEvents()
        return scheduler.cache.drain_events()

    def held_blocks(self) -> list[int]:
        """Every block hash the slots hold now (a snapshot for a fleet index that starts
        over); the events drained later move it forward. [] when ``prefix_reuse`` is off."""
        scheduler = self._scheduler
        return [] if scheduler is None else scheduler.held_blocks()

    def _require_started(self) -> SlotScheduler:
        if self._scheduler is None:
            raise RuntimeError("EdgeEngine.start() has not been awaited")
        return self._scheduler


def _warm_up(decoder: Decoder, scheduler: SlotScheduler, prompt_len: int = 16) -> None:
    """Run a short prefill and decode step twice (the first ORT runs allocate), and seed the
    rate estimates with the second run's timings. Slot 0's cache is overwritten later."""
    import numpy as np

    prompt = [0] * min(prompt_len, decoder.context - 2)
    for _ in range(2):
        t0 = time.perf_counter()
        decoder.prefill(0, prompt, 0)
        t1 = time.perf_counter()
        one = np.array([0], np.int64)
        decoder.decode(one, np.array([len(prompt)], np.int64), np.array([True]))
        t2 = time.perf_counter()
    scheduler.prefill_tps.add(len(prompt) / max(t1 - t0, 1e-9))
    scheduler.decode_ms.add((t2 - t1) * 1e3)


def greedy(max_tokens: int, stop_token_ids: Sequence[int] = ()) -> SamplingParams:
    """Greedy sampling parameters (a convenience for tests and benchmarks)."""
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, stop_token_ids=tuple(stop_token_ids)
    )
