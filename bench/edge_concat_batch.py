"""Portable (concat) edge graphs: busy slots decoded as one batch vs one slot at a time.

The concat flavour of the edge graph (standard ONNX ops only, for execution providers without
ONNX Runtime's contrib ops) writes ``present = concat(past, new)``, so rows of different lengths
cannot share one in-place cache. The decoder gathers the busy slots into one zero-padded,
masked batch per step and scatters each row back; the peer is the same decoder driven one slot
per run (what it did before), on the same graph, prompts and process, rounds alternating.

    python bench/edge_concat_batch.py [--threads 1] [--slots 4] [--steps 16] [--rounds 3]

Writes bench/results/edge_concat_batch.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, table, write_results


def decode_rate(decoder, slots: int, steps: int, batched: bool, seed: int) -> float:  # type: ignore[no-untyped-def]
    """Tokens/s over ``steps`` greedy steps of ``slots`` prompts of different lengths."""
    rng = np.random.default_rng(seed)
    lengths = np.array([60 + 30 * s for s in range(slots)], np.int64)
    for s, n in enumerate(lengths):
        decoder.prefill(s, rng.integers(100, 20000, int(n)).tolist(), 0)
    tokens = rng.integers(100, 20000, slots).astype(np.int64)
    every = np.ones(slots, bool)
    t0 = time.perf_counter()
    for _ in range(steps):
        if batched:
            logits = decoder.decode(tokens, lengths, every)
        else:
            one = np.eye(slots, dtype=bool)
            logits = np.stack([decoder.decode(tokens, lengths, one[r])[r] for r in range(slots)])
        tokens = logits.argmax(axis=1).astype(np.int64)
        lengths = lengths + 1
    return slots * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="store name or HF folder (default model)")
    ap.add_argument("--variant", default="fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from edge_runtime.engine import EdgeEngine, EdgeEngineConfig
    from edge_runtime.export import ensure_export
    from routing.model_store import DEFAULT_MODEL, resolve

    info = resolve(args.model or DEFAULT_MODEL)
    folder = ensure_export(info.path, args.variant, "concat").folder
    config = EdgeEngineConfig(slots=args.slots, threads=args.threads, warmup=False, context=512)
    decoder = EdgeEngine(folder, config)._load().decoder
    runs: dict[str, list[float]] = {"batched": [], "one slot per run": []}
    for r in range(args.rounds):
        for mode in runs:
            runs[mode].append(decode_rate(decoder, args.slots, args.steps, mode == "batched", r))
    rows = [
        {"mode": mode, "tok_s": statistics.median(v), "rounds": ", ".join(f"{x:.1f}" for x in v)}
        for mode, v in runs.items()
    ]
    speedup = rows[0]["tok_s"] / rows[1]["tok_s"]
    md = "\n\n".join(
        [
            f"# Edge concat graph: {args.slots} slots batched vs one slot per run",
            f"Model {info.name}, {args.variant}, {args.threads} intra-op thread(s); slots of "
            f"60, 90, ... tokens, {args.steps} greedy steps each, median of {args.rounds} "
            "alternating rounds, one process. Command: `python bench/edge_concat_batch.py "
            + " ".join(sys.argv[1:])
            + "`.",
            table(rows, ["mode", "tok_s", "rounds"]),
            f"Batched / one slot per run: {speedup:.2f}x.",
        ]
    )
    payload = {"meta": {**machine(), **vars(args)}, "rows": rows, "speedup": speedup}
    write_results("edge_concat_batch", payload, md)


if __name__ == "__main__":
    main()
