"""The KV memory pool: one region, allocated once, divided into fixed-size token blocks.

Layout: ``data[layer, 0 | 1, block, slot, kv_head, head_dim]`` (0 = keys, 1 = values), so the
keys of one layer, ``data[layer, 0]``, are a contiguous ``[blocks, block_size, kv_heads,
head_dim]`` tensor that attention kernels index as ``block * block_size + slot``.

The element type is the spec's ``storage`` (default: the model's dtype; see
``cloud_engine.kv_quant``). The 8-bit formats (int8, fp8 e4m3) add a float32 scale per token and
per head (``scales[layer, 0 | 1, block, slot, kv_head]``), so a stored vector is ``x / s``
rounded to the format: that nearly halves the bytes per block against bf16 (an fp8 pool of
head_dim 128 holds 1.94x the tokens of a bf16 one in the same bytes) and quarters them against
fp32.

Invariants:
- Nothing allocates KV memory after construction: requests borrow blocks (by index) through the
  block manager and give them back.
- A block index is valid in every layer at once; block ``i`` of layer 3 belongs to the same
  request as block ``i`` of layer 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from cloud_engine.kv_quant import AUTO_MIN_SEQUENCES, choose_storage, is_scaled, kv_name
from routing.blocks import BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The shape of one token's KV entry in every layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # dtype of the model's k/v: what reads of the pool return
    storage: torch.dtype | None = None  # element type stored (None: ``dtype``)
    block_size: int = BLOCK_SIZE

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.storage or self.dtype

    @property
    def scaled(self) -> bool:
        """The pool keeps a float32 scale per token and head (int8, fp8)."""
        return is_scaled(self.storage_dtype)

    @property
    def kv_dtype(self) -> str:
        """The storage format's name as reported (``bf16``, ``fp8``, ...)."""
        return kv_name(self.storage_dtype)

    def with_storage(self, storage: torch.dtype) -> KVSpec:
        return replace(self, storage=None if storage == self.dtype else storage)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers (keys and values, scales included)."""
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        per_head = self.head_dim * elem + (4 if self.scaled else 0)
        return self.num_layers * 2 * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def budget_bytes_for(
    device: torch.device, memory_fraction: float | None, memory_bytes: int | None
) -> int:
    """The KV budget: explicit bytes win; on CUDA, else a fraction of the *free* device memory
    (taken after the weights are loaded); on CPU a byte budget is required."""
    if memory_bytes is not None:
        return int(memory_bytes)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * (memory_fraction if memory_fraction is not None else 0.8))
    raise ValueError("on CPU give the KV budget in bytes (memory_bytes)")


def blocks_within(
    spec: KVSpec,
    budget_bytes: int,
    max_blocks: int | None = None,
    agree: Callable[[int], int] | None = None,
) -> int:
    """Blocks of ``spec`` that ``budget_bytes`` holds, at most ``max_blocks``; ``agree``
    (a parallel engine's minimum over its ranks) makes every rank take the same count."""
    n = budget_bytes // spec.bytes_per_block
    if max_blocks is not None:
        n = min(n, max_blocks)
    return agree(int(n)) if agree is not None else int(n)


def sized_pool(
    spec: KVSpec,
    choice: str,
    device: torch.device | str,
    budget_bytes: int,
    max_blocks: int | None,
    max_context: int,
    min_sequences: int = AUTO_MIN_SEQUENCES,
    agree: Callable[[int], int] | None = None,
) -> KVPool:
    """The pool for a KV dtype ``choice`` (``cloud_engine.kv_quant``) within a byte budget:
    ``spec`` gives the shape and the model's dtype. With ``agree``, every rank calls this in
    the same order and gets the same storage and block count."""
    device = torch.device(device)

    def count(storage: torch.dtype) -> int:
        return blocks_within(spec.with_storage(storage), budget_bytes, max_blocks, agree)

    storage = choose_storage(choice, spec.dtype, device, count, max_context, min_sequences)
    chosen = spec.with_storage(storage)
    return KVPool(chosen, count(storage), device)


class KVPool:
    """One pre-allocated KV region of ``num_blocks`` blocks (see the module docstring)."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks < 1:
            raise ValueError("the KV budget holds no block")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # Zeroed, not empty: masked-out slots are read (times zero) by kernels; NaN bit patterns
        # left in fresh memory would poison them.
        self.data = torch.zeros(shape, dtype=spec.storage_dtype, device=self.device)
        self.scales: torch.Tensor | None = None
        if spec.scaled:
            self.scales = torch.zeros(shape[:-1], dtype=torch.float32, device=self.device)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds: its blocks times the block size."""
        return self.num_blocks * self.spec.block_size

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    def layer(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(k, v, k_scale, v_scale)`` of one layer: ``[blocks, block_size, kv_heads, D]``
        views (scales ``[blocks, block_size, kv_heads]`` or None)."""
        k, v = self.data[layer, 0], self.data[layer, 1]
        if self.scales is None:
            return k, v, None, None
        return k, v, self.scales[layer, 0], self.scales[layer, 1]


def describe_pool(pool: KVPool) -> str:
    """One line on the KV pool: storage, blocks, tokens and bytes (logged at start-up)."""
    spec = pool.spec
    scales = " with a scale per token and head" if spec.scaled else ""
    return (
        f"{spec.kv_dtype}{scales}, {pool.num_blocks:,} blocks of {spec.block_size} tokens = "
        f"{pool.capacity_tokens:,} tokens, {pool.nbytes / 2**30:.2f} GiB"
    )
