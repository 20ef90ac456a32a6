"""Edge prefix reuse: time to first token of a chat's third turn, cold vs warm.

A 3-turn chat (a system message with a short document, three user questions) rendered with the
model's own chat template (``routing.prompt``). The assistant's first two replies are generated
once (greedy) and fixed, so every repetition sends the same third-turn prompt. Two engines in one
process, same graph and settings: ``prefix_reuse=False`` (cold: the whole prompt is prefilled)
and ``prefix_reuse=True`` (warm: the slot still holds the conversation up to the second reply,
so only the new message is prefilled). Each repetition first puts the chat so far into a slot,
as a real chat leaves it after the engine generated reply 2: a request of turn 2's prompt plus
reply 2's tokens (``max_tokens=1``). Generating reply 2 again instead would not do: the int8
graph quantizes activations per run, so a prefill of another length can change a greedy reply
a little, and the fixed third-turn prompt would then match the slot only up to there (in a real
chat the client sends back the reply it got, which the slot holds). Then it times turn 3 with
``max_tokens=1``: from ``generate()`` to the first token event. Engines alternate which goes
first.

    python bench/edge_prefix_ttft.py [--variant int8] [--threads 2] [--reps 10]

Writes bench/results/edge_prefix_ttft.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results

DOCUMENT = (
    "Edge nodes answer short requests close to the user, while a cloud engine with continuous "
    "batching serves the long ones. The router predicts the time to first token and the total "
    "latency of every eligible node from measured rates, and picks the node that finishes first. "
    "Each node reports the prefix blocks it holds, so a request whose conversation a node has "
    "already seen is credited with the tokens it will not have to compute again. "
)
SYSTEM = "You are a helpful assistant. Answer from this note when you can.\n\n" + DOCUMENT * 3
QUESTIONS = [
    "What does the router predict for each node?",
    "Why are short requests sent to edge nodes?",
    "Summarize the note in one sentence.",
]


async def run(engine: Any, prompt: list[int], max_tokens: int, stops: tuple[int, ...]) -> dict:
    """One request: its tokens, TTFT (s) and cached prompt tokens."""
    from edge_runtime.engine import greedy
    from routing.engine import GenerationRequest

    t0 = time.perf_counter()
    ttft, tokens, cached = 0.0, [], 0
    async for ev in engine.generate(GenerationRequest(prompt, greedy(max_tokens, stops))):
        if not ttft:
            ttft, cached = time.perf_counter() - t0, ev.cached_tokens
        tokens += ev.token_ids
    return {"tokens": tokens, "ttft_s": ttft, "cached": cached}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from edge_runtime.engine import EdgeEngine, EdgeEngineConfig
    from routing.prompt import PromptFormatter

    def make(reuse: bool) -> EdgeEngine:
        cfg = EdgeEngineConfig(
            slots=args.slots, context=args.context, threads=args.threads, prefix_reuse=reuse
        )
        return EdgeEngine.from_model(args.model, variant=args.variant, config=cfg)

    load_before = os.getloadavg()[0]  # a shared machine's load moves TTFT a lot
    engines = {"cold": make(False), "warm": make(True)}
    for e in engines.values():
        await e.start()
    fmt = PromptFormatter.from_folder(engines["cold"].tokenizer_dir)
    stops = fmt.stop_token_ids
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for q in QUESTIONS[:2]:  # the conversation so far, generated once
        messages.append({"role": "user", "content": q})
        out = await run(engines["cold"], fmt.encode_chat(messages), args.reply_tokens, stops)
        messages.append({"role": "assistant", "content": fmt.decode(out["tokens"])})
    turn2 = fmt.encode_chat(messages[:4]) + out["tokens"]  # the slot after reply 2
    messages.append({"role": "user", "content": QUESTIONS[2]})
    turn3 = fmt.encode_chat(messages)

    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    for rep in range(args.reps):
        order = ["cold", "warm"] if rep % 2 == 0 else ["warm", "cold"]
        for name in order:
            await run(engines[name], turn2, 1, stops)  # the chat so far, in a slot
            runs[name].append(await run(engines[name], turn3, 1, stops))
    for e in engines.values():
        await e.shutdown()

    rows = []
    for name, rs in runs.items():
        ttfts = [r["ttft_s"] * 1e3 for r in rs]
        cached = sorted({r["cached"] for r in rs})
        rows.append(
            {
                "engine": f"{name} (prefix_reuse={name == 'warm'})",
                "prompt_tokens": len(turn3),
                "cached_tokens": ", ".join(map(str, cached)),
                "prefilled_tokens": ", ".join(str(len(turn3) - c) for c in cached),
                "ttft_ms_median": statistics.median(ttfts),
                "ttft_ms_min": min(ttfts),
                "ttft_ms_max": max(ttfts),
            }
        )
    speedup = rows[0]["ttft_ms_median"] / rows[1]["ttft_ms_median"]
    paired = statistics.median(
        c["ttft_s"] / w["ttft_s"] for c, w in zip(runs["cold"], runs["warm"], strict=True)
    )
    same_first = sum(
        c["tokens"] == w["tokens"] for c, w in zip(runs["cold"], runs["warm"], strict=True)
    )
    return {
        "meta": {
            **machine(),
            **vars(args),
            "command": recorded_command("edge_prefix_ttft.py", sys.argv[1:], ()),
            "turn2_and_reply_tokens": len(turn2),
            "turn3_prompt_tokens": len(turn3),
            "load_avg_1min": [load_before, os.getloadavg()[0]],
        },
        "rows": rows,
        "speedup_median_ttft": speedup,
        "speedup_paired_median": paired,
        "same_first_token": f"{same_first}/{args.reps}",
        "ttft_ms": {k: [r["ttft_s"] * 1e3 for r in v] for k, v in runs.items()},
        "cached_tokens": {k: [r["cached"] for r in v] for k, v in runs.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--variant", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reply-tokens", type=int, default=64, help="max tokens of replies 1, 2")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    result = asyncio.run(bench(args))
    cols = [
        "engine",
        "prompt_tokens",
        "cached_tokens",
        "prefilled_tokens",
        "ttft_ms_median",
        "ttft_ms_min",
        "ttft_ms_max",
    ]
    load = result["meta"]["load_avg_1min"]
    print(
        f"# Edge prefix reuse: TTFT of a chat's third turn ({args.variant}, {args.threads} "
        f"threads; 1-min load average {load[0]:.1f} before, {load[1]:.1f} after)"
    )
    print(table(result["rows"], cols))
    print(
        f"\ncold / warm median TTFT: {result['speedup_median_ttft']:.2f}x "
        f"(paired, median of the repetitions' ratios: {result['speedup_paired_median']:.2f}x); "
        f"same first token cold vs warm: {result['same_first_token']}"
    )
    markdown = (
        f"# edge_prefix_ttft\n\n`{result['meta']['command']}`\n\n{table(result['rows'], cols)}"
        f"\n\ncold / warm median TTFT {result['speedup_median_ttft']:.2f}x, paired "
        f"{result['speedup_paired_median']:.2f}x; same first token {result['same_first_token']}"
    )
    write_results("edge_prefix_ttft", result, markdown)


if __name__ == "__main__":
    main()
