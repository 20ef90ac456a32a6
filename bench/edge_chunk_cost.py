"""What a prefill chunk's size costs on the edge engine: one prompt prefilled in chunks of 16,
32, 64 and 256 tokens (256, the engine's full chunk, is the peer), per prompt token.

Every run of the graph streams the weights once, so a short chunk pays about a decode step on
top of its tokens: the price of the short chunks the scheduler runs beside decoding rows
(``--prefill-stall-ratio``). One slot, no prefix reuse, fresh random prompts; the best of
``--reps`` runs per size.

    python bench/edge_chunk_cost.py [--variant int8] [--threads 1] [--tokens 1024]

Writes bench/results/edge_chunk_cost.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results

FULL = 256


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from edge_runtime.engine import EdgeEngine, EdgeEngineConfig, greedy
    from routing.engine import GenerationRequest

    rng = np.random.default_rng(args.seed)
    rows = []
    for chunk in args.chunks:
        cfg = EdgeEngineConfig(
            slots=1, threads=args.threads, prefill_chunk=chunk, prefix_reuse=False
        )
        engine = EdgeEngine.from_model(args.model, variant=args.variant, config=cfg)
        await engine.start()
        times = []
        for _ in range(args.reps):
            prompt = rng.integers(100, 40000, args.tokens).tolist()
            t0 = time.perf_counter()
            async for _ in engine.generate(GenerationRequest(prompt, greedy(1))):
                pass
            times.append(time.perf_counter() - t0)
        await engine.shutdown()
        best = min(times)
        rows.append(
            {
                "chunk_tokens": chunk,
                "ttft_ms_best": best * 1e3,
                "ttft_ms_all": [round(t * 1e3, 1) for t in times],
                "ms_per_token": best * 1e3 / args.tokens,
            }
        )
    full = next((r for r in rows if r["chunk_tokens"] == FULL), rows[-1])
    for r in rows:
        r["vs_full_chunk"] = r["ms_per_token"] / full["ms_per_token"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--variant", default="int8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, FULL])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = asyncio.run(bench(args))
    command = recorded_command("edge_chunk_cost.py", sys.argv[1:], ())
    markdown = "\n".join(
        [
            f"# Prefill of {args.tokens} tokens by chunk size ({args.variant}, "
            f"{args.threads} thread)",
            "",
            f"`{command}`",
            "",
            table(rows, ["chunk_tokens", "ttft_ms_best", "ms_per_token", "vs_full_chunk"]),
        ]
    )
    write_results("edge_chunk_cost", {"meta": {**machine(), **vars(args), "command": command},
                                      "rows": rows}, markdown)  # fmt: skip


if __name__ == "__main__":
    main()
