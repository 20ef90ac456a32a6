"""Programmatic dependent launch (PDL) for the decode kernels (Hopper and later).

A kernel launched with PDL may start while the kernel before it in the stream is still running:
its programs get resident, do whatever needs no result of that kernel (the GEMV kernels load
their weight tiles, decode attention its first tile of cached keys), then block in
:func:`pdl_enter` until the previous kernel has completed and its writes are visible. Once past
the wait, a kernel lets the next one launch.

Every launch with ``launch_pdl`` goes to a kernel that calls :func:`pdl_enter` (or
:func:`pdl_enter_early`) before finishing. :func:`pdl_enter` lets the next kernel launch only
after its own wait. :func:`pdl_enter_early` lets it launch first: it serves short kernels that
read nothing before their wait (the decode-attention merge), so that the kernel after them gets
resident, and loads its weights, as early as it would without them in between; no two early
kernels follow each other, so at most three kernels overlap. Hence the invariant of every
kernel launched with PDL: before its wait it writes nothing and reads nothing that the previous
*two* kernels write (weights, step inputs uploaded before the step, KV of earlier steps are
fine).

``EDGECLOUD_PDL=0`` (or :func:`set_enabled`) turns PDL off; kernels then launch as usual and
:func:`pdl_enter` compiles to nothing. PDL is never used under ``TRITON_INTERPRET=1`` (CPU
tensors) or before compute capability 9.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_enabled = os.environ.get("EDGECLOUD_PDL", "1") != "0"


def set_enabled(on: bool) -> None:
    """Turn PDL on or off for launches from now on (benchmarks compare both)."""
    global _enabled
    _enabled = on


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on ``t``'s device launch with PDL."""
    return _enabled and t.is_cuda and _capable(t.device.index or 0)


def launch_kwargs(pdl: bool) -> dict[str, bool]:
    """Extra launch arguments of a kernel whose ``PDL`` constexpr is ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel to complete, then let the next one launch (no-op unless
    ``PDL``)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def pdl_enter_early(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one to complete (no-op unless
    ``PDL``). Only for kernels that read nothing before the call and that no other early kernel
    directly precedes or follows."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
