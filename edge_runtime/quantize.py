"""Weight quantization of an fp32 decoder graph with ONNX Runtime's own quantizers.

- ``int8``: dynamic quantization of every MatMul with a constant weight, weights **unsigned**
  per output channel. (Signed int8 weights saturate in the u8*s8 kernels of CPUs without VNNI
  and give wrong text there; unsigned weights are right on every CPU.)
- ``int4``: ``MatMulNBits`` with 4-bit symmetric blocks of 32 and ``accuracy_level=4`` (int8
  activations in the kernel; without it the 4-bit kernels are several times slower). The
  embedding table is quantized the same way (``GatherBlockQuantized``): it is read one row
  per token, so this saves memory, not time.

Both need the LM head as a constant MatMul weight: the export unties it from the embedding.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from edge_runtime.graph_passes import unfuse_skip_norms

log = logging.getLogger(__name__)

INT4_BLOCK_SIZE = 32
INT4_ACCURACY_LEVEL = 4


def quantize_int8(src: Path, dst: Path) -> None:
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
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(src), load_external_data=True)
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=4,
        block_size=INT4_BLOCK_SIZE,
        is_symmetric=True,
        accuracy_level=INT4_ACCURACY_LEVEL,
        op_types_to_quantize=("MatMul", "Gather"),  # the embedding too: GatherBlockQuantized
        quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), True)


def quantize(variant: str, src: Path, dst: Path) -> None:
    """Write the ``variant`` of the fp32 graph ``src`` to ``dst`` (with external data)."""
    if variant == "int8":
        quantize_int8(src, dst)
    elif variant == "int4":
        quantize_int4(src, dst)
    else:
        raise ValueError(f"unknown quantized variant {variant!r}")
