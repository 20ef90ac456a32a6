"""The edge's two int8 methods side by side: speed, fidelity to fp32, and whether a prompt's
logits depend on how it was chunked.

For each method (``blockwise``: 8-bit MatMulNBits, each activation row quantized on its own;
``per_tensor``: ONNX Runtime's dynamic quantization, one scale per activation tensor) the
default model's int8 graph is made in a scratch cache (the fp32 export is reused from the
edgecloud cache) and timed in alternating rounds, each in the same process: one decode step
of one row and of four rows, and a 256-token prefill. Fidelity: the largest difference of the
last logits between the int8 graph and fp32 for a 200-token prompt. Chunking: the largest
difference of the last logits between the prompt prefilled whole and in chunks of 37 + 163
(and in whole 16-token blocks, 48 + 152, which the engine's chunks beside decoding rows are).
Batching: the largest difference of one row's logits decoded alone and beside 7 other rows.

    python bench/edge_int8_methods.py --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, machine, recorded_command, table
from edge_runtime.decoder import Decoder
from edge_runtime.engine import EdgeEngine, EdgeEngineConfig
from edge_runtime.export import ensure_export, export_folder
from edge_runtime.quantize import INT8_METHODS, cpu_flags
from routing.model_store import DEFAULT_MODEL, resolve

PROMPT = 200


def decoder(folder: Path, threads: int, slots: int = 4) -> Decoder:
    config = EdgeEngineConfig(slots=slots, warmup=False, threads=threads)
    return EdgeEngine(folder, config)._load().decoder


def timed(fn: Any, n: int) -> float:
    """Median ms of ``n`` calls of ``fn``."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def measure(folder: Path, threads: int, ids: list[int]) -> dict[str, float]:
    d = decoder(folder, threads)
    for slot in range(4):
        d.prefill(slot, ids[:64], 0)
    tokens = np.array(ids[64:68], np.int64)
    lengths = np.full(4, 64, np.int64)
    one, four = np.array([True, False, False, False]), np.ones(4, bool)
    return {
        "decode_1_row_ms": timed(lambda: d.decode(tokens[:1], lengths[:1], one[:1]), 30),
        "decode_4_rows_ms": timed(lambda: d.decode(tokens, lengths, four), 30),
        "prefill_256_ms": timed(lambda: d.prefill(0, ids[:256], 0), 5),
    }


def last_logits(folder: Path, ids: list[int], cuts: tuple[int, ...] = ()) -> np.ndarray:
    d = decoder(folder, 1, slots=1)
    start, out = 0, None
    for end in (*cuts, len(ids)):
        out = d.prefill(0, ids[start:end], start)
        start = end
    assert out is not None
    return out.copy()


def batch_logit_diff(folder: Path, ids: list[int]) -> float:
    """Row 0's logits decoded alone against beside 7 other rows (prompts of 40 tokens)."""
    d = decoder(folder, 1, slots=8)
    for slot in range(8):
        d.prefill(slot, ids[slot * 8 : slot * 8 + 39], 0)
    tokens = np.array([ids[slot * 8 + 39] for slot in range(8)], np.int64)
    lengths = np.full(8, 39, np.int64)
    alone = d.decode(tokens[:1], lengths[:1], np.ones(1, bool))[0].copy()
    batched = d.decode(tokens, lengths, np.ones(8, bool))[0]
    return float(np.abs(batched - alone).max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "edge_int8_methods.json")
    args = ap.parse_args(argv)

    info = resolve(args.model)
    fp32 = ensure_export(info.path, "fp32").folder
    ids = np.random.default_rng(0).integers(3, 49000, 300).tolist()
    prompt = ids[:PROMPT]
    reference = last_logits(fp32, prompt)
    scratch = Path(tempfile.mkdtemp(prefix="edge-int8-"))
    folders: dict[str, Path] = {}
    rows: dict[str, dict[str, Any]] = {}
    try:
        for method in INT8_METHODS:
            root = scratch / method
            shutil.copytree(fp32, export_folder(info, "fp32", "gqa", root))
            graph = ensure_export(info.path, "int8", root=root, int8_method=method)
            folders[method] = graph.folder
            whole = last_logits(graph.folder, prompt)
            rows[method] = {
                "method": method,
                "vs_fp32_max_logit_diff": float(np.abs(whole - reference).max()),
                "chunked_37_max_diff": float(
                    np.abs(last_logits(graph.folder, prompt, (37,)) - whole).max()
                ),
                "chunked_48_max_diff": float(
                    np.abs(last_logits(graph.folder, prompt, (48,)) - whole).max()
                ),
                "batch_8_max_diff": batch_logit_diff(graph.folder, ids),
                "samples": [],
            }
        for _ in range(args.rounds):
            for method in INT8_METHODS:
                rows[method]["samples"].append(measure(folders[method], args.threads, ids))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    keys = ("decode_1_row_ms", "decode_4_rows_ms", "prefill_256_ms")
    base = "per_tensor"
    for row in rows.values():
        for k in keys:
            row[k] = round(statistics.median(s[k] for s in row["samples"]), 2)
    for row in rows.values():
        row["decode_1_row_vs_per_tensor"] = round(
            rows[base]["decode_1_row_ms"] / row["decode_1_row_ms"], 3
        )
    cols = [
        "method",
        *keys,
        "decode_1_row_vs_per_tensor",
        "vs_fp32_max_logit_diff",
        "chunked_37_max_diff",
        "chunked_48_max_diff",
        "batch_8_max_diff",
    ]
    text = table(list(rows.values()), cols)
    print(text)
    vnni = sorted(cpu_flags() & {"avx512_vnni", "avx_vnni"})
    record = {
        "command": recorded_command("edge_int8_methods.py", sys.argv[1:], ("--out",)),
        "machine": {**machine(), "vnni": vnni},
        "results": list(rows.values()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    args.out.with_suffix(".md").write_text(
        f"# Edge int8 methods: {args.model}\n\n{args.threads} threads, median of {args.rounds} "
        f"alternating rounds; CPU int8 dot products: {', '.join(vnni) or 'none'}.\n\n{text}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
