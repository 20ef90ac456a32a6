"""The KV memory pool: one region, allocated once, divided into fixed-size token blocks.

Layout: ``data[layer, 0 | 1, block, slot, kv_head, head_dim]`` (0 = keys, 1 = values), so the
keys of one layer, ``data[layer, 0]``, are a contiguous ``[blocks, block_size, kv_heads,
head_dim]`` tensor that attention kernels index as ``block * block_size + slot``.

With ``int8=True`` the region holds int8 values plus a float32 scale per token and per head
(``scales[layer, 0 | 1, block, slot, kv_head]``): a stored vector is ``round(x / s)`` with
``s = max|x| / 127``. That nearly halves the bytes per block against bf16 and quarters them
against fp32.

Invariants:
- Nothing allocates KV memory after construction: requests borrow blocks (by index) through the
  block manager and give them back.
- A block index is valid in every layer at once; block ``i`` of layer 3 belongs to the same
  request as block ``i`` of layer 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from routing.blocks import BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The shape of one token's KV entry in every layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # dtype of the model's k/v (the pool's dtype unless int8)
    int8: bool = False
    block_size: int = BLOCK_SIZE

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8 if self.int8 else self.dtype

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers (keys and values, scales included)."""
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        per_head = self.head_dim * elem + (4 if self.int8 else 0)
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
        if spec.int8:
            self.scales = torch.zeros(shape[:-1], dtype=torch.float32, device=self.device)

    @classmethod
    def from_budget(
        cls,
        spec: KVSpec,
        device: torch.device | str,
        budget_bytes: int,
        max_blocks: int | None = None,
    ) -> KVPool:
        n = budget_bytes // spec.bytes_per_block
        if max_blocks is not None:
            n = min(n, max_blocks)
        return cls(spec, int(n), device)

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


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector (last dim) symmetric int8: ``x ≈ q * scale[..., None]``."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1).clamp_min(1e-8) / 127.0
    q = torch.round(x32 / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale
