"""How much of the edge quality gate's verdict is chance: each variant's gate scores over copies
of its graph whose weights differ by a relative 1e-3 (far below the quantization step).

The gate (``edge_runtime.quality_gate``) counts the shipped plain questions a variant answers
right greedily and keeps it when it gets at most ``QUESTION_SLACK`` fewer than fp32. A question
whose first tokens are a near tie flips on any small change of arithmetic (another CPU's
kernels, another export), so a count near the threshold says little about one graph. Here each
variant is scored as exported and over ``--copies`` copies perturbed per weight by a Gaussian of
relative size ``--noise`` (quantized graphs: dequantized, perturbed and requantized to the same
8-bit block layout; 4-bit graphs are left out). Reported per variant: correct counts (as
exported, min/mean/max over copies), reference NLL, and the share of copies the gate's rule
keeps against the unperturbed fp32 graph. **Peer:** fp32 itself, perturbed the same way (a
count that stays put shows the noise is the variant's own, not the probe's).

    python bench/gate_stability.py [--copies 4] [--noise 1e-3] [--variants fp32,int8]

Writes bench/results/gate_stability.json and .md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results
from edge_runtime.export import ExportedGraph, ensure_export
from edge_runtime.quality_gate import (
    NLL_TOLERANCE,
    QUESTION_SLACK,
    QualitySet,
    _Probe,
    cpu_signature,
)
from routing.model_store import DEFAULT_MODEL
from routing.prompt import PromptFormatter


def _perturb_float(model: onnx.ModelProto, rel: float, rng: np.random.Generator) -> None:
    """Every 2-D float weight times ``1 + rel * N(0, 1)``, element by element (in place)."""
    for t in model.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2:
            w = numpy_helper.to_array(t)
            noisy = w * (1 + rel * rng.standard_normal(w.shape))
            t.CopyFrom(numpy_helper.from_array(noisy.astype(np.float32), t.name))


def _perturb_nbits8(model: onnx.ModelProto, rel: float, rng: np.random.Generator) -> None:
    """Every 8-bit ``MatMulNBits`` weight dequantized, perturbed like :func:`_perturb_float` and
    requantized to affine 8-bit blocks of the same width (range spanning zero; in place)."""
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        bits = next((a.i for a in node.attribute if a.name == "bits"), 0)
        if node.op_type != "MatMulNBits" or bits != 8 or len(node.input) < 4:
            continue
        q, s, z = (numpy_helper.to_array(inits[n]).astype(np.float32) for n in node.input[1:4])
        w = (q - z[..., None]) * s[..., None]
        w = w * (1 + rel * rng.standard_normal(w.shape))
        lo, hi = np.minimum(w.min(-1), 0), np.maximum(w.max(-1), 0)
        s2 = np.maximum((hi - lo) / 255, 1e-12)
        z2 = np.clip(np.round(-lo / s2), 0, 255)
        q2 = np.clip(np.round(w / s2[..., None] + z2[..., None]), 0, 255)
        new = (q2.astype(np.uint8), s2.astype(np.float32), z2.astype(np.uint8))
        for name, arr in zip(node.input[1:4], new, strict=True):
            inits[name].CopyFrom(numpy_helper.from_array(arr, name))


def perturbed_copy(graph: ExportedGraph, dst: Path, rel: float, seed: int) -> ExportedGraph:
    """``graph`` with its weights perturbed, written to ``dst`` beside copies of its folder's
    other files (tokenizer, configs)."""
    model = onnx.load(str(graph.graph_path), load_external_data=True)
    rng = np.random.default_rng(seed)
    if graph.meta.variant == "fp32":
        _perturb_float(model, rel, rng)
    else:
        _perturb_nbits8(model, rel, rng)
    dst.mkdir(parents=True)
    for f in graph.folder.iterdir():
        if f.is_file() and not f.name.startswith(graph.meta.graph_file):
            shutil.copy(f, dst / f.name)
    path = dst / graph.meta.graph_file
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return replace(graph, folder=dst)


def score(graph: ExportedGraph, qset: QualitySet, threads: int) -> dict[str, Any]:
    fmt = PromptFormatter.from_folder(graph.folder)
    got = _Probe(graph, fmt, threads).evaluate(qset)
    return {"correct": got.correct, "nll": got.nll, "invariant": got.invariant}


def kept(s: dict[str, Any], base: dict[str, Any]) -> bool:
    """The gate's rule against fp32's unperturbed score ``base``."""
    return (
        s["invariant"]
        and s["correct"] >= base["correct"] - QUESTION_SLACK
        and s["nll"] <= base["nll"] * (1 + NLL_TOLERANCE)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--variants", default="fp32,int8", help="fp32 and/or 8-bit variants")
    ap.add_argument("--copies", type=int, default=4, help="perturbed copies per variant")
    ap.add_argument("--noise", type=float, default=1e-3, help="relative weight perturbation")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    variants = args.variants.split(",")
    if variants[0] != "fp32":
        ap.error("--variants must start with fp32: the gate's rule compares against it")

    qset = QualitySet.shipped()
    rows, per_copy = [], {}
    base: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="edgecloud-gate-") as tmp:
        for variant in variants:
            graph = ensure_export(args.model, variant)
            exported = score(graph, qset, args.threads)
            base = base or exported  # fp32's, the first
            copies = []
            for seed in range(args.copies):
                copy = perturbed_copy(graph, Path(tmp) / f"{variant}-{seed}", args.noise, seed)
                copies.append(score(copy, qset, args.threads))
                print(variant, seed, copies[-1], flush=True)
            per_copy[variant] = [exported, *copies]
            counts = [c["correct"] for c in copies]
            rows.append(
                {
                    "variant": variant,
                    "correct as exported": f"{exported['correct']}/{len(qset.questions)}",
                    "correct over copies (min/mean/max)": (
                        f"{min(counts)} / {statistics.mean(counts):.1f} / {max(counts)}"
                    ),
                    "NLL as exported": f"{exported['nll']:.4f}",
                    "NLL over copies (min-max)": (
                        f"{min(c['nll'] for c in copies):.4f}-{max(c['nll'] for c in copies):.4f}"
                    ),
                    "gate keeps (copies)": f"{sum(kept(c, base) for c in copies)}/{len(copies)}",
                }
            )
    command = recorded_command("gate_stability.py", sys.argv[1:], ())
    cols = list(rows[0])
    markdown = "\n\n".join(
        [
            "# gate_stability: the quality gate's scores over near-identical graphs",
            f"`{command}` on {cpu_signature()}: {args.copies} copies per variant, weights "
            f"perturbed by a relative {args.noise:g}; the gate's rule: at most "
            f"{QUESTION_SLACK} fewer plain questions than fp32 as exported, NLL within "
            f"{100 * NLL_TOLERANCE:.0f}%, invariant.",
            table(rows, cols),
        ]
    )
    payload = {"machine": machine(), "cpu": cpu_signature(), "command": command}
    payload |= {"rows": rows, "scores": per_copy}
    write_results("gate_stability", payload, markdown)


if __name__ == "__main__":
    main()
