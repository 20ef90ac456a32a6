"""Weight quantization of an fp32 decoder graph with ONNX Runtime's own quantizers.

- ``int8``, two methods (:func:`int8_method` picks one for this CPU):
  - ``blockwise``: ``MatMulNBits`` with 8-bit symmetric weight blocks of
    ``INT8_BLOCK_SIZE`` and ``accuracy_level=4``: the kernel quantizes each activation row
    by blocks of its own, so a token's logits do not depend on the other tokens of its chunk
    or batch (greedy answers repeat whatever the prefill chunking, the prefix cache or the
    neighbours in a batch). Needs int8 dot products (x86 VNNI): without them ONNX Runtime's
    8-bit ``MatMulNBits`` falls to about 1 token/s.
  - ``per_tensor``: dynamic quantization of every MatMul with a constant weight
    (``DynamicQuantizeLinear``: one scale for the whole activation tensor), weights
    **unsigned** per output channel. Fast on every CPU, but a token's result depends on the
    other tokens quantized with it: the same prompt prefilled in one chunk or in two, or
    after a cached prefix, can give other greedy tokens. (Signed int8 weights saturate in the
    u8*s8 kernels of CPUs without VNNI and give wrong text there; unsigned weights are right
    on every CPU.)
- ``int4``: ``MatMulNBits`` with 4-bit symmetric blocks of 32 and ``accuracy_level=4`` (int8
  activations in the kernel; without it the 4-bit kernels are several times slower). The
  embedding table is quantized the same way (``GatherBlockQuantized``): it is read one row
  per token, so this saves memory, not time.

Both need the LM head as a constant MatMul weight: the export unties it from the embedding.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path
from typing import Literal, get_args

import onnx

from edge_runtime.graph_passes import unfuse_skip_norms

log = logging.getLogger(__name__)

INT4_BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations, quantized row by row (the fast kernels)
INT8_BLOCK_SIZE = 128  # 32 was no more faithful to fp32 (greedy agreement) and slower to decode

Int8Method = Literal["blockwise", "per_tensor"]
INT8_METHODS: tuple[str, ...] = get_args(Int8Method)
INT8_METHOD_ENV = "EDGECLOUD_INT8_METHOD"


class Int8MethodError(ValueError):
    """``$EDGECLOUD_INT8_METHOD`` names no method."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def int8_method(flags: frozenset[str] | None = None) -> Int8Method:
    """``$EDGECLOUD_INT8_METHOD`` when set, else ``blockwise`` on an x86 CPU with int8 dot
    products (AVX-512 VNNI or AVX-VNNI), else ``per_tensor``."""
    forced = os.environ.get(INT8_METHOD_ENV, "").strip()
    if forced:
        if forced not in INT8_METHODS:
            raise Int8MethodError(
                f"{INT8_METHOD_ENV} must be one of {', '.join(INT8_METHODS)}, not {forced!r}"
            )
        return forced  # type: ignore[return-value]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "per_tensor"
    flags = cpu_flags() if flags is None else flags
    return "blockwise" if flags & {"avx512_vnni", "avx_vnni"} else "per_tensor"


def blockwise_block_size(model: onnx.ModelProto, widest: int = INT8_BLOCK_SIZE) -> int:
    """``widest``, or the largest power of two (at least 16) within the narrowest input
    dimension of the weights to quantize: a block wider than a row's input runs another
    kernel, whose result depends on the other rows (measured: a tiny model's logits moved by
    0.01 between a prompt prefilled whole and in two chunks with blocks of 128 over 64 inputs,
    not at all with blocks of 64 or less)."""
    weights = {t.name: t for t in model.graph.initializer}
    inputs = [
        weights[n.input[1]].dims[0]
        for n in model.graph.node
        if n.op_type == "MatMul" and n.input[1] in weights and len(weights[n.input[1]].dims) == 2
    ]
    block = widest
    while inputs and block > 16 and block > min(inputs):
        block //= 2
    return block


def _matmul_nbits(
    src: Path, dst: Path, bits: int, block_size: int | None, weights: tuple[str, ...]
) -> None:
    """Quantize the ``weights`` ops of ``src`` (``MatMul``; ``Gather``: the embedding) to
    ``bits``-bit symmetric blocks (``block_size`` None: :func:`blockwise_block_size`), with
    int8 activations in the kernels (``ACCURACY_LEVEL``)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src), load_external_data=True)
    axes = {"MatMul": 0, "Gather": 1}
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=block_size or blockwise_block_size(model),
        is_symmetric=True,
        accuracy_level=ACCURACY_LEVEL,
        op_types_to_quantize=weights,
        quant_axes=tuple((op, axes[op]) for op in weights),
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), True)


def quantize_int8_blockwise(src: Path, dst: Path) -> None:
    _matmul_nbits(src, dst, 8, None, ("MatMul",))


def quantize_int8_per_tensor(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(src), load_external_data=True)
    unfuse_skip_norms(model)  # see graph_passes.unfuse_skip_norms
    quantize_dynamic(
        model,
        dst,
        op_types_to_quantize=["MatMul"],
        per_channel=True,
        reduce_range=False,
        weight_type=QuantType.QUInt8,
        use_external_data_format=True,
        # shape inference stops at contrib ops (GroupQueryAttention): say outputs are float
        extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
    )


def quantize_int4(src: Path, dst: Path) -> None:
    # the embedding too: GatherBlockQuantized
    _matmul_nbits(src, dst, 4, INT4_BLOCK_SIZE, ("MatMul", "Gather"))


def quantize(variant: str, src: Path, dst: Path, method: Int8Method | None = None) -> None:
    """Write the ``variant`` of the fp32 graph ``src`` to ``dst`` (with external data);
    ``method`` says how ``int8`` is made (None: ``per_tensor``)."""
    if variant == "int8" and method == "blockwise":
        quantize_int8_blockwise(src, dst)
    elif variant == "int8":
        quantize_int8_per_tensor(src, dst)
    elif variant == "int4":
        quantize_int4(src, dst)
    else:
        raise ValueError(f"unknown quantized variant {variant!r}")
