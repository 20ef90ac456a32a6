"""Engine configuration: device, KV budget and batching limits, with per-device defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Literal

import torch

from cloud_engine.kv_quant import AUTO_MIN_SEQUENCES, KV_CHOICES, KVChoice

# A CPU decode step is compute-bound: past a few rows per thread each row adds its whole cost,
# so more rows buy almost no throughput and slow every answer in the batch alike (one thread,
# 1,150 tokens of context: 14 tokens/s at 1 row, 20 at 4, 23 at 12, at 71 / 197 / 520 ms a
# step). Requests beyond the cap wait in the queue, where the router sees them.
CPU_ROWS_PER_THREAD = 4


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: torch.dtype | None = None  # weights and KV; default fp32 on CPU, bf16 on CUDA
    kv_memory_bytes: int | None = None  # KV budget in bytes (required on CPU unless defaulted)
    kv_memory_fraction: float = 0.8  # CUDA: share of the free memory after the weights load
    max_kv_blocks: int | None = None  # cap on the pool size (tests use small pools)
    # what the KV pool stores: "auto" (the model's dtype unless the pool would hold fewer than
    # ``kv_auto_min_sequences`` max-length sequences on CUDA: then fp8), "bf16", "fp8" (e4m3)
    # or "int8" (both with a scale per token and head; ``cloud_engine.kv_quant``)
    kv_dtype: KVChoice = "auto"
    kv_auto_min_sequences: int = AUTO_MIN_SEQUENCES
    # max sequences in a batch; default 256 on CUDA, CPU_ROWS_PER_THREAD per torch thread on CPU
    max_running: int | None = None
    max_tokens_per_step: int | None = None  # token budget of one forward pass
    max_waiting: int = 1024  # beyond this, check() raises QueueFull
    max_context: int | None = None  # default: the model's max_position_embeddings
    cuda_graphs: bool = True  # CUDA: replay captured graphs for decode-only steps
    max_graph_batch: int = 256
    # parallel ranks run the fused model (kernels, decode graphs cut at the collectives);
    # default: on CUDA with Triton (else the eager layers)
    fused_shards: bool | None = None
    # launch the next decode step before reading this one's tokens; default: on for CUDA
    overlap: bool | None = None
    debug_checks: bool = False  # run the block integrity check around every step
    threads: int | None = None  # CPU: torch intra-op threads (None leaves torch's choice)
    # while rows decode, a step's prompt tokens are cut to what takes this many decode steps
    # (``routing.prefill_budget``); "off": the whole step budget; None: 1 on CPU, off on CUDA
    # (where a decode step is cheap beside any chunk and the step budget bounds it)
    prefill_stall_ratio: float | Literal["off"] | None = None

    def resolved(self) -> EngineConfig:
        """Fill the per-device defaults."""
        if self.kv_dtype not in KV_CHOICES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r}: choose one of {', '.join(KV_CHOICES)}")
        cuda = torch.device(self.device).type == "cuda"
        debug = self.debug_checks or os.environ.get("EDGECLOUD_DEBUG_KV", "") not in ("", "0")
        return replace(
            self,
            dtype=self.dtype or (torch.bfloat16 if cuda else torch.float32),
            kv_memory_bytes=self.kv_memory_bytes
            if self.kv_memory_bytes is not None or cuda
            else 512 * 2**20,
            max_running=self.max_running
            or (256 if cuda else CPU_ROWS_PER_THREAD * (self.threads or torch.get_num_threads())),
            max_tokens_per_step=self.max_tokens_per_step or (8192 if cuda else 1024),
            overlap=cuda if self.overlap is None else self.overlap,
            prefill_stall_ratio=self.prefill_stall_ratio
            if self.prefill_stall_ratio is not None
            else ("off" if cuda else 1.0),
            debug_checks=debug,
        )
