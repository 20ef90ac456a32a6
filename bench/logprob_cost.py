"""What logprobs cost the engines: decode with ``logprobs`` (top 20) and prefill with prompt
logprobs (``echo``: every prompt position through the LM head) against requests of the same
length without them, on the edge engine and the CPU cloud engine, greedy, in one run; every
prompt is new (no prefix-cache hits).

**Peer:** the same requests without logprobs, alternated with them, same engine, same run.
The ratio says whether the router's latency model must count logprobs (it does not where the
ratio is within the run-to-run spread).

    python bench/logprob_cost.py [--rounds 4] [--prompt-tokens 400] [--max-tokens 48]

Writes bench/results/logprob_cost.json and .md and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results
from bench.structured import _engine


async def _timed(engine: Any, ids: list[int], sp: Any) -> tuple[float, float, int]:
    """Time to first token, decode time after it, and tokens generated (seconds)."""
    from routing.engine import GenerationRequest

    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    async for ev in engine.generate(GenerationRequest(list(ids), sp)):
        now = time.perf_counter()
        if ev.token_ids and not n:
            first = now
        n += len(ev.token_ids)
        last = now
    return first - t0, last - first, n


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from routing.engine import SamplingParams
    from routing.model_store import resolve
    from routing.prompt import PromptFormatter

    info = resolve(args.model)
    fmt = PromptFormatter.from_folder(info.path)
    rng = random.Random(5)
    words = [
        "the",
        "of",
        "a",
        "harbour",
        "light",
        "keeper",
        "storm",
        "night",
        "ship",
        "rock",
        "wave",
        "lamp",
    ]
    text = " ".join(rng.choice(words) for _ in range(args.prompt_tokens * 2))

    def prompts(case: int) -> list[list[int]]:  # never seen before: no prefix-cache hits
        return [
            fmt.encode(f"{case}.{i}.{mode}: {text}")[: args.prompt_tokens]
            for i in range(args.rounds)
            for mode in (0, 1)
        ]

    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    cases = {
        "logprobs (top 20)": replace(plain, logprobs=20),
        "prompt logprobs (echo)": replace(plain, max_tokens=1, prompt_logprobs=1),
    }
    rows = []
    for kind in args.engines:
        engine = _engine(kind, args)
        await engine.start()
        try:
            await _timed(engine, prompts(99)[0][:32], plain)  # warm-up
            for case, (name, asked) in enumerate(cases.items()):
                base = replace(plain, max_tokens=asked.max_tokens)
                got: dict[str, list[tuple[float, float, int]]] = {"without": [], "with": []}
                fresh = iter(prompts(case))
                for i in range(args.rounds):
                    order = ("without", "with") if i % 2 == 0 else ("with", "without")
                    for mode in order:
                        sp = asked if mode == "with" else base
                        got[mode].append(await _timed(engine, next(fresh), sp))
                ttft = {m: statistics.median(t for t, _, _ in v) for m, v in got.items()}
                per_tok = {
                    m: sum(d for _, d, _ in v) / max(1, sum(n - 1 for _, _, n in v))
                    for m, v in got.items()
                }
                row = {
                    "engine": kind,
                    "asked": name,
                    "ttft_ms_without": round(1e3 * ttft["without"], 1),
                    "ttft_ms_with": round(1e3 * ttft["with"], 1),
                    "ttft_ratio": round(ttft["with"] / ttft["without"], 3),
                }
                if asked.max_tokens > 1:
                    row["decode_ms_without"] = round(1e3 * per_tok["without"], 2)
                    row["decode_ms_with"] = round(1e3 * per_tok["with"], 2)
                    row["decode_ratio"] = round(per_tok["with"] / per_tok["without"], 3)
                rows.append(row)
        finally:
            await engine.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--variant", default="fp32", help="the edge engine's weights")
    ap.add_argument("--threads", type=int, default=2, help="the edge engine's threads")
    ap.add_argument("--rounds", type=int, default=4, help="requests each way, alternated")
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--engines", nargs="+", default=["edge", "cloud"])
    args = ap.parse_args()
    rows = asyncio.run(bench(args))
    command = recorded_command("logprob_cost.py", sys.argv[1:], ())
    cols = list(dict.fromkeys(k for r in rows for k in r))
    markdown = "\n".join(
        [
            f"# Logprob cost: with and without, {args.prompt_tokens}-token prompts, greedy",
            "",
            f"`{command}`",
            "",
            table(rows, cols),
        ]
    )
    payload = {"meta": {**machine(), **vars(args), "command": command}, "rows": rows}
    write_results("logprob_cost", payload, markdown)


if __name__ == "__main__":
    main()
