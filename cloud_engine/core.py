"""The synchronous engine core: block manager + scheduler + model runner, one step at a time.

:class:`EngineCore` is single-threaded (the async :class:`cloud_engine.engine.CloudEngine`
drives it from its own thread). It composes the parts and owns the requests it holds
(``seqs``): one :meth:`EngineCore.step` schedules a batch (or takes the look-ahead step
launched by the previous one, ``cloud_engine.inflight``), runs it, commits the written KV and
the sampled tokens (``cloud_engine.outputs``), retires finished sequences, whose blocks are
released before ``step`` returns, and counts the step (``cloud_engine.step_stats``).

Per-request failures stay per-request: :meth:`EngineCore.check` refuses a request that can
never run (``cloud_engine.admission``) or finds the queue full, before anything is queued, and
:meth:`EngineCore.add` prepares the request's own state before it joins the scheduler. A
request that fails there never runs: the next :meth:`EngineCore.step` returns it finished with
``FinishReason.ABORT``, and the batch goes on. Only a failure of a step's own work (model,
device) fails the step.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING

import torch

from cloud_engine.admission import check_request, prepare_sequence
from cloud_engine.block_manager import BlockEvents, BlockManager
from cloud_engine.config import EngineConfig
from cloud_engine.inflight import Launch, Lps, live, plan_ahead
from cloud_engine.kv_pool import KVPool, KVSpec, budget_bytes_for, describe_pool, sized_pool
from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.outputs import SeqOutput, commit_tokens
from cloud_engine.runner import Feed, ModelRunner, TorchRunner
from cloud_engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from cloud_engine.sequence import SeqStatus, Sequence
from cloud_engine.step_stats import CoreCounters, account_step, kv_waste, prefill_cut
from routing.blocks import model_seed
from routing.engine import FinishReason, GenerationRequest, QueueFull
from routing.step_cost import StepCostFit

if TYPE_CHECKING:
    from cloud_engine.parallel.model import ShardedLlama

log = logging.getLogger(__name__)


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
        self._ahead: Launch | None = None  # a look-ahead step launched but not yet collected
        self._last_collect = 0.0
        self._failed: list[SeqOutput] = []  # requests refused by add(), reported by step()

    # -- admission -------------------------------------------------------------------------
    def check(self, request: GenerationRequest) -> None:
        blocks = self.blocks
        check_request(
            request, self.vocab_size, self.max_context, blocks.num_blocks, blocks.block_size
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
            prepare_sequence(seq, self.pool.device, self.seed, self.blocks.block_size)
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
            cur = Launch(batch, self.runner.launch(batch), t0)
        if self.config.overlap:
            self._ahead = self._launch_ahead(cur)
        sampled = cur.launched.read()
        now = time.perf_counter()
        dt = now - max(cur.t0, self._last_collect)  # a look-ahead step started at the last read
        self._last_collect = now
        batch, sampled, lps = live(cur.batch, sampled, cur.launched.logprobs)
        outputs = self._commit(batch, sampled, lps)
        self._account(batch, dt)
        if self.config.debug_checks:
            self.blocks.check_integrity()
        return outputs

    def chunk_beside_decode(self) -> int | None:
        """Prompt tokens a step takes while rows decode: ``prefill_stall_ratio`` decode steps'
        worth at the measured rates (None: the whole step budget)."""
        return prefill_cut(
            self.config.prefill_stall_ratio, self.counters, self.step_fit, self.scheduler
        )

    def _launch_ahead(self, cur: Launch) -> Launch | None:
        """Launch the decode step after ``cur`` before ``cur``'s tokens are read, or None where
        it would not be what the scheduler plans (``cloud_engine.inflight``)."""
        planned = plan_ahead(cur, self.scheduler, self.blocks)
        if planned is None:
            return None
        batch, src = planned
        self.counters.ahead_steps += 1
        feed = Feed(cur.launched.tokens, src)
        t0 = time.perf_counter()
        return Launch(batch, self.runner.launch(batch, feed), t0)

    def _commit(
        self, batch: ScheduledBatch, sampled: list[int], lps: Lps = None
    ) -> list[SeqOutput]:
        """Commit a collected batch (``cloud_engine.outputs``) and retire what finished."""
        outputs, finished = commit_tokens(batch, sampled, lps, self.scheduler, self.seed)
        for seq in finished:
            self.scheduler.finish(seq)
            self.runner.release(seq)
            self.seqs.pop(seq.request_id, None)
        return outputs

    def _account(self, batch: ScheduledBatch, dt: float) -> None:
        """Count the step (``cloud_engine.step_stats.account_step``)."""
        account_step(self.counters, self.step_fit, batch, dt, self._last_collect, self.scheduler)

    def kv_waste(self) -> float:
        """Share of the slots of in-use blocks that hold no token (now)."""
        return kv_waste(self.scheduler)

    @property
    def prefix_hit_rate(self) -> float:
        c = self.counters
        return c.cached_prompt_tokens / c.prompt_tokens if c.prompt_tokens else 0.0

    def drain_block_events(self) -> BlockEvents:
        return self.blocks.drain_events()

    def held_blocks(self) -> list[int]:
        return self.blocks.held_hashes()
