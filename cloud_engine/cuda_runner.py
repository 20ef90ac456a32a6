"""The CUDA model runner: fused weights, Triton kernels, CUDA graphs for decode.

Block tables live on the device as ``[max_rows, max_blocks]`` int32: each running sequence owns
one row while it runs, and only the entries appended since the last step are uploaded. All other
per-step integers go up in one packed host-to-device copy.

Decode-only steps of up to ``max_graph_batch`` sequences replay a CUDA graph captured for the
next batch size of a ladder (padding rows have slot -1, so they write no KV, and length 1).
Anything else (prefill chunks, mixed batches) runs eagerly with prefill tiling. Sampling runs on
the device; greedy batches take the argmax captured inside the graph (fused into the logits
product for small batches). Rows with a grammar run in the graphs like any other; their masks
are applied to the graph's logits after the replay (``cloud_engine.grammar_mask``), and their
batch samples from those logits instead of taking the in-graph argmax; in a look-ahead step that
sampling waits until the core has committed the step before (``runner.Launched.pending``).

Every size has two graphs, one per *parity*, used alternately replay after replay: the graph of
parity ``p`` reads its own step-integer tensor and writes its greedy tokens into token buffer
``p``. That keeps both copies of a step off the compute stream: the integers go up on an upload
stream while the previous graph still runs (the compute stream only waits for that copy's event),
and the tokens come down on a download stream after the graph's event, so two consecutive
graphs follow each other with no copy between them. A look-ahead step fed from the previous
graph picks its ids inside the graph: the embedding kernel reads token buffer ``1 - p`` (the
``src`` row of the step integers says which rows); tokens fed from anywhere else (sampled
steps) are gathered before the replay.

Invariants: a sequence's device row mirrors its ``block_table`` prefix of ``synced`` entries
before any kernel reads it; rows are returned by :meth:`release` whenever a sequence leaves the
running set (finish, abort, preemption), so a row never serves two live sequences. Buffers of
parity ``p`` (step integers, their pinned staging, tokens) are written again only by the replay
after next, which the core launches only after collecting this one (it collects a step before
launching the one after next), so no copy or graph reads a buffer that a later one rewrites.
All graphs write their logits into one shared buffer: the only reader, sampling, is queued on
the compute stream right after its replay, before any later replay.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cloud_engine.attention_torch import make_meta
from cloud_engine.grammar_mask import apply_grammar_masks, grammar_states
from cloud_engine.kernels.tiling import make_tiles, tile_shape
from cloud_engine.kv_pool import KVPool
from cloud_engine.logprobs import collect_prompt_logprobs, sampled_logprobs
from cloud_engine.model.fused import AttnInputs, FusedLlama
from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.model.torch_ops import TorchOps
from cloud_engine.model.triton_ops import TritonOps
from cloud_engine.runner import Feed, Launched, generated_before, sample_when_ready
from cloud_engine.sampler import banned_stops, make_generator, sample_batch, to_device
from cloud_engine.scheduler import ScheduledBatch
from cloud_engine.sequence import Sequence
from cloud_engine.step_inputs import StepInputs, build_step_inputs, pack_aligned

if TYPE_CHECKING:
    from cloud_engine.parallel.model import ShardedLlama

GRAPH_LADDER = (
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    48,
    64,
    80,
    96,
    112,
    128,
    160,
    192,
    224,
    256,
    320,
    384,
    448,
    512,
)


@dataclass(slots=True)
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    ints: torch.Tensor  # [6, W] int32 (W = B rounded up to 4): ids, positions, slots, rows, lens,
    # src (index into the other parity's token buffer, or -1: take ids)
    logits: torch.Tensor  # [B, V]: the first B rows of the logits buffer all graphs share
    tokens: torch.Tensor  # [B] greedy argmax: its parity's token buffer's first B entries
    host: torch.Tensor  # [6, W] int32 pinned staging of ``ints``: one copy, no host wait
    uploaded: torch.cuda.Event  # recorded on the upload stream after the copy out of ``host``


class CudaRunner:
    applies_grammar = True  # grammar rows' masks are applied before sampling

    def __init__(
        self,
        model: LlamaForCausalLM | ShardedLlama,
        pool: KVPool,
        max_batch: int,
        max_context: int,
        cuda_graphs: bool = True,
        max_graph_batch: int = 256,
        ops: TorchOps | None = None,
    ) -> None:
        self.pool = pool
        self.device = pool.device
        self.fm = FusedLlama(model, pool, ops or TritonOps(), consume=True)
        self.torch_ops = not isinstance(self.fm.ops, TritonOps)  # torch attention needs its meta
        self.bs = pool.spec.block_size
        self.group = self.fm.hq // self.fm.hkv
        self.max_rows = max_batch
        self.width = -(-max_context // self.bs)
        self.tables = torch.zeros((max_batch, self.width), dtype=torch.int32, device=self.device)
        self._free_rows = list(range(max_batch - 1, -1, -1))
        self._synced = [0] * max_batch
        self._arange = torch.arange(GRAPH_LADDER[-1] + 1, dtype=torch.int32, device=self.device)
        self._zeros = torch.zeros(GRAPH_LADDER[-1], dtype=torch.int32, device=self.device)
        sizes = [b for b in GRAPH_LADDER if b <= min(max_graph_batch, max_batch)]
        self.graph_sizes = sizes if cuda_graphs and self.device.type == "cuda" else []
        # greedy tokens of the graph replays of each parity (graphs of all sizes write their
        # first rows)
        self._graph_tokens = [
            torch.zeros(max(self.graph_sizes, default=0), dtype=torch.int64, device=self.device)
            for _ in range(2)
        ]
        # logits of every graph replay: read (sampling) in stream order before the next replay
        fm = self.fm
        self._graph_logits = torch.empty(
            (max(self.graph_sizes, default=0), fm.lm_head.shape[0]),
            dtype=fm.embed.dtype,
            device=self.device,
        )
        self.graphs: dict[int, tuple[_DecodeGraph, _DecodeGraph]] = {}  # by size, then parity
        self._graph_pool: object | None = None
        self._parity = 0  # of the next replay
        pinned = self.device.type == "cuda"
        self._upload_stream = torch.cuda.Stream(self.device) if pinned else None
        self._download_stream = torch.cuda.Stream(self.device) if pinned else None
        self._token_host = [
            torch.empty(max_batch, dtype=torch.int64, pin_memory=pinned) for _ in range(2)
        ]
        self._flip = 0
        self.graph_feeds = 0  # replays whose fed ids the graph picked itself
        self._copied = [torch.cuda.Event() for _ in range(2)] if pinned else []

    # -- rows ------------------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        if seq.row >= 0:
            self._free_rows.append(seq.row)
            seq.row = -1

    def _sync_tables(self, batch: ScheduledBatch) -> None:
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        for it in batch.items:
            seq = it.seq
            if seq.row < 0:
                seq.row = self._free_rows.pop()
                self._synced[seq.row] = 0
            k, t = self._synced[seq.row], seq.block_table
            if len(t) > k:
                rows.extend([seq.row] * (len(t) - k))
                cols.extend(range(k, len(t)))
                vals.extend(t[k:])
                self._synced[seq.row] = len(t)
        if rows:
            up = self._upload(np.asarray([rows, cols, vals], dtype=np.int32).ravel())
            n = len(rows)
            self.tables[up[:n].long(), up[n : 2 * n].long()] = up[2 * n :]

    def _upload(self, arr: np.ndarray) -> torch.Tensor:
        """One host-to-device copy of an int32 array that the host never waits for (a blocking
        one would wait for the running decode graph every time a sequence grows into a new KV
        block); ``arr`` may be reused at once."""
        return to_device(torch.from_numpy(arr), self.device)

    # -- execution -------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, feed: Feed | None = None) -> Launched:
        self._sync_tables(batch)
        # fed: the ids slot carries indices into the fed tokens
        inp = build_step_inputs(batch, self.bs, feed.src if feed is not None else None)
        rows = np.fromiter(
            (it.seq.row for it in batch.items), dtype=np.int32, count=len(batch.items)
        )
        s = inp.num_seqs
        fed = feed.tokens if feed is not None else None
        if batch.is_decode_only and self.graph_sizes and s <= self.graph_sizes[-1]:
            logits, greedy = self._replay(inp, rows, fed)
        else:
            logits, greedy = self._eager(inp, rows, fed, batch), None
        if not inp.sample_items:
            return self._to_host(self._arange[:0].long())
        items = [batch.items[i] for i in inp.sample_items]
        seqs = [it.seq for it in items]
        params = [q.sampling for q in seqs]
        wants = [p.logprobs for p in params]
        banned = banned_stops(params, [generated_before(it) for it in items])
        grammars = grammar_states(seqs)
        plain = banned is None and not any(grammars)
        if greedy is not None and plain and all(p.greedy for p in params):
            launched = self._to_host(greedy[: len(seqs)], self._download_stream)
            launched.logprobs = sampled_logprobs(logits[: len(seqs)], launched.tokens, wants)
            return launched
        gens = []
        for q in seqs:
            if q.generator is None and not q.sampling.greedy:
                q.generator = make_generator(q.sampling, self.device)
            gens.append(q.generator)
        # a graph's are the shared buffer's rows: no replay rewrites them before this sampling
        # is enqueued (a pending one too: the core enqueues it before its next launch)
        row_logits = logits[: len(seqs)]

        def sample() -> Launched:
            masked = apply_grammar_masks(row_logits, grammar_states(seqs))
            tokens = sample_batch(masked, params, gens, banned)  # type: ignore[arg-type]
            launched = self._to_host(tokens)
            # of the raw logits, as without a grammar (SamplingParams.logprobs)
            launched.logprobs = sampled_logprobs(row_logits, tokens, wants)
            return launched

        return sample() if feed is None else sample_when_ready(sample, seqs, self.device)

    def _to_host(self, tokens: torch.Tensor, stream: torch.cuda.Stream | None = None) -> Launched:
        """Start the copy of ``tokens`` into the next of two host buffers, each with its event
        (two launches are in flight at most: the core collects a step before it launches the
        one after next); on ``stream`` after the work queued so far when given (a graph's
        tokens, which only the replay after next rewrites), else on the current stream."""
        self._flip ^= 1
        host = self._token_host[self._flip]
        done = self._copied[self._flip] if self._copied else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # no-op for None
            host[: tokens.shape[0]].copy_(tokens, non_blocking=True)
            if done is not None:
                done.record()
        return Launched(tokens, host, done)

    def _eager(
        self,
        inp: StepInputs,
        rows: np.ndarray,
        fed: torch.Tensor | None,
        batch: ScheduledBatch | None = None,
    ) -> torch.Tensor:
        """The sampled rows' logits; ``batch``: the prompt logprobs its chunks ask for are
        collected from the same hidden states (``cloud_engine.logprobs``)."""
        shape = tile_shape(self.group, inp.max_q_len)
        tile_seq, tile_q0 = make_tiles(inp.q_start, shape.block_q)
        parts = [
            inp.input_ids, inp.positions, inp.slot_mapping, rows, inp.seq_lens, inp.q_start,
            tile_seq, tile_q0, inp.sample_idx,
        ]  # fmt: skip
        packed, where = pack_aligned(parts)
        dev = self._upload(packed)
        ids, pos, slots, seq_rows, seq_lens, q_start, t_seq, t_q0, sample_idx = (
            dev[sl] for sl in where
        )
        if fed is not None:
            ids = fed.index_select(0, ids).to(torch.int32)
        meta = None
        if self.torch_ops:
            meta = make_meta(
                slots.long(),
                self.tables[seq_rows.long()].long(),
                inp.q_start.tolist(),
                inp.seq_lens.tolist(),
            )
        a = AttnInputs(slots, self.tables, seq_rows, seq_lens, q_start, t_seq, t_q0, shape, meta)
        hidden = self.fm.forward(ids, pos, a)
        if batch is not None and any(it.seq.needs_prompt_logprobs for it in batch.items):
            collect_prompt_logprobs(batch, inp.q_start.tolist(), hidden, self.fm.logits)
        return self.fm.logits(hidden[sample_idx.long()])

    def _decode_forward(
        self, ints: torch.Tensor, b: int, parity: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a = AttnInputs(
            ints[2, :b], self.tables, ints[3, :b], ints[4, :b], self._arange[: b + 1],
            self._arange[:b], self._zeros[:b], tile_shape(self.group, 1),
        )  # fmt: skip
        h = self.fm.embed_fed(ints[0, :b], ints[5, :b], self._graph_tokens[1 - parity])
        tokens, logits = self._graph_tokens[parity][:b], self._graph_logits[:b]
        return self.fm.forward_argmax(ints[1, :b], a, h, tokens, logits)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the two decode graphs (one per parity) of every ladder size, largest first
        (all sharing one memory pool)."""
        if not self.graph_sizes:
            return
        for b in reversed(self.graph_sizes):
            pair = tuple(self._capture(b, parity) for parity in (0, 1))
            self.graphs[b] = pair  # type: ignore[assignment]
        self._warm_eager_logits()
        torch.cuda.synchronize(self.device)

    def _capture(self, b: int, parity: int) -> _DecodeGraph:
        # rows padded to 4 entries: every row starts on a 16-byte boundary
        ints = torch.zeros((6, -(-b // 4) * 4), dtype=torch.int32, device=self.device)
        ints[2] = -1
        ints[4] = 1
        ints[5] = -1
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode_forward(ints, b, parity)
        torch.cuda.current_stream(self.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._graph_pool):
            logits, tokens = self._decode_forward(ints, b, parity)
        self._graph_pool = g.pool()
        host = torch.empty(tuple(ints.shape), dtype=torch.int32, pin_memory=True)
        return _DecodeGraph(g, ints, logits, tokens, host, torch.cuda.Event())

    def graph_for(self, batch: int) -> _DecodeGraph:
        """The decode graph that serves ``batch`` sequences, of the parity replayed last (its
        ``logits`` hold that replay's when it was of this size)."""
        size = self.graph_sizes[bisect.bisect_left(self.graph_sizes, batch)]
        return self.graphs[size][self._parity ^ 1]

    def _warm_eager_logits(self) -> None:
        """Compile the eager path's skinny logits kernels (prefill steps that sample one or a
        few rows) now, so that no Triton compile lands in a served step."""
        rows = self.fm.ops.gemv_rows if isinstance(self.fm.ops, TritonOps) else 0
        h = torch.zeros(
            (rows, self.fm.config.hidden_size), dtype=self.fm.embed.dtype, device=self.device
        )
        for m in range(1, rows + 1):
            self.fm.logits(h[:m])

    def _replay(
        self, inp: StepInputs, rows: np.ndarray, fed: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = inp.num_seqs
        if not self.graphs:
            self.capture_graphs()
        parity = self._parity
        self._parity ^= 1  # graph_for now names this replay's graph
        g = self.graph_for(s)
        g.uploaded.synchronize()  # the copy of two replays ago has left the staging buffer
        # fed from the previous replay's tokens: the graph picks the ids (``src`` row)
        in_graph = fed is not None and fed.data_ptr() == self._graph_tokens[1 - parity].data_ptr()
        host = g.host.numpy()
        host[:, s:] = 0
        host[0, :s] = 0 if in_graph else inp.input_ids
        host[1, :s] = inp.positions
        host[2, :s] = inp.slot_mapping
        host[2, s:] = -1
        host[3, :s] = rows
        host[4, :s] = inp.seq_lens
        host[4, s:] = 1
        host[5] = -1
        if in_graph:
            host[5, :s] = inp.input_ids  # indices into the fed tokens
            self.graph_feeds += 1
        up = self._upload_stream
        assert up is not None
        with torch.cuda.stream(up):  # the graph of two replays ago has read ``g.ints``
            g.ints.copy_(g.host, non_blocking=True)
            g.uploaded.record(up)
        torch.cuda.current_stream(self.device).wait_event(g.uploaded)
        if fed is not None and not in_graph:  # stream order: read before a later step writes it
            g.ints[0, :s] = fed.index_select(0, g.ints[0, :s])
        g.graph.replay()
        return g.logits, g.tokens
