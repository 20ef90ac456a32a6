"""What a decode step costs by the context it reads: one row decoding after prompts of 30 to
1,800 tokens, on the edge engine and the cloud engine (the 30-token prompt is the peer).

A decode step reads every row's KV, so its time grows with the context: the figure the router's
replay charges per token of context (``EngineShape.decode_ms_per_context_token``) and the
latency model fits (``DecodeFit``). One row, greedy with ``ignore_eos`` so every run decodes
``--new-tokens``; the time between the first and the last token, per token, best of ``--reps``.

    python bench/decode_context.py [--threads 1] [--new-tokens 24]

Writes bench/results/decode_context.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results

if TYPE_CHECKING:
    from routing.engine import Engine


async def step_ms(engine: Engine, prompt_tokens: int, new: int, seed: int) -> float:
    from routing.engine import GenerationRequest, SamplingParams

    rng = random.Random(seed)
    prompt = [rng.randrange(100, 40000) for _ in range(prompt_tokens)]
    sampling = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    stamps = []
    async for _ in engine.generate(GenerationRequest(prompt, sampling)):
        stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) * 1e3 / (new - 1)


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from cloud_engine.config import EngineConfig
    from cloud_engine.engine import CloudEngine
    from edge_runtime.engine import EdgeEngine, EdgeEngineConfig

    engines: dict[str, Engine] = {
        "edge": EdgeEngine.from_model(
            args.model, config=EdgeEngineConfig(threads=args.threads, prefix_reuse=False)
        ),
        "cloud": CloudEngine.from_model(args.model, config=EngineConfig(threads=args.threads)),
    }
    rows = []
    for kind, engine in engines.items():
        await engine.start()
        await step_ms(engine, 30, 8, -1)  # warm-up
        base = 0.0
        for i, n in enumerate(args.contexts):
            best = min(
                [await step_ms(engine, n, args.new_tokens, 100 * i + r) for r in range(args.reps)]
            )
            base = base or best
            rows.append(
                {"engine": kind, "prompt_tokens": n, "ms_per_step": best, "vs_first": best / base}
            )
        await engine.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--contexts", type=int, nargs="+", default=[30, 250, 500, 1000, 1800])
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    rows = asyncio.run(bench(args))
    command = recorded_command("decode_context.py", sys.argv[1:], ())
    markdown = "\n".join(
        [
            f"# One row's decode step by context ({args.threads} thread)",
            "",
            f"`{command}`",
            "",
            table(rows, ["engine", "prompt_tokens", "ms_per_step", "vs_first"]),
        ]
    )
    write_results("decode_context", {"meta": {**machine(), **vars(args), "command": command},
                                     "rows": rows}, markdown)  # fmt: skip
    print(markdown)


if __name__ == "__main__":
    main()
