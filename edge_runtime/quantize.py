"""Weight quantization of an fp32 decoder graph with ONNX Runtime's own quantizers.

Both variants are ``MatMulNBits`` with ``accuracy_level=4``: the kernel quantizes each
activation row by blocks of its own, so a token's logits do not depend on the other tokens of
its chunk or batch (greedy answers repeat whatever the prefill chunking, the prefix cache or the
neighbours in a batch; ``edge_runtime.quality_gate`` checks it).

- ``int8``: 8-bit affine blocks of ``INT8_BLOCK_SIZE`` inputs (a scale and a zero point per
  block; the kernel's activation blocks are as wide, so narrower blocks also quantize the
  activations finer). Before quantizing, SmoothQuant scales (``edge_runtime.smoothing``) move
  the norm-fed MatMuls' activation outliers into their weights, where the kernel's int8
  activations lose least.
- ``int4``: 4-bit symmetric blocks of ``INT4_BLOCK_SIZE``; the embedding table too
  (``GatherBlockQuantized``: read one row per token, so this saves memory, not time).

Both need the LM head as a constant MatMul weight: the export unties it from the embedding.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

log = logging.getLogger(__name__)

INT4_BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations, quantized row by row (the fast kernels)
INT8_BLOCK_SIZE = 32  # inputs per weight block, and per activation block in the kernel


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


def _smoothed(model: onnx.ModelProto, src: Path) -> None:
    """Apply SmoothQuant scales calibrated on ``src``'s graph with the shipped prompts (as chat
    turns where its folder's tokenizer has a chat template, else as plain text)."""
    from edge_runtime.graph_info import read_graph_info
    from edge_runtime.smoothing import activation_max, calibration_prompts, smooth
    from routing.prompt import PromptFormatter

    fmt = PromptFormatter.from_folder(src.parent)
    if fmt.chat_template:
        prompts = [fmt.encode_chat([{"role": "user", "content": p}]) for p in calibration_prompts()]
    else:  # a base model: the prompts as plain text
        prompts = [fmt.encode(p) for p in calibration_prompts()]
    n = smooth(model, activation_max(model, read_graph_info(src), prompts))
    log.info("smoothed %d norm-fed MatMuls of %s", n, src)


def _matmul_nbits(
    src: Path,
    dst: Path,
    bits: int,
    block_size: int | None,
    weights: tuple[str, ...],
    symmetric: bool,
    smooth: bool = False,
) -> None:
    """Quantize the ``weights`` ops of ``src`` (``MatMul``; ``Gather``: the embedding) to
    ``bits``-bit blocks, symmetric or affine (``block_size`` None:
    :func:`blockwise_block_size`), with int8 activations in the kernels (``ACCURACY_LEVEL``);
    ``smooth``: SmoothQuant scales first (:func:`_smoothed`)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src), load_external_data=True)
    if smooth:
        _smoothed(model, src)
    axes = {"MatMul": 0, "Gather": 1}
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=block_size or blockwise_block_size(model),
        is_symmetric=symmetric,
        accuracy_level=ACCURACY_LEVEL,
        op_types_to_quantize=weights,
        quant_axes=tuple((op, axes[op]) for op in weights),
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), True)


def quantize_int8_affine(src: Path, dst: Path) -> None:
    _matmul_nbits(src, dst, 8, None, ("MatMul",), symmetric=False, smooth=True)


def quantize_int4(src: Path, dst: Path) -> None:
    # the embedding too: GatherBlockQuantized
    _matmul_nbits(src, dst, 4, INT4_BLOCK_SIZE, ("MatMul", "Gather"), symmetric=True)


def quantize(variant: str, src: Path, dst: Path) -> None:
    """Write the ``variant`` (``int8`` or ``int4``) of the fp32 graph ``src`` to ``dst``."""
    if variant == "int8":
        quantize_int8_affine(src, dst)
    elif variant == "int4":
        quantize_int4(src, dst)
    else:
        raise ValueError(f"unknown quantized variant {variant!r}")
