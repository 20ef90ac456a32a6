"""Model runners: execute one scheduled batch over the paged KV pool and sample.

:class:`TorchRunner` runs the reference :class:`LlamaForCausalLM` unchanged, with
:class:`TorchPagedBackend` as its attention backend (any device; the CPU path). The CUDA path,
with fused weights, Triton kernels and CUDA graphs, is ``cloud_engine.cuda_runner.CudaRunner``.

Invariant of every runner: ``launch(batch)`` writes the KV of exactly the batch's new tokens
into their slots and samples one token id per sampling item (``ScheduledSeq.samples``), in
batch order; ``collect`` returns them as host integers. Between the two the host is free: the
engine core plans and launches the next decode step before it reads this one's tokens, feeding
that step's input ids on the device from this launch's sampled tokens (:class:`Feed`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from cloud_engine.attention_torch import TorchPagedBackend, make_meta
from cloud_engine.grammar_mask import apply_grammar_masks, grammar_states
from cloud_engine.kv_pool import KVPool
from cloud_engine.logprobs import collect_prompt_logprobs, sampled_logprobs
from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.sampler import banned_stops, make_generator, sample_batch
from cloud_engine.scheduler import ScheduledBatch, ScheduledSeq
from cloud_engine.sequence import Sequence
from cloud_engine.step_inputs import build_step_inputs, padded_block_tables
from routing.engine import TokenLogprob


@dataclass(slots=True)
class Feed:
    """Input ids that live on the device: item ``i`` of a decode batch takes ``tokens[src[i]]``,
    a token an earlier launch sampled and the host has not read yet."""

    tokens: torch.Tensor  # [M] int64, on the runner's device
    src: np.ndarray  # [S] int64 indices into ``tokens``, one per batch item


@dataclass(slots=True)
class Launched:
    """A launched step: its sampled ids on the device and their copy on the way to the host.

    ``tokens`` stays valid until the runner's next launch has been enqueued (a feed reads it
    in stream order); ``host`` is safe to read once ``done`` has completed.

    A look-ahead step with grammar rows is launched *pending*: its forward pass is enqueued,
    but its rows' masks need the tokens of the step before it, which the host has not read
    yet. ``pending`` enqueues its masks and sampling and returns the step launched; the core
    calls it once it has committed the step before (the states then include its tokens),
    before it launches anything else, so the masks are computed while the device still runs
    this step's forward pass."""

    tokens: torch.Tensor  # [M] int64 on the device
    host: torch.Tensor  # [>= M] int64 host buffer the copy lands in
    done: torch.cuda.Event | None  # None: the copy already happened (CPU)
    # per sampled token, its log-probabilities where its sequence asks (None: no row asks)
    logprobs: list[TokenLogprob | None] | None = None
    pending: Callable[[], Launched] | None = None  # its sampling, not yet enqueued

    def read(self) -> list[int]:
        assert self.pending is None, "a pending launch samples first"
        if self.done is not None:
            self.done.synchronize()
        return self.host[: self.tokens.shape[0]].tolist()


class ModelRunner(Protocol):
    pool: KVPool

    def launch(self, batch: ScheduledBatch, feed: Feed | None = None) -> Launched:
        """Enqueue the forward pass and sampling of ``batch`` (``feed``: its input ids come
        from an earlier launch, on the device)."""
        ...

    def release(self, seq: Sequence) -> None:
        """The sequence left the running set (finished, aborted or preempted)."""
        ...


class TorchRunner:
    applies_grammar = True  # grammar rows' masks are applied before sampling

    def __init__(self, model: LlamaForCausalLM, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.block_size = pool.spec.block_size

    def release(self, seq: Sequence) -> None:
        seq.row = -1

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, feed: Feed | None = None) -> Launched:
        inp = build_step_inputs(batch, self.block_size, feed.src if feed is not None else None)
        dev = self.device
        meta = make_meta(
            torch.from_numpy(inp.slot_mapping).to(dev),
            torch.from_numpy(padded_block_tables(batch)).to(dev),
            inp.q_start.tolist(),
            inp.seq_lens.tolist(),
        )
        ids = torch.from_numpy(inp.input_ids).to(dev)
        if feed is not None:  # ``ids`` holds indices into the fed tokens
            ids = feed.tokens[ids]
        ids = ids.unsqueeze(0)
        pos = torch.from_numpy(inp.positions).to(dev).unsqueeze(0)
        hidden = self.model.hidden_states(ids, pos, TorchPagedBackend(self.pool, meta))
        if any(it.seq.needs_prompt_logprobs for it in batch.items):
            collect_prompt_logprobs(batch, inp.q_start.tolist(), hidden[0], self.model.lm_head)
        if not inp.sample_items:
            return _no_tokens(dev)
        last = hidden[0, torch.from_numpy(inp.sample_idx).to(dev)]
        logits = self.model.lm_head(last)
        items = [batch.items[i] for i in inp.sample_items]
        seqs = [it.seq for it in items]
        gens = []
        for s in seqs:
            if s.generator is None and not s.sampling.greedy:
                s.generator = make_generator(s.sampling, dev)
            gens.append(s.generator)
        params = [s.sampling for s in seqs]
        banned = banned_stops(params, [generated_before(it) for it in items])

        def sample() -> Launched:
            masked = apply_grammar_masks(logits, grammar_states(seqs))
            tokens = sample_batch(masked, params, gens, banned)  # type: ignore[arg-type]
            # of the raw logits, grammar or not (SamplingParams.logprobs)
            lps = sampled_logprobs(logits, tokens, [p.logprobs for p in params])
            return Launched(tokens, tokens.cpu(), None, lps)

        return sample() if feed is None else sample_when_ready(sample, seqs, dev)


def generated_before(item: ScheduledSeq) -> int:
    """Tokens its sequence had generated before the one this sampling item samples."""
    return item.start + item.num_new - item.seq.num_prompt


def sample_when_ready(
    sample: Callable[[], Launched], seqs: list[Sequence], device: torch.device
) -> Launched:
    """``sample()`` now, or, where a row has a grammar, a pending launch that calls it later
    (a fed step's grammar states lack the tokens it is fed: see :class:`Launched`)."""
    if not any(s.grammar is not None for s in seqs):
        return sample()
    launched = _no_tokens(device)
    launched.pending = sample
    return launched


def _no_tokens(device: torch.device) -> Launched:
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return Launched(empty, empty.cpu(), None)
