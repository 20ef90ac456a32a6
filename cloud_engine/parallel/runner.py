"""The driver's runner and the workers' loop: every rank runs the same step, in the same order.

The driver (rank 0) plans a batch, packs its metadata (``protocol``), sends it to the other
TP ranks of stage 0 (non-blocking point-to-point sends) and runs stage 0; each stage sends ``(header, payload, hidden)`` to
the same TP rank of the next stage with a non-blocking send; TP rank 0 of the last stage sends
the step's result (greedy token ids, or the whole vocabulary's logits when some row samples or
follows a grammar) back to the driver, which applies the grammar rows' masks and samples. The driver does not wait for a step's result before it
launches the next: with ``pp`` stages up to ``pp`` batches are in flight
(``cloud_engine.parallel.pipeline``).

Invariants:
- Every rank executes the steps in the order the driver launched them (point-to-point
  messages between two ranks are matched in order), so a KV block reused by a later step is
  only overwritten after every earlier step has read it, on every stage.
- Each rank's KV pool holds its layers and KV heads with the same number of blocks everywhere
  (the minimum over the world), indexed by the driver's block ids.
- Workers wait for the next message under the world timeout; the driver sends a NOOP when idle
  (:meth:`DistRunner.idle`), so only a dead or stuck peer makes a wait fail. A failed wait ends
  the worker with an error (its supervisor then takes the node down).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cloud_engine.attention_torch import TorchPagedBackend, make_meta
from cloud_engine.config import EngineConfig
from cloud_engine.grammar_mask import apply_grammar_masks, grammar_states
from cloud_engine.kv_pool import KVPool, KVSpec, sized_pool
from cloud_engine.parallel.dist import Rank, min_over_world
from cloud_engine.parallel.model import ShardedLlama
from cloud_engine.parallel.protocol import HEADER, Cmd, StepMeta, control, payload_size, unpack
from cloud_engine.runner import Feed
from cloud_engine.sampler import make_generator, sample_batch
from cloud_engine.scheduler import ScheduledBatch
from cloud_engine.sequence import Sequence
from cloud_engine.step_inputs import build_step_inputs, padded_block_tables

log = logging.getLogger(__name__)

STATS = 4  # busy seconds, wall seconds since the first step, steps, control seconds


def make_pool(model: ShardedLlama, rank: Rank, budget_bytes: int, cfg: EngineConfig) -> KVPool:
    """This rank's shard of the one KV pool: its layers, its KV heads, the storage of
    ``cfg.kv_dtype`` and the world's block count (every rank agrees on both)."""
    mc = model.config
    spec = KVSpec(len(model.layers), model.kv_heads, mc.head_dim, model.anchor.dtype)
    world = rank.config.world_size > 1
    return sized_pool(
        spec, cfg.kv_dtype, rank.device, budget_bytes, cfg.max_kv_blocks,
        cfg.max_context or mc.max_position_embeddings, cfg.kv_auto_min_sequences,
        agree=(lambda n: min_over_world(n, rank.device)) if world else None,
    )  # fmt: skip


@dataclass
class StageStats:
    busy_s: float = 0.0
    first: float = 0.0
    steps: int = 0
    control_s: float = 0.0  # driver: packing and posting each step's metadata

    def as_tensor(self) -> torch.Tensor:
        wall = time.perf_counter() - self.first if self.first else 0.0
        return torch.tensor(
            [self.busy_s, wall, float(self.steps), self.control_s], dtype=torch.float64
        )


class StageExecutor:
    """Runs one step's part on this rank: this stage's layers, and the LM head on the last."""

    def __init__(self, model: ShardedLlama, pool: KVPool, rank: Rank) -> None:
        self.model, self.pool, self.rank = model, pool, rank
        self.device = rank.device
        self.dtype = model.anchor.dtype
        self.hidden_size = model.config.hidden_size
        self.stats = StageStats()
        self._sends: deque[tuple[object, torch.Tensor]] = deque()

    def run(self, meta: StepMeta, hidden: torch.Tensor | None) -> torch.Tensor:
        t0 = time.perf_counter()
        if not self.stats.first:
            self.stats.first = t0
        dev = self.device
        pm = make_meta(
            torch.from_numpy(meta.slot_mapping).to(dev),
            torch.from_numpy(meta.block_tables).to(dev),
            meta.q_start.tolist(),
            meta.seq_lens.tolist(),
        )
        pos = torch.from_numpy(meta.positions).to(dev).unsqueeze(0)
        ids = torch.from_numpy(meta.input_ids).to(dev).unsqueeze(0) if hidden is None else None
        out = self.model.forward_stage(ids, hidden, pos, TorchPagedBackend(self.pool, pm))
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.steps += 1
        return out

    def result(self, meta: StepMeta, hidden: torch.Tensor) -> torch.Tensor | None:
        """Last stage: token ids ``[M]`` (greedy) or logits ``[M, vocab]``; None without rows."""
        if meta.num_samples == 0:
            return None
        t0 = time.perf_counter()
        rows = hidden[0, torch.from_numpy(meta.sample_idx).to(self.device)]
        logits = self.model.local_logits(rows)
        out = self.model.greedy(logits) if meta.greedy else self.model.full_logits(logits)
        self.stats.busy_s += time.perf_counter() - t0
        return out

    # -- messages between stages ------------------------------------------------------------
    def send(self, dst: int, *tensors: torch.Tensor, group: object | None = None) -> None:
        """Non-blocking sends, in order; the tensors stay referenced until they completed."""
        self._reap()
        for t in tensors:
            t = t.contiguous()
            self._sends.append((dist.isend(t, dst, group=group), t))  # type: ignore[arg-type]

    def _reap(self) -> None:
        while self._sends and self._sends[0][0].is_completed():  # type: ignore[attr-defined]
            self._sends.popleft()

    def flush(self) -> None:
        while self._sends:
            work, _ = self._sends.popleft()
            work.wait()  # type: ignore[attr-defined]

    def forward_next(
        self, head: torch.Tensor, payload: torch.Tensor | None, hidden: torch.Tensor | None
    ) -> None:
        if self.rank.last_stage:
            return
        nxt = self.rank.next_rank
        self.send(
            nxt, head, *([payload] if payload is not None else []), group=self.rank.ctrl_group
        )
        if hidden is not None:
            self.send(nxt, hidden[0])


@dataclass
class _Pending:
    """A launched step whose result has not been read."""

    meta: StepMeta
    seqs: list[Sequence]
    local: torch.Tensor | None = None  # the result when the driver is also the last stage
    recv_from: int | None = None  # the rank the result comes from (None: computed here)
    buf: torch.Tensor | None = None
    tokens: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    logprobs: None = None  # as ``runner.Launched``'s: the parallel runners compute none
    pending: None = None  # as ``runner.Launched``'s: never fed, so never waits to sample

    def read(self) -> list[int]:
        if self.meta.num_samples == 0:
            return []
        if self.recv_from is not None:  # posted only now: the driver has nothing else to do
            dist.recv(self.buf, self.recv_from)  # type: ignore[arg-type]
            res = self.buf
        else:
            res = self.local
        assert res is not None
        if self.meta.greedy:
            toks = res
        else:
            res = apply_grammar_masks(res, grammar_states(self.seqs))
            gens = []
            for s in self.seqs:
                if s.generator is None and not s.sampling.greedy:
                    s.generator = make_generator(s.sampling, res.device)
                gens.append(s.generator)
            toks = sample_batch(res, [s.sampling for s in self.seqs], gens)  # type: ignore[arg-type]
        self.tokens = toks
        return toks.cpu().tolist()


class DistRunner:
    """The driver's :class:`cloud_engine.runner.ModelRunner` over the whole world."""

    applies_grammar = True  # grammar rows' masks are applied before sampling (on the driver)

    def __init__(
        self, model: ShardedLlama, pool: KVPool, rank: Rank, cfg: EngineConfig | None = None
    ) -> None:
        from cloud_engine.parallel.fused_stage import make_stage

        assert rank.is_driver
        self.model, self.pool, self.rank = model, pool, rank
        self.device = rank.device
        self.block_size = pool.spec.block_size
        self.exec = make_stage(model, pool, rank, cfg)
        self._step = 0
        self.control_s = 0.0  # packing + posting the metadata, summed over steps
        self.pack_s = 0.0  # of which flattening the batch and packing it
        self.steps = 0
        self.stopped = False
        self.last_send = time.monotonic()

    def release(self, seq: Sequence) -> None:
        seq.row = -1

    def _post(self, head: torch.Tensor, payload: torch.Tensor | None) -> None:
        """The metadata to stage 0's other TP ranks: non-blocking sends (a gloo broadcast
        waits for every peer to wake up: about 1 ms on a busy host)."""
        r = self.rank
        extra = [payload] if payload is not None else []
        for peer in range(1, r.config.tp):
            self.exec.send(peer, head, *extra, group=r.ctrl_group)
        self.last_send = time.monotonic()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, feed: Feed | None = None) -> _Pending:
        assert feed is None, "the parallel runner does not take device-fed ids"
        t0 = time.perf_counter()
        inp = build_step_inputs(batch, self.block_size)
        seqs = [batch.items[i].seq for i in inp.sample_items]
        self._step += 1
        meta = StepMeta(
            Cmd.STEP,
            self._step,
            inp.input_ids,
            inp.positions,
            inp.slot_mapping,
            inp.q_start,
            inp.seq_lens,
            padded_block_tables(batch),
            inp.sample_idx,
            # token ids from the last stage only when no row samples or follows a grammar
            all(s.sampling.greedy for s in seqs) and not any(grammar_states(seqs)),
        )
        head, payload = meta.pack()
        meta = unpack(head, payload)  # run exactly what the workers run
        t1 = time.perf_counter()
        self.pack_s += t1 - t0
        self._post(head, payload)
        pend = _Pending(meta, seqs)
        r = self.rank
        m = meta.num_samples
        if r.config.pp > 1 and m:
            if meta.greedy:
                pend.buf = torch.empty(m, dtype=torch.int64, device=self.device)
            else:
                pend.buf = torch.empty(m, self.model.vocab, dtype=torch.float32, device=self.device)
            pend.recv_from = r.last_root
        self.control_s += time.perf_counter() - t0
        self.steps += 1
        hidden = self.exec.run(meta, None)
        self.exec.forward_next(head, payload, hidden)
        if r.last_stage:
            pend.local = self.exec.result(meta, hidden)
        return pend

    def idle(self, every_s: float = 1.0) -> None:
        """Keep the workers' waits alive while there is no work."""
        if self.stopped or time.monotonic() - self.last_send < every_s:
            return
        head = control(Cmd.NOOP)
        self._post(head, None)
        self.exec.forward_next(head, None, None)

    def reset_stats(self) -> None:
        """Every rank's stage statistics start afresh from here (after a warm-up)."""
        head = control(Cmd.RESET_STATS)
        self._post(head, None)
        self.exec.forward_next(head, None, None)
        self.exec.stats = StageStats()
        self.control_s = self.pack_s = 0.0
        self.steps = 0

    def stop(self) -> list[list[float]]:
        """Stop every worker; returns each rank's ``[busy_s, wall_s, steps, control_s]``."""
        if self.stopped:
            return []
        self.stopped = True
        head = control(Cmd.STOP)
        self._post(head, None)
        self.exec.forward_next(head, None, None)
        self.exec.flush()
        world = self.rank.config.world_size
        stats = [self.exec.stats.as_tensor()]
        stats[0][3] = self.control_s
        for src in range(1, world):
            t = torch.empty(STATS, dtype=torch.float64)
            dist.recv(t, src, group=self.rank.ctrl_group)  # type: ignore[arg-type]
            stats.append(t)
        return [s.tolist() for s in stats]


def worker_loop(
    model: ShardedLlama, pool: KVPool, rank: Rank, cfg: EngineConfig | None = None
) -> None:
    """A non-driver rank: receive each step, run this stage, pass it on, until STOP."""
    from cloud_engine.parallel.fused_stage import make_stage

    ex = make_stage(model, pool, rank, cfg)
    r = rank
    with torch.inference_mode():
        while True:
            head = torch.empty(HEADER, dtype=torch.int64)
            src = 0 if r.first_stage else r.prev_rank  # the driver, or the previous stage
            dist.recv(head, src, group=r.ctrl_group)  # type: ignore[arg-type]
            cmd = Cmd(int(head[0]))
            if cmd is not Cmd.STEP:
                ex.forward_next(head, None, None)
                if cmd is Cmd.STOP:
                    break
                if cmd is Cmd.RESET_STATS:
                    ex.stats = StageStats()
                continue
            payload = torch.empty(payload_size(head), dtype=torch.int64)
            hidden = None
            dist.recv(payload, src, group=r.ctrl_group)  # type: ignore[arg-type]
            if not r.first_stage:
                n = int(head[1])
                hidden = torch.empty(
                    1, n, model.config.hidden_size, dtype=ex.dtype, device=ex.device
                )
                dist.recv(hidden[0], r.prev_rank)
            meta = unpack(head, payload)
            out = ex.run(meta, hidden)
            ex.forward_next(head, payload, out)
            if r.last_stage:
                res = ex.result(meta, out)
                if res is not None and r.tp_rank == 0:
                    ex.send(0, res)
    ex.flush()
    dist.send(ex.stats.as_tensor(), 0, group=r.ctrl_group)  # type: ignore[arg-type]
