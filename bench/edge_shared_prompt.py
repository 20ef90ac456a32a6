"""Edge prefix reuse across users at once: a second user's first token while the first decodes.

Two users of one app send the same long system prompt with their own questions. User A's
request is decoding (a long answer) when user B's arrives. On the warm engine
(``prefix_reuse=True``) A's slot offers its prompt's blocks as soon as its prefill wrote
them, and B's slot gets them copied (``Decoder.copy_prefix``) and prefills only its question;
on the cold one (``prefix_reuse=False``, the peer) B prefills the whole prompt, in the short
chunks the scheduler runs beside A's decode steps. Each repetition uses a system prompt of its
own (a different document), so no free slot holds it from an earlier repetition: the only
copy of it is the one A's busy slot holds. Timed: B's TTFT, from ``generate()`` to its first
token event; engines alternate which goes first.

    python bench/edge_shared_prompt.py [--variant int8] [--threads 1] [--reps 8]

Writes bench/results/edge_shared_prompt.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results

WORDS = [
    "office",
    "policy",
    "budget",
    "meeting",
    "invoice",
    "customer",
    "schedule",
    "review",
    "report",
    "project",
]


def system_prompt(rng: random.Random, words: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return "You answer questions about this office handbook, briefly.\n\n" + body


async def first_token(engine: Any, prompt: list[int], stops: tuple[int, ...]) -> dict[str, Any]:
    from edge_runtime.engine import greedy
    from routing.engine import GenerationRequest

    t0 = time.perf_counter()
    ttft, cached, tokens = 0.0, 0, []
    async for ev in engine.generate(GenerationRequest(prompt, greedy(1, stops))):
        if not ttft:
            ttft, cached = time.perf_counter() - t0, ev.cached_tokens
        tokens += ev.token_ids
    return {"ttft_s": ttft, "cached": cached, "tokens": tokens}


async def beside_a_decoding_user(
    engine: Any, a_prompt: list[int], b_prompt: list[int], stops: tuple[int, ...]
) -> dict[str, Any]:
    """Start A (a long answer), wait for its first token, time B's first token, end A."""
    from edge_runtime.engine import greedy
    from routing.engine import GenerationRequest

    a = engine.generate(GenerationRequest(a_prompt, greedy(400)))
    await anext(a)
    try:
        return await first_token(engine, b_prompt, stops)
    finally:
        await a.aclose()


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from edge_runtime.engine import EdgeEngine, EdgeEngineConfig
    from routing.prompt import PromptFormatter

    def make(reuse: bool) -> EdgeEngine:
        cfg = EdgeEngineConfig(
            slots=args.slots, context=args.context, threads=args.threads, prefix_reuse=reuse
        )
        return EdgeEngine.from_model(args.model, variant=args.variant, config=cfg)

    load_before = os.getloadavg()[0]
    engines = {"cold": make(False), "warm": make(True)}
    for e in engines.values():
        await e.start()
    fmt = PromptFormatter.from_folder(engines["cold"].tokenizer_dir)
    stops = fmt.stop_token_ids
    rng = random.Random(args.seed)
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    prompt_tokens = []
    for rep in range(args.reps):
        system = system_prompt(rng, args.words)
        a = fmt.encode_chat([{"role": "system", "content": system},
                             {"role": "user", "content": "What is the travel policy?"}])  # fmt: skip
        b = fmt.encode_chat([{"role": "system", "content": system},
                             {"role": "user", "content": "Who approves the budget?"}])  # fmt: skip
        prompt_tokens.append(len(b))
        for name in ["cold", "warm"] if rep % 2 == 0 else ["warm", "cold"]:
            runs[name].append(await beside_a_decoding_user(engines[name], a, b, stops))
    copied = engines["warm"]._require_started().copied_tokens
    for e in engines.values():
        await e.shutdown()

    rows = []
    for name, rs in runs.items():
        ttfts = [r["ttft_s"] * 1e3 for r in rs]
        rows.append(
            {
                "engine": f"{name} (prefix_reuse={name == 'warm'})",
                "prompt_tokens": round(statistics.mean(prompt_tokens)),
                "cached_tokens_median": statistics.median(r["cached"] for r in rs),
                "ttft_ms_median": statistics.median(ttfts),
                "ttft_ms_min": min(ttfts),
                "ttft_ms_max": max(ttfts),
            }
        )
    paired = statistics.median(
        c["ttft_s"] / w["ttft_s"] for c, w in zip(runs["cold"], runs["warm"], strict=True)
    )
    same = sum(c["tokens"] == w["tokens"] for c, w in zip(runs["cold"], runs["warm"], strict=True))
    return {
        "meta": {
            **machine(),
            **vars(args),
            "command": recorded_command("edge_shared_prompt.py", sys.argv[1:], ()),
            "load_avg_1min": [load_before, os.getloadavg()[0]],
            "copied_tokens": copied,
        },
        "rows": rows,
        "speedup_paired_median": paired,
        "same_first_token": f"{same}/{args.reps}",
        "ttft_ms": {k: [r["ttft_s"] * 1e3 for r in v] for k, v in runs.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--variant", default="int8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--words", type=int, default=900, help="words of each system prompt")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    result = asyncio.run(bench(args))
    load = result["meta"]["load_avg_1min"]
    cols = ["engine", "prompt_tokens", "cached_tokens_median", "ttft_ms_median", "ttft_ms_min",
            "ttft_ms_max"]  # fmt: skip
    markdown = "\n".join(
        [
            f"# A second user's TTFT beside a decoding one ({args.variant}, {args.threads} "
            f"thread(s); 1-min load average {load[0]:.1f} before, {load[1]:.1f} after)",
            "",
            f"`{result['meta']['command']}`",
            "",
            table(result["rows"], cols),
            "",
            f"cold / warm TTFT, paired median: {result['speedup_paired_median']:.2f}x; "
            f"same first token: {result['same_first_token']}",
        ]
    )
    write_results("edge_shared_prompt", result, markdown)


if __name__ == "__main__":
    main()
