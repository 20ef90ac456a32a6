"""Model runners: execute one scheduled batch over the paged KV pool and sample.

:class:`TorchRunner` runs the reference :class:`LlamaForCausalLM` unchanged, with
:class:`TorchPagedBackend` as its attention backend (any device; the CPU path). The CUDA path,
with fused weights, Triton kernels and CUDA graphs, is ``cloud_engine.cuda_runner.CudaRunner``.

Invariant of every runner: ``execute(batch)`` writes the KV of exactly the batch's new tokens
into their slots, and returns one sampled token id per sampling item (``ScheduledSeq.samples``),
in batch order.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cloud_engine.attention_torch import TorchPagedBackend, make_meta
from cloud_engine.kv_pool import KVPool
from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.sampler import make_generator, sample_batch
from cloud_engine.scheduler import ScheduledBatch
from cloud_engine.sequence import Sequence
from cloud_engine.step_inputs import build_step_inputs, padded_block_tables


class ModelRunner(Protocol):
    pool: KVPool

    def execute(self, batch: ScheduledBatch) -> list[int]: ...

    def release(self, seq: Sequence) -> None:
        """The sequence left the running set (finished, aborted or preempted)."""
        ...


class TorchRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.block_size = pool.spec.block_size

    def release(self, seq: Sequence) -> None:
        seq.row = -1

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int]:
        inp = build_step_inputs(batch, self.block_size)
        dev = self.device
        meta = make_meta(
            torch.from_numpy(inp.slot_mapping).to(dev),
            torch.from_numpy(padded_block_tables(batch)).to(dev),
            inp.q_start.tolist(),
            inp.seq_lens.tolist(),
        )
        ids = torch.from_numpy(inp.input_ids).to(dev).unsqueeze(0)
        pos = torch.from_numpy(inp.positions).to(dev).unsqueeze(0)
        hidden = self.model.hidden_states(ids, pos, TorchPagedBackend(self.pool, meta))
        if not inp.sample_items:
            return []
        last = hidden[0, torch.from_numpy(inp.sample_idx).to(dev)]
        logits = self.model.lm_head(last)
        seqs = [batch.items[i].seq for i in inp.sample_items]
        gens = []
        for s in seqs:
            if s.generator is None and not s.sampling.greedy:
                s.generator = make_generator(s.sampling, dev)
            gens.append(s.generator)
        return sample_batch(logits, [s.sampling for s in seqs], gens).tolist()  # type: ignore[arg-type]
