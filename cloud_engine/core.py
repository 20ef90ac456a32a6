"""The synchronous engine core: block manager + scheduler + model runner, one step at a time.

:class:`EngineCore` is single-threaded (the async :class:`cloud_engine.engine.CloudEngine`
drives it from its own thread). One :meth:`EngineCore.step` schedules a batch, runs it,
commits the written KV (publishing newly full blocks to the prefix cache), appends the sampled
tokens and retires finished sequences, whose blocks are released before ``step`` returns.

Token accounting: a stop token ends a sequence with ``FinishReason.STOP`` and is *not* part of
its output (as in ``cloud_engine.model.dense.generate``).

Overlap (``EngineConfig.overlap``): when every running sequence sampled in the step just
launched and nobody waits, the core launches the next decode step *before* reading this one's
tokens, its input ids fed on the device from the tokens not yet read (:class:`runner.Feed`), so
the host's commit and planning hide behind the device's work. The look-ahead step is exactly
the batch the scheduler would plan (every running sequence, one token, same order), minus the
sequences that end by length; a sequence that turns out to stop on a stop token (or is aborted)
still runs in it, and its result is dropped. A look-ahead batch with a grammar row is launched
pending (``runner.Launched.pending``): its forward pass is enqueued, its masks and sampling only
at the start of the next step, once this step's tokens are committed to the grammar states, so
the masks are computed while the device runs that forward pass. It never preempts: if the pool
cannot hold every next token, the core falls back to a planned step. Blocks and rows a dropped sequence released
are safe to reuse at once: every later write to them is enqueued after the look-ahead step.

Per-request failures stay per-request: :meth:`EngineCore.check` refuses token ids outside the
model's vocabulary (:class:`InvalidRequest`, before anything is queued), and :meth:`EngineCore.add`
prepares the request's sampling state (``cloud_engine.sampler.prepare``: parameters checked,
generator made) before the request joins the scheduler. A request that fails there never runs:
the next :meth:`EngineCore.step` returns it finished with ``FinishReason.ABORT``, and the batch
goes on. Only a failure of a step's own work (model, device) fails the step.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from cloud_engine.block_manager import BlockEvents, BlockManager
from cloud_engine.config import EngineConfig
from cloud_engine.kv_pool import KVPool, KVSpec, budget_bytes_for, sized_pool
from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.runner import Feed, Launched, ModelRunner, TorchRunner
from cloud_engine.sampler import prepare
from cloud_engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler, SchedulerConfig
from cloud_engine.sequence import SeqStatus, Sequence
from routing.blocks import model_seed
from routing.engine import (
    EngineError,
    FinishReason,
    GenerationRequest,
    QueueFull,
    RequestTooLong,
    TokenLogprob,
)
from routing.ewma import Ewma
from routing.prefill_budget import chunk_beside_decode
from routing.step_cost import StepCostFit

if TYPE_CHECKING:
    from cloud_engine.parallel.model import ShardedLlama

log = logging.getLogger(__name__)


class InvalidRequest(EngineError):
    """The request can never run (token ids outside the model's vocabulary): HTTP 400."""


@dataclass(slots=True)
class SeqOutput:
    """What one step produced for one sequence."""

    seq: Sequence
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, where the request asks


@dataclass(slots=True)
class _Launch:
    batch: ScheduledBatch
    launched: Launched
    t0: float  # perf_counter just before the launch


@dataclass(slots=True)
class CoreCounters:
    """Totals since start; rates are EWMAs of per-step measurements."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_prompt_tokens: int = 0  # of which served from the prefix cache
    prefill_tokens: int = 0  # prompt tokens actually computed (recompute included)
    recomputed_tokens: int = 0  # output tokens recomputed after a preemption
    decode_tokens: int = 0  # tokens sampled
    preemptions: int = 0
    ahead_steps: int = 0  # decode steps launched before the previous step's tokens were read
    prefill_tok_s: Ewma = field(default_factory=Ewma)
    decode_ms: Ewma = field(default_factory=Ewma)
    prefill_ms_per_token: Ewma = field(default_factory=Ewma)  # a prompt token's share of a step
    peak_blocks_used: int = 0
    kv_waste_at_peak: float = 0.0  # allocated slots holding no token / allocated slots


_Lps = list[TokenLogprob | None] | None


def _live(
    batch: ScheduledBatch, sampled: list[int], lps: _Lps = None
) -> tuple[ScheduledBatch, list[int], _Lps]:
    """The items of ``batch`` whose sequence still runs, and their sampled tokens and
    logprobs (a look-ahead step may carry sequences that stopped or were aborted after it was
    launched)."""
    if all(it.seq.status is SeqStatus.RUNNING for it in batch.items):
        return batch, sampled, lps
    items: list[ScheduledSeq] = []
    tokens: list[int] = []
    kept: list[TokenLogprob | None] = []
    k = 0
    for it in batch.items:
        if it.samples:
            k += 1
        if it.seq.status is SeqStatus.RUNNING:
            items.append(it)
            if it.samples:
                tokens.append(sampled[k - 1])
                kept.append(lps[k - 1] if lps is not None else None)
    return ScheduledBatch(items), tokens, (kept if lps is not None else None)


def describe_pool(pool: KVPool) -> str:
    """One line on the KV pool: storage, blocks, tokens and bytes (logged at start-up)."""
    spec = pool.spec
    scales = " with a scale per token and head" if spec.scaled else ""
    return (
        f"{spec.kv_dtype}{scales}, {pool.num_blocks:,} blocks of {spec.block_size} tokens = "
        f"{pool.capacity_tokens:,} tokens, {pool.nbytes / 2**30:.2f} GiB"
    )


class EngineCore:
    def __init__(
        self,
        model: LlamaForCausalLM | ShardedLlama,
        identity: str,
        config: EngineConfig = EngineConfig(),
        runner: ModelRunner | None = None,
        pool: KVPool | None = None,
    ) -> None:
        """``runner`` None: the CUDA runner on a CUDA device, else the torch runner, over
        ``pool`` (None: one sized from the config's budget)."""
        self.config = cfg = config.resolved()
        self.model = model
        self.identity = identity
        self.seed = model_seed(identity)
        mc = model.config
        self.max_context = cfg.max_context or mc.max_position_embeddings
        self.vocab_size: int = mc.vocab_size
        device = torch.device(cfg.device)
        if cfg.threads and device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        kv_dtype = next(model.parameters()).dtype  # the KV cache holds what the model computes
        spec = KVSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, kv_dtype)
        if runner is None:
            if pool is None:
                budget = budget_bytes_for(device, cfg.kv_memory_fraction, cfg.kv_memory_bytes)
                pool = sized_pool(
                    spec, cfg.kv_dtype, device, budget, cfg.max_kv_blocks, self.max_context,
                    cfg.kv_auto_min_sequences,
                )  # fmt: skip
            if device.type == "cuda":
                from cloud_engine.cuda_runner import CudaRunner

                runner = CudaRunner(
                    model,
                    pool,
                    max_batch=cfg.max_running or 256,
                    max_context=self.max_context,
                    cuda_graphs=cfg.cuda_graphs,
                    max_graph_batch=cfg.max_graph_batch,
                )
            else:
                runner = TorchRunner(model, pool)
        self.runner = runner
        self.pool = runner.pool
        log.info("KV pool: %s", describe_pool(self.pool))
        self.blocks = BlockManager(self.pool.num_blocks, spec.block_size)
        assert cfg.max_running is not None and cfg.max_tokens_per_step is not None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running=cfg.max_running,
                max_tokens_per_step=cfg.max_tokens_per_step,
                max_waiting=cfg.max_waiting,
                watermark_blocks=max(1, self.pool.num_blocks // 100),
            ),
            self.blocks,
        )
        self.seqs: dict[str, Sequence] = {}
        self.counters = CoreCounters()
        self.step_fit = StepCostFit()  # the step time on its composition (NodeState.step_cost)
        self._order = itertools.count()
        self._ahead: _Launch | None = None  # a look-ahead step launched but not yet collected
        self._last_collect = 0.0
        self._failed: list[SeqOutput] = []  # requests refused by add(), reported by step()

    # -- admission -------------------------------------------------------------------------
    def check(self, request: GenerationRequest) -> None:
        n = len(request.prompt_token_ids)
        if n == 0:
            raise RequestTooLong("empty prompt")
        ids = request.prompt_token_ids
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequest(f"token ids must lie in [0, {self.vocab_size})")
        total = n + request.sampling.max_tokens
        if total > self.max_context:
            raise RequestTooLong(
                f"prompt ({n}) + max_tokens ({request.sampling.max_tokens}) = {total} tokens "
                f"exceeds the context of {self.max_context}"
            )
        need = -(-total // self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise RequestTooLong(
                f"{total} tokens need {need} KV blocks; the pool has {self.blocks.num_blocks}"
            )
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise QueueFull(
                f"{self.scheduler.num_waiting} requests waiting", retry_after_s=self.retry_after_s()
            )

    def retry_after_s(self) -> float:
        """A rough wait before a queue slot frees: one request's expected decode time."""
        per_tok = (self.counters.decode_ms.value or 20.0) / 1000.0
        return float(min(30.0, max(1.0, per_tok * 128)))

    def add(self, request: GenerationRequest) -> Sequence:
        """Queue a request (call :meth:`check` first). Request ids must be unique.

        A request whose own state cannot be prepared (sampling parameters a sampler would fail
        on, token ids its hashing refuses) is not queued: it is returned finished, and the next
        :meth:`step` reports it with ``FinishReason.ABORT``. Nothing else is affected."""
        if request.request_id in self.seqs:
            raise ValueError(f"duplicate request id {request.request_id}")
        seq = Sequence(request, next(self._order), self.max_context)
        if request.prefill_with is not None:
            seq.leader = self.seqs.get(request.prefill_with)
        try:
            seq.generator = prepare(request.sampling, self.pool.device)
            if request.sampling.grammar is not None:
                seq.grammar = request.sampling.grammar.start()
            seq.extend_hashes(self.seed, self.blocks.block_size)
        except Exception as exc:  # this request's fault or not, it fails alone
            log.warning("request %s refused: %s", request.request_id, exc)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
            self._failed.append(SeqOutput(seq, [], FinishReason.ABORT))
            return seq
        self.seqs[request.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a request; its blocks are released before this returns."""
        seq = self.seqs.pop(request_id, None)
        if seq is None or seq.status is SeqStatus.FINISHED:
            return None
        self.scheduler.finish(seq)
        self.runner.release(seq)
        seq.finish_reason = FinishReason.ABORT
        if self._ahead is not None and not any(
            it.seq.status is SeqStatus.RUNNING for it in self._ahead.batch.items
        ):
            self._ahead = None  # nothing in it is wanted any more
        return seq

    @property
    def runner_samples_grammar(self) -> bool:
        """Its runner applies grammar masks (``cloud_engine.grammar_mask``) before sampling."""
        return bool(getattr(self.runner, "applies_grammar", False))

    @property
    def has_ahead(self) -> bool:
        """A look-ahead step is launched and not yet collected (the next ``step`` does)."""
        return self._ahead is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.has_ahead or bool(self._failed)

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> list[SeqOutput]:
        """One step's outputs; first those of requests :meth:`add` refused since the last."""
        if not self._failed:
            return self._step()
        failed, self._failed = self._failed, []
        try:
            return failed + self._step()
        except BaseException:  # reported by the next step: their streams must still end
            self._failed = failed + self._failed
            raise

    def _step(self) -> list[SeqOutput]:
        if self.config.debug_checks:
            self.blocks.check_integrity()
        if self._ahead is not None:
            cur, self._ahead = self._ahead, None
            if cur.launched.pending is not None:  # grammar rows: the last step is committed now
                cur.launched = cur.launched.pending()
        else:
            self.scheduler.prefill_beside_decode = self.chunk_beside_decode()
            batch = self.scheduler.schedule()
            for seq in batch.preempted:
                self.runner.release(seq)
                self.counters.preemptions += 1
            if not batch.items:
                return []
            t0 = time.perf_counter()  # before the launch: on CPU it runs the whole step
            cur = _Launch(batch, self.runner.launch(batch), t0)
        if self.config.overlap:
            self._ahead = self._launch_ahead(cur)
        sampled = cur.launched.read()
        now = time.perf_counter()
        dt = now - max(cur.t0, self._last_collect)  # a look-ahead step started at the last read
        self._last_collect = now
        batch, sampled, lps = _live(cur.batch, sampled, cur.launched.logprobs)
        outputs = self._commit(batch, sampled, lps)
        self._account(batch, dt)
        if self.config.debug_checks:
            self.blocks.check_integrity()
        return outputs

    def chunk_beside_decode(self) -> int | None:
        """Prompt tokens a step takes while rows decode: ``prefill_stall_ratio`` decode steps'
        worth at the measured rates (None: the whole step budget)."""
        ratio = self.config.prefill_stall_ratio
        if ratio is None or ratio == "off":
            return None
        c, full = self.counters, self.scheduler.config.max_tokens_per_step
        fit = self.step_fit.latest
        if fit is None:
            return chunk_beside_decode(full, ratio, c.decode_ms.value, c.prefill_ms_per_token.value)
        # the fitted step: a decode step of the rows running now, the marginal prompt token
        # (a short chunk's share of a step also carries the pass, which would shrink the cut
        # to its floor, and a small cut keeps the share high)
        running = self.scheduler.running
        decode_ms = fit.step_ms(len(running), 0, sum(s.num_computed for s in running))
        return chunk_beside_decode(full, ratio, decode_ms, fit.ms_per_prompt_token)

    def _launch_ahead(self, cur: _Launch) -> _Launch | None:
        """Launch the decode step after ``cur`` before ``cur``'s tokens are read, or None where
        it would not be what the scheduler plans (see the module docstring)."""
        if self.scheduler.num_waiting:
            return None
        items: list[ScheduledSeq] = []
        src: list[int] = []
        grow: list[int] = []  # blocks each item's next token needs
        live = k = 0
        bs = self.blocks.block_size
        for it in cur.batch.items:
            if not it.samples:
                continue
            k += 1
            seq = it.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            live += 1
            if seq.num_output + 1 >= seq.max_output:
                continue  # cur's token is its last
            start = it.start + it.num_new
            items.append(ScheduledSeq(seq, 1, start, True))
            src.append(k - 1)
            grow.append(max(0, -(-(start + 1) // bs) - len(seq.block_table)))
        if not items or live != self.scheduler.num_running:
            return None
        if sum(grow) > self.blocks.num_available:
            return None
        for ahead, n in zip(items, grow, strict=True):
            if n:
                ahead.seq.block_table.extend(self.blocks.allocate(n))
        self.counters.ahead_steps += 1
        batch = ScheduledBatch(items)
        feed = Feed(cur.launched.tokens, np.asarray(src, dtype=np.int64))
        t0 = time.perf_counter()
        return _Launch(batch, self.runner.launch(batch, feed), t0)

    def _commit(
        self, batch: ScheduledBatch, sampled: list[int], lps: _Lps = None
    ) -> list[SeqOutput]:
        outputs: list[SeqOutput] = []
        finished: list[Sequence] = []
        k = 0
        bs = self.blocks.block_size
        for it in batch.items:
            seq = it.seq
            self.scheduler.commit(it)
            if not it.samples:
                continue
            tok = sampled[k]
            lp = lps[k] if lps is not None else None
            k += 1
            sp = seq.sampling
            if not sp.ignore_eos and tok in sp.stop_token_ids:
                seq.finish_reason = FinishReason.STOP
                outputs.append(SeqOutput(seq, [], FinishReason.STOP))
                finished.append(seq)
                continue
            seq.token_ids.append(tok)
            if seq.grammar is not None:
                seq.grammar.advance(tok)
            if seq.num_tokens % bs == 0:
                seq.extend_hashes(self.seed, bs)
            if seq.num_output >= seq.max_output:
                seq.finish_reason = FinishReason.LENGTH
                finished.append(seq)
            outputs.append(SeqOutput(seq, [tok], seq.finish_reason, None if lp is None else [lp]))
        for seq in finished:
            self.scheduler.finish(seq)
            self.runner.release(seq)
            self.seqs.pop(seq.request_id, None)
        return outputs

    def _account(self, batch: ScheduledBatch, dt: float) -> None:
        """Count the step, and give each prompt chunk in it its share of the step's time
        (``Sequence.prefill_ms``): what the step took beyond the time its decode rows alone
        take (the decode-only steps' average, at most half the step), split by tokens."""
        c = self.counters
        c.steps += 1
        prefill = 0
        decoding = False
        chunks: list[tuple[Sequence, int]] = []
        rows = context = 0
        for it in batch.items:
            seq = it.seq
            context += it.start + it.num_new  # the KV it reads: its past and its new tokens
            if not seq.counted:  # first time in a batch: its first admission
                seq.counted = True
                c.prompt_tokens += seq.num_prompt
                c.cached_prompt_tokens += seq.num_cached
            prompt_part = max(0, min(it.num_new, seq.num_prompt - it.start))
            prefill += prompt_part
            if prompt_part:
                chunks.append((seq, prompt_part))
            elif it.num_new == 1 and it.samples:
                decoding = True
                rows += 1
            c.recomputed_tokens += max(0, it.num_new - prompt_part - (1 if it.samples else 0))
        c.prefill_tokens += prefill
        self.step_fit.add(rows, prefill, context, 1000.0 * dt, self._last_collect)
        sampled = sum(1 for it in batch.items if it.samples)
        c.decode_tokens += sampled
        if prefill > 0:
            c.prefill_tok_s.add(prefill / dt)
            rows_ms = min(c.decode_ms.value, 500.0 * dt) if decoding else 0.0
            per_token_ms = (1000.0 * dt - rows_ms) / prefill
            for seq, n in chunks:
                seq.prefill_ms += n * per_token_ms
            c.prefill_ms_per_token.add(per_token_ms)
        elif sampled:
            c.decode_ms.add(dt * 1000.0)
        used = self.blocks.num_used
        if used >= c.peak_blocks_used and used > 0:
            c.peak_blocks_used = used
            c.kv_waste_at_peak = self.kv_waste()

    def kv_waste(self) -> float:
        """Share of the slots of in-use blocks that hold no token (now)."""
        used = self.blocks.num_used
        if used == 0:
            return 0.0
        bs = self.blocks.block_size
        empty = sum(
            len(s.block_table) * bs - s.num_computed
            for s in self.scheduler.running
            if s.block_table
        )
        return empty / (used * bs)

    @property
    def prefix_hit_rate(self) -> float:
        c = self.counters
        return c.cached_prompt_tokens / c.prompt_tokens if c.prompt_tokens else 0.0

    def drain_block_events(self) -> BlockEvents:
        return self.blocks.drain_events()

    def held_blocks(self) -> list[int]:
        return self.blocks.held_hashes()
