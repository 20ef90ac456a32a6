"""Tool calls: how many replies call a tool, how many calls are valid (a function of ``tools``
whose arguments validate against its schema), and decode tok/s, with the tool-call grammar
(``tool_choice`` required and auto) against free decoding of the same prompts.

Each task offers two tools, ``record_i`` (parameters: generated schema ``i`` of
tests/json_schemas.py) and ``get_weather``, and asks for a ``record_i`` call; the prompt is
rendered as the node renders it (``routing.tools``: the default model's template has no tool
section, so the Hermes default), greedy. **Peer:** free decoding (no grammar) of the same
prompts on the same engine in the same run, its reply parsed by the same parser.

    python bench/tool_calls.py [--tasks 16] [--max-tokens 160] [--engines edge cloud]

Writes bench/results/tool_calls.json and .md and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results
from bench.structured import _engine, _one
from tests.json_schemas import schema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _task(i: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Task ``i``'s tools and messages."""
    record = {
        "type": "function",
        "function": {
            "name": f"record_{i}",
            "description": "Store one record.",
            "parameters": schema(i),
        },
    }
    ask = f"Store a plausible example record by calling record_{i}."
    return [record, WEATHER], [{"role": "user", "content": ask}]


def _judge(text: str, tools: list[dict[str, Any]]) -> tuple[int, int]:
    """The reply's complete calls, and those that name a tool and validate."""
    import jsonschema

    from routing.tool_parser import ToolCallParser

    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = [c for c in parser.calls if c.complete]
    valid = 0
    for c in calls:
        try:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
            valid += 1
        except (KeyError, ValueError, jsonschema.ValidationError):
            pass
    return len(calls), valid


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from routing.engine import SamplingParams
    from routing.grammar import Grammar, GrammarCompiler
    from routing.model_store import resolve
    from routing.prompt import PromptFormatter
    from routing.tools import parse_tool_calling, template_inputs

    info = resolve(args.model)
    fmt = PromptFormatter.from_folder(info.path)
    vocab = int(json.loads((info.path / "config.json").read_text())["vocab_size"])
    compiler = GrammarCompiler(fmt.tokenizer.to_str(), vocab, fmt.stop_token_ids)
    base = SamplingParams(
        max_tokens=args.max_tokens, temperature=0, stop_token_ids=fmt.stop_token_ids
    )
    work = []  # (tools, ids, {mode: params})
    for i in range(args.tasks):
        tools, messages = _task(i)
        calling = parse_tool_calling(tools, "auto", None)
        msgs, extra = template_inputs(messages, calling, fmt.chat_template)
        ids = fmt.encode_chat(msgs, **extra)
        params = {"free": base}
        for choice in ("required", "auto"):
            spec = parse_tool_calling(tools, choice, None).grammar_spec()  # type: ignore[union-attr]
            params[choice] = replace(base, grammar=Grammar(compiler.compile(spec)))
        work.append((tools, ids, params))
    rows = []
    for kind in args.engines:
        engine = _engine(kind, args)
        await engine.start()
        try:
            await _one(engine, work[0][1], base)  # warm-up
            stats = {m: {"replies": 0, "calling": 0, "calls": 0, "valid": 0, "tok": 0, "s": 0.0}
                     for m in ("free", "required", "auto")}  # fmt: skip
            for n, (tools, ids, params) in enumerate(work):
                modes = list(params) if n % 2 == 0 else list(reversed(params))
                for mode in modes:
                    out, dt, _ = await _one(engine, ids, params[mode])
                    calls, valid = _judge(fmt.decode(out), tools)
                    st = stats[mode]
                    st["replies"] += 1
                    st["calling"] += calls > 0
                    st["calls"] += calls
                    st["valid"] += valid
                    st["tok"] += max(0, len(out) - 1)
                    st["s"] += dt
            free_tps = stats["free"]["tok"] / stats["free"]["s"]
            for mode, st in stats.items():
                tps = st["tok"] / st["s"] if st["s"] else 0.0
                rows.append({
                    "engine": kind,
                    "mode": "free (peer)" if mode == "free" else f"grammar, {mode}",
                    "replies_calling": f"{st['calling']}/{st['replies']}",
                    "valid_calls": f"{st['valid']}/{st['calls']}",
                    "decode_tok_s": round(tps, 1),
                    "vs_free": round(tps / free_tps, 3) if free_tps else 0.0,
                })  # fmt: skip
        finally:
            await engine.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--variant", default="fp32", help="the edge engine's weights")
    ap.add_argument("--threads", type=int, default=2, help="the edge engine's threads")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--engines", nargs="+", default=["edge", "cloud"])
    args = ap.parse_args()
    rows = asyncio.run(bench(args))
    command = recorded_command("tool_calls.py", sys.argv[1:], ())
    cols = ["engine", "mode", "replies_calling", "valid_calls", "decode_tok_s", "vs_free"]
    markdown = "\n".join(
        [
            f"# Tool calls: the tool-call grammar against free decoding ({args.tasks} tasks, "
            f"{args.model}, greedy)",
            "",
            f"`{command}`",
            "",
            table(rows, cols),
        ]
    )
    write_results(
        "tool_calls",
        {"meta": {**machine(), **vars(args), "command": command}, "rows": rows},
        markdown,
    )


if __name__ == "__main__":
    main()
