"""A rank's part of each step on the fused model: the CUDA path's kernels on a TP/PP shard, and
decode steps replayed from CUDA graphs cut at the collectives.

:class:`FusedStage` is the parallel runner's stage executor (``runner.StageExecutor``'s
interface: ``run`` a step's layers, ``result`` its tokens or logits) over
:class:`cloud_engine.model.fused.FusedLlama` built from this rank's shard: the Triton kernels
where they apply (``TritonOps``), the torch ops elsewhere (the CPU tests). It takes the same
:class:`StepMeta` every rank receives, so the driver and the workers run the same code.

Decode-only steps of up to ``max_graph_batch`` sequences replay a :class:`PiecewiseGraph`
captured for the next size of the runner's ladder. A collective that CUDA graphs can hold
(NCCL) is captured inside the one graph. One that they cannot (gloo: several ranks on one GPU,
as on the one-GPU test machine) cuts the graph there: the pieces are captured in order, and on
replay the all-reduce runs eagerly between two pieces on the tensor the model handed it. Every
rank of a TP group captures the same pieces at the same step (the first decode step), so their
collectives pair up; the warm-up before each capture runs the real collectives.

Invariants: a sequence's block table reaches ``tables`` (one row per sequence of the step, in
step order) before any kernel reads it; a graph's static inputs are written only between its
replays (each step's copies are synchronous), and all graphs share one memory pool, replayed
one at a time.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cloud_engine.attention_torch import make_meta
from cloud_engine.config import EngineConfig
from cloud_engine.cuda_runner import GRAPH_LADDER
from cloud_engine.kernels.tiling import make_tiles, tile_shape
from cloud_engine.kv_pool import KVPool
from cloud_engine.model.fused import AttnInputs, FusedLlama
from cloud_engine.model.torch_ops import TorchOps, add_norm
from cloud_engine.model.triton_ops import TritonOps
from cloud_engine.parallel.dist import Rank, backend_for
from cloud_engine.parallel.model import ShardedLlama
from cloud_engine.parallel.protocol import StepMeta
from cloud_engine.parallel.runner import StageExecutor
from cloud_engine.step_inputs import pack_aligned


class PiecewiseGraph:
    """One captured forward as pieces of CUDA graph, cut where the model calls :meth:`cut`
    (its all-reduce during capture). ``replay`` runs piece 0, ``collective(cuts[0])``, piece 1,
    and so on: the model's reduction happens between the pieces, in place."""

    def __init__(
        self, device: torch.device, collective: Callable[[torch.Tensor], object], pool: object
    ) -> None:
        """``pool``: the graph memory pool every piece allocates from (shared with the other
        graphs of the stage, which are replayed one at a time)."""
        self.device, self.collective, self.pool = device, collective, pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[torch.Tensor] = []

    def _begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool)  # type: ignore[arg-type]
        self.pieces.append(g)

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Capture ``fn`` (warmed up before) into pieces; its output tensor."""
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._begin()
            out = fn()
            self.pieces[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return out

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """End the piece being captured at ``x`` (reduced between it and the next on replay)."""
        self.pieces[-1].capture_end()
        self.cuts.append(x)
        self._begin()
        return x

    def replay(self) -> None:
        for i, g in enumerate(self.pieces):
            g.replay()
            if i < len(self.cuts):
                self.collective(self.cuts[i])


@dataclass(slots=True)
class _StageGraph:
    graph: PiecewiseGraph
    ints: torch.Tensor  # [5, W] int32: ids, positions, slots (-1 pads), seq rows, lens (1 pads)
    hidden_in: torch.Tensor | None  # [B, H]: the previous stage's hidden states (not stage 0)
    out: torch.Tensor  # [B, H]: this stage's output (final-normed on the last stage)
    inputs: AttnInputs  # the graph reads these tensors: they live as long as it does


class FusedStage(StageExecutor):
    def __init__(self, model: ShardedLlama, pool: KVPool, rank: Rank, cfg: EngineConfig) -> None:
        super().__init__(model, pool, rank)
        cfg = cfg.resolved()
        from cloud_engine.kernels import triton_available

        kernels = rank.device.type == "cuda" and triton_available()
        self.fm = FusedLlama(model, pool, TritonOps() if kernels else TorchOps())
        self.torch_ops = not kernels  # torch attention needs its host-side metadata
        self.group = self.fm.hq // self.fm.hkv
        assert cfg.max_running is not None
        width = -(
            -(cfg.max_context or model.config.max_position_embeddings) // pool.spec.block_size
        )
        self.tables = torch.zeros((cfg.max_running, width), dtype=torch.int32, device=self.device)
        top = min(cfg.max_graph_batch, cfg.max_running)
        self.graph_sizes = (
            [b for b in GRAPH_LADDER if b <= top] if kernels and cfg.cuda_graphs else []
        )
        self.graphs: dict[int, _StageGraph] = {}
        self._graph_pool: object | None = None
        # a collective inside a graph: only NCCL's can be captured
        self.capture_collectives = backend_for(rank.device) == "nccl"
        top = max(self.graph_sizes, default=0)
        self._arange = torch.arange(top + 1, dtype=torch.int32, device=self.device)
        self._zeros = torch.zeros(top, dtype=torch.int32, device=self.device)

    # -- one step ---------------------------------------------------------------------------
    def run(self, meta: StepMeta, hidden: torch.Tensor | None) -> torch.Tensor:
        t0 = time.perf_counter()
        if not self.stats.first:
            self.stats.first = t0
        s = len(meta.seq_lens)
        self._sync_tables(meta.block_tables)
        h = None if hidden is None else hidden[0]
        if meta.num_tokens == s and self.graph_sizes and s <= self.graph_sizes[-1]:
            out = self._replay(meta, h)
        else:
            out = self._eager(meta, h)
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.steps += 1
        return out.unsqueeze(0)

    def result(self, meta: StepMeta, hidden: torch.Tensor) -> torch.Tensor | None:
        """Last stage: greedy token ids ``[M]`` or the whole vocabulary's logits ``[M, V]``."""
        if meta.num_samples == 0:
            return None
        t0 = time.perf_counter()
        rows = hidden[0, torch.from_numpy(meta.sample_idx).to(self.device)]
        local = self.model.mask_padding(self.fm.ops.linear(rows, self.fm.lm_head).float())
        out = self.model.greedy(local) if meta.greedy else self.model.full_logits(local)
        self.stats.busy_s += time.perf_counter() - t0
        return out

    def _sync_tables(self, tables: np.ndarray) -> None:
        s, w = tables.shape
        if s and w:
            self.tables[:s, :w] = torch.from_numpy(tables.astype(np.int32)).to(self.device)

    def _forward(
        self, ids: torch.Tensor | None, pos: torch.Tensor, a: AttnInputs, h: torch.Tensor | None
    ) -> torch.Tensor:
        """This stage's layers: the final-normed hidden states on the last stage, the residual
        stream (pending added) elsewhere."""
        fm = self.fm
        pending, residual = fm._layers(ids, pos, a, range(len(fm.layers)), h)
        if self.rank.last_stage:
            assert fm.final_norm is not None
            return add_norm(fm.ops, pending, residual, fm.final_norm, fm.eps)[0]
        return residual if pending is None else pending + residual

    def _eager(self, meta: StepMeta, h: torch.Tensor | None) -> torch.Tensor:
        s = len(meta.seq_lens)
        q_start = meta.q_start.astype(np.int64)
        shape = tile_shape(self.group, int(np.diff(q_start).max()))
        tile_seq, tile_q0 = make_tiles(q_start, shape.block_q)
        parts = [
            meta.input_ids, meta.positions, meta.slot_mapping, np.arange(s), meta.seq_lens,
            q_start, tile_seq, tile_q0,
        ]  # fmt: skip
        packed, where = pack_aligned(parts)
        dev = torch.from_numpy(packed).to(self.device)
        ids, pos, slots, rows, lens, qs, ts, tq = (dev[sl] for sl in where)
        tmeta = None
        if self.torch_ops:
            tmeta = make_meta(
                slots.long(), self.tables[:s].long(), q_start.tolist(), meta.seq_lens.tolist()
            )
        a = AttnInputs(slots, self.tables, rows, lens, qs, ts, tq, shape, tmeta)
        return self._forward(ids if h is None else None, pos, a, h)

    # -- decode graphs ------------------------------------------------------------------------
    def _replay(self, meta: StepMeta, h: torch.Tensor | None) -> torch.Tensor:
        if not self.graphs:
            self._capture_all()
        s = len(meta.seq_lens)
        g = self.graphs[self.graph_sizes[bisect.bisect_left(self.graph_sizes, s)]]
        host = np.zeros(tuple(g.ints.shape), dtype=np.int32)
        host[0, :s], host[1, :s] = meta.input_ids, meta.positions
        host[2] = -1
        host[2, :s] = meta.slot_mapping
        host[3, : g.ints.shape[1]] = np.arange(g.ints.shape[1]) % self.tables.shape[0]
        host[4] = 1
        host[4, :s] = meta.seq_lens
        g.ints.copy_(torch.from_numpy(host))
        if g.hidden_in is not None:
            assert h is not None
            g.hidden_in[:s].copy_(h)
        g.graph.replay()
        return g.out[:s].clone()  # the next replay rewrites ``out``; sends may still read this

    def _capture_all(self) -> None:
        """Every ladder size, largest first, one shared pool (each rank of a TP group in the
        same order: their warm-up collectives and the graph pieces pair up)."""
        self._graph_pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.graph_sizes):
            self.graphs[b] = self._capture(b)

    def _capture(self, b: int) -> _StageGraph:
        fm, first = self.fm, self.rank.first_stage
        ints = torch.zeros((5, -(-b // 4) * 4), dtype=torch.int32, device=self.device)
        ints[2], ints[4] = -1, 1
        ints[3] = torch.arange(ints.shape[1], device=self.device) % self.tables.shape[0]
        hidden_in = None
        if not first:
            hidden_in = torch.zeros(
                (b, self.model.config.hidden_size), dtype=self.dtype, device=self.device
            )
        a = AttnInputs(
            ints[2, :b], self.tables, ints[3, :b], ints[4, :b], self._arange[: b + 1],
            self._arange[:b], self._zeros[:b], tile_shape(self.group, 1),
        )  # fmt: skip

        def step() -> torch.Tensor:
            h = None if hidden_in is None else hidden_in[:b].clone()
            return self._forward(ints[0, :b] if first else None, ints[1, :b], a, h)

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and warm up, the real collectives included
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        pg = PiecewiseGraph(self.device, self.rank.all_reduce, self._graph_pool)
        reduce = fm.reduce
        if reduce is not None and not self.capture_collectives:
            fm.reduce = pg.cut
        try:
            out = pg.capture(step)
        finally:
            fm.reduce = reduce
        return _StageGraph(pg, ints, hidden_in, out, a)


def make_stage(
    model: ShardedLlama, pool: KVPool, rank: Rank, cfg: EngineConfig | None
) -> StageExecutor:
    """The fused stage where ``cfg.fused_shards`` says (default: on CUDA with Triton), else
    the eager layers."""
    fused = cfg.fused_shards if cfg is not None else None
    if fused is None:
        from cloud_engine.kernels import triton_available

        fused = rank.device.type == "cuda" and triton_available()
    if fused:
        return FusedStage(model, pool, rank, cfg or EngineConfig(device=str(rank.device)))
    return StageExecutor(model, pool, rank)
