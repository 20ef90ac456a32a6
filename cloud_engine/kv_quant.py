"""KV storage formats: the element type the pool stores, the 8-bit formats' scales, and the
``auto`` choice.

Choices (``EngineConfig.kv_dtype``, ``--kv-dtype``): ``bf16`` stores bfloat16, ``fp8`` stores
float8 e4m3 (``torch.float8_e4m3fn``), ``int8`` stores int8, and ``auto`` stores what the model
computes in unless that pool would be short (:func:`choose_storage`).

The 8-bit formats keep a float32 scale per token and per KV head: a stored head vector is
``q = x / s`` rounded to the format (int8: to the nearest integer, ties away from zero; fp8: to
the nearest e4m3 value), with ``s = max|x| / QMAX`` (``QMAX`` 127 for int8, 448 for fp8), so
``x ≈ q * s``, the largest element exact up to the format's rounding. Per token, not per head
for the whole cache: a scale is set when its token is written, from that token alone, so it
needs no calibration, an outlier token costs precision only to itself, and writing a token never
rescales what is stored. It costs 4 bytes per head vector beside ``head_dim`` (3% of an fp8 head
of 128, 6% of one of 64).

Invariants: :func:`quantize` never produces a value beyond ``±QMAX`` or a NaN (zero vectors get
the scale ``1e-8 / QMAX`` and zeros); :func:`dequantize` of :func:`quantize` of ``x`` is within
half a step of the format of each element (int8: ``s / 2``; fp8: 2**-4 of the element's
magnitude, or ``s * 2**-10`` below e4m3's normal range).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

from routing.blocks import BLOCK_SIZE

KVChoice = Literal["auto", "bf16", "fp8", "int8"]
KV_CHOICES: tuple[str, ...] = ("auto", "bf16", "fp8", "int8")
FP8 = torch.float8_e4m3fn
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, FP8: 448.0}
AUTO_MIN_SEQUENCES = 4  # ``auto`` compresses when the pool holds fewer max-length sequences
_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    FP8: "fp8",
    torch.int8: "int8",
}


def is_scaled(dtype: torch.dtype) -> bool:
    """True for the 8-bit storage formats, which keep a scale per token and head."""
    return dtype in QMAX


def kv_name(dtype: torch.dtype) -> str:
    """The storage format's short name, as reported (``fp32``, ``bf16``, ``fp8``, ``int8``)."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def storage_of(choice: str) -> torch.dtype:
    """The element type of an explicit choice (not ``auto``)."""
    table = {"bf16": torch.bfloat16, "fp8": FP8, "int8": torch.int8}
    if choice not in table:
        raise ValueError(f"KV dtype {choice!r}: choose one of {', '.join(KV_CHOICES)}")
    return table[choice]


def choose_storage(
    choice: str,
    model_dtype: torch.dtype,
    device: torch.device,
    blocks_for: Callable[[torch.dtype], int],
    max_context: int,
    min_sequences: int = AUTO_MIN_SEQUENCES,
) -> torch.dtype:
    """The pool's element type for ``choice``.

    ``auto``: the model's dtype, unless on CUDA that pool would hold fewer than
    ``min_sequences`` sequences of ``max_context`` tokens and an fp8 pool holds more blocks
    (``blocks_for(dtype)``: the blocks a pool of that dtype would get, caps included); then
    fp8. On CPU ``auto`` never compresses: there the 8-bit formats are dequantized by torch
    ops on every read, which costs time that a CPU node's small pools do not repay.
    """
    if choice != "auto":
        return storage_of(choice)
    if device.type != "cuda":
        return model_dtype
    plain = blocks_for(model_dtype)
    if plain >= min_sequences * math.ceil(max_context / BLOCK_SIZE):
        return model_dtype
    return FP8 if blocks_for(FP8) > plain else model_dtype


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector (last axis) symmetric quantization to ``dtype`` (int8 or fp8):
    ``x ≈ q * scale[..., None]`` (see the module docstring)."""
    qmax = QMAX[dtype]
    x32 = x.float()
    scale = x32.abs().amax(dim=-1).clamp_min(1e-8) / qmax
    y = (x32 / scale.unsqueeze(-1)).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.round(y)  # ties to even here; the Triton store rounds ties away (one step)
    return y.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale[..., None]`` in ``dtype`` (the product taken in float32)."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
