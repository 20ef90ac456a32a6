"""Token embedding rows for a decode step whose ids may still be on the device.

Row ``i`` takes the id ``fed[src[i]]`` where ``src[i] >= 0`` (a token an earlier step sampled and
the host has not read) and ``ids[i]`` otherwise, and copies that row of the embedding table.
Folding the id choice into the gather keeps a fed decode step's inputs inside its CUDA graph:
no index-select and cast kernels run between two graphs.

Invariant: reads ``fed`` and the table only, writes ``out`` only; it is the first kernel of a
decode graph, launched without PDL (it waits for everything before it in the stream, e.g. the
previous step's argmax writing ``fed``) and lets the next kernel launch at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from cloud_engine.kernels.pdl import use_pdl


@triton.jit
def _embed_kernel(
    ids_ptr, src_ptr, fed_ptr, table_ptr, out_ptr, H, stride_t, stride_o,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0)
    src = tl.load(src_ptr + row)
    tok = tl.load(ids_ptr + row).to(tl.int64)
    fed = tl.load(fed_ptr + tl.maximum(src, 0)).to(tl.int64)
    tok = tl.where(src >= 0, fed, tok)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(table_ptr + tok * stride_t + offs, mask=ok)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, x, mask=ok)


def embed_fed(
    ids: torch.Tensor, src: torch.Tensor, fed: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """``table[where(src >= 0, fed[src], ids)]`` ``[N, H]`` (``ids``, ``src``: int32 ``[N]``;
    ``fed``: int64 token ids)."""
    n, h = ids.shape[0], table.shape[1]
    out = torch.empty((n, h), dtype=table.dtype, device=table.device)
    if n:
        _embed_kernel[(n,)](
            ids, src, fed, table, out, h, table.stride(0), out.stride(0),
            BLOCK=triton.next_power_of_2(h), PDL=use_pdl(table), num_warps=4,
        )  # fmt: skip
    return out
