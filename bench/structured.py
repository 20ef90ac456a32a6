"""Structured outputs: decode tok/s with and without a JSON-schema grammar, in the same run, on
the edge engine (ONNX Runtime, CPU) and the cloud engine (torch, CPU); the time to compile a
schema (first time and cached); the grammar's mask cost per token at this vocabulary.

Each engine answers the prompts of generated schemas (tests/json_schemas.py) greedily, each
prompt once plain and once under its schema's grammar, interleaved, at batch 1 and batch 4
(four requests at a time). Decode tok/s is per row: a reply's tokens after the first over its
time from the first token to the last (prefill left out), summed over replies; at batch 4 a
row's time is shared with the rows beside it, so the batch's throughput is about 4 times it. **Peer:** the plain path, same engine, same
prompts, same run. With ``--compare-xgrammar`` (where xgrammar is installed) the compile and
mask figures are measured for xgrammar too, on the same schemas and replies.

    python bench/structured.py [--schemas 16] [--max-tokens 128] [--variant int8]

On a GPU (``--device cuda``) the cloud engine's core runs random bf16 models of real shapes
(``--shapes``, those of ``bench/cloud_throughput.py``; the default model's tokenizer, its ids
below the shape's vocabulary, the masks as wide as the shape's) at each ``--batches`` size:
every row plain, then every row under a JSON-schema grammar, in turn (``--rounds`` of each),
with the core's look-ahead overlap on (the default) and off. A random model rarely closes a
free string, so each generated schema is followed by a required string ``note`` (of at least
``--note-min-length`` characters; a counted length makes llguidance's masks several times
dearer): the rows run to ``--max-tokens`` or nearly, and decode tok/s is the rate over the
steps in which at least 90% of the batch's rows decode (prefill left out).

    python bench/structured.py --device cuda --shapes qwen3-0.6b,llama-3.1-8b --batches 1 64

Writes bench/results/structured.json and .md and prints a table (the GPU rows beside the
CPU ones, naming the card).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, machine, recorded_command, table, write_results
from tests.json_schemas import prompt, schema


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _one(engine: Any, ids: list[int], sp: Any) -> tuple[list[int], float, bool]:
    """The reply's tokens, its decode time (first token to last, in seconds), and whether it
    ended on its own (a stop token, not max_tokens)."""
    from routing.engine import FinishReason, GenerationRequest

    out: list[int] = []
    first = last = 0.0
    stopped = False
    async for ev in engine.generate(GenerationRequest(list(ids), sp)):
        now = time.perf_counter()
        if ev.token_ids and not out:
            first = now
        out += ev.token_ids
        last = now
        stopped = ev.finish_reason is FinishReason.STOP
    return out, (last - first) if out else 0.0, stopped


async def _decode(engine: Any, work: list[tuple[list[int], Any, Any]], batch: int) -> dict:
    """Plain and grammar decode tok/s over ``work`` (prompt ids, plain params, grammar
    params), interleaved, ``batch`` requests at a time."""
    tokens = {"plain": 0, "grammar": 0}
    secs = {"plain": 0.0, "grammar": 0.0}
    replies: list[tuple[list[int], bool]] = []
    for start in range(0, len(work), batch):
        group = work[start : start + batch]
        for mode in ("plain", "grammar") if start % (2 * batch) == 0 else ("grammar", "plain"):
            runs = [
                _one(engine, ids, plain if mode == "plain" else gram) for ids, plain, gram in group
            ]
            results = await asyncio.gather(*runs)
            for out, dt, _ in results:
                tokens[mode] += max(0, len(out) - 1)
                secs[mode] += dt
            if mode == "grammar":
                replies += [(out, stopped) for out, _, stopped in results]
    tps = {m: tokens[m] / secs[m] if secs[m] else 0.0 for m in tokens}
    return {
        "batch": batch,
        "plain_tok_s": tps["plain"],
        "grammar_tok_s": tps["grammar"],
        "grammar_vs_plain": tps["grammar"] / tps["plain"] if tps["plain"] else 0.0,
        "plain_tokens": tokens["plain"],
        "grammar_tokens": tokens["grammar"],
        "_replies": replies,
    }


def _validity(fmt: Any, schemas: list[dict], got: list[tuple[list[int], bool]]) -> dict:
    """The grammar replies that ended on their own, and those of them that validate."""
    import jsonschema

    ended = valid = 0
    for s, (out, stopped) in zip(schemas, got, strict=True):
        if not stopped:
            continue
        ended += 1
        try:
            jsonschema.validate(json.loads(fmt.decode(out)), s)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"ended": f"{ended}/{len(got)}", "valid_of_ended": f"{valid}/{ended}"}


def _engine(kind: str, args: argparse.Namespace) -> Any:
    if kind == "edge":
        from edge_runtime.engine import EdgeEngine, EdgeEngineConfig

        cfg = EdgeEngineConfig(slots=4, threads=args.threads, huge_pages=False)
        return EdgeEngine.from_model(args.model, args.variant, config=cfg)
    from cloud_engine.config import EngineConfig
    from cloud_engine.engine import CloudEngine

    cfg = EngineConfig(device="cpu", kv_memory_bytes=128 << 20)
    return CloudEngine.from_model(args.model, "cpu", config=cfg)


def _mask_costs(compiler: Any, specs: list[Any], replies: list[list[int]]) -> dict[str, float]:
    """llguidance's mask time per token, replaying the grammar replies through fresh states."""
    times: list[float] = []
    for spec, reply in zip(specs, replies, strict=False):
        st = compiler.compile(spec).start()
        for tok in reply:
            t0 = time.perf_counter()
            st.mask()
            times.append(time.perf_counter() - t0)
            if not st.advance(tok):
                break
    return {
        "mask_us_median": 1e6 * statistics.median(times),
        "mask_us_p99": 1e6 * _pct(times, 0.99),
    }


def _xgrammar(tok_path: Path, vocab: int, stops: tuple[int, ...], schemas: list[dict],
              replies: list[list[int]]) -> dict[str, float] | None:  # fmt: skip
    """The same figures for xgrammar (compile ms, mask µs per token), if it is installed."""
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=list(stops))
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    compile_ms: list[float] = []
    mask: list[float] = []
    bm = xgr.allocate_token_bitmask(1, vocab)
    for s, reply in zip(schemas, replies, strict=False):
        t0 = time.perf_counter()
        cg = comp.compile_json_schema(json.dumps(s), any_whitespace=False, separators=(",", ":"))
        compile_ms.append(1e3 * (time.perf_counter() - t0))
        m = xgr.GrammarMatcher(cg)
        for tok in reply:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm, 0)
            mask.append(time.perf_counter() - t0)
            if not m.accept_token(tok):
                break
    return {
        "compile_ms_median": statistics.median(compile_ms),
        "compile_ms_p90": _pct(compile_ms, 0.9),
        "mask_us_median": 1e6 * statistics.median(mask),
        "mask_us_p99": 1e6 * _pct(mask, 0.99),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from routing.engine import SamplingParams
    from routing.grammar import Grammar, GrammarCompiler, json_schema_spec
    from routing.model_store import resolve
    from routing.prompt import PromptFormatter

    info = resolve(args.model)
    fmt = PromptFormatter.from_folder(info.path)
    vocab = int(json.loads((info.path / "config.json").read_text())["vocab_size"])
    t0 = time.perf_counter()
    compiler = GrammarCompiler(fmt.tokenizer.to_str(), vocab, fmt.stop_token_ids)
    tokenizer_ms = 1e3 * (time.perf_counter() - t0)
    schemas = [schema(i) for i in range(args.schemas)]
    specs = [json_schema_spec(s) for s in schemas]
    compile_ms, cached_us = [], []
    for spec in specs:
        t0 = time.perf_counter()
        compiled = compiler.compile(spec)
        compile_ms.append(1e3 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        assert compiler.compile(spec) is compiled
        cached_us.append(1e6 * (time.perf_counter() - t0))
    stops = fmt.stop_token_ids
    work = []
    for s, spec in zip(schemas, specs, strict=True):
        ids = fmt.encode_chat([{"role": "user", "content": prompt(s)}])
        plain = SamplingParams(max_tokens=args.max_tokens, temperature=0, stop_token_ids=stops)
        gram = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=0,
            stop_token_ids=stops,
            grammar=Grammar(compiler.compile(spec)),
        )
        work.append((ids, plain, gram))
    rows, replies = [], []
    for kind in args.engines:
        engine = _engine(kind, args)
        await engine.start()
        try:
            await _decode(engine, work[:2], 2)  # warm-up
            for batch in args.batches:
                r = await _decode(engine, work, batch)
                got = r.pop("_replies")
                if not replies:
                    replies = [out for out, _ in got]
                rows.append({"engine": kind, **r, **_validity(fmt, schemas, got)})
        finally:
            await engine.shutdown()
    compile_row = {
        "library": "llguidance",
        "tokenizer_init_ms": tokenizer_ms,
        "compile_ms_median": statistics.median(compile_ms),
        "compile_ms_p90": _pct(compile_ms, 0.9),
        "cached_us_median": statistics.median(cached_us),
        **_mask_costs(compiler, specs, replies),
    }
    libs = [compile_row]
    if args.compare_xgrammar:
        xg = _xgrammar(info.path / "tokenizer.json", vocab, stops, schemas, replies)
        libs.append(
            {"library": "xgrammar", **xg} if xg else {"library": "xgrammar (not installed)"}
        )
    return {"decode": rows, "libraries": libs, "vocab": vocab}


def _with_note(s: dict, min_length: int = 0) -> dict:
    """``s`` under a required ``data`` key, followed by a required string ``note`` (of at
    least ``min_length`` characters): a random model rarely closes a free string, so its
    rows seldom end before their max_tokens."""
    note: dict[str, Any] = {"type": "string"}
    if min_length:
        note["minLength"] = min_length
    return {
        "type": "object",
        "properties": {"data": s, "note": note},
        "required": ["data", "note"],
        "additionalProperties": False,
    }


def _gpu_run(core: Any, work: list[tuple[list[int], Any]]) -> tuple[float, int, int]:
    """Run every request of ``work`` (prompt ids, params) at once: the decode tok/s over the
    steps in which at least 90% of the rows emitted a token (after every row's first), those
    steps, and the tokens over all steps."""
    import torch

    from routing.engine import GenerationRequest

    for i, (ids, sp) in enumerate(work):
        core.add(GenerationRequest(list(ids), sp, request_id=f"r{i}"))
    rows, started = len(work), set()
    least = max(1, -(-9 * rows // 10))
    secs, full, tokens, total = 0.0, 0, 0, 0
    if core.pool.device.type == "cuda":
        torch.cuda.synchronize()
    last = time.perf_counter()
    while core.has_work():
        outs = core.step()
        now = time.perf_counter()
        got = [o for o in outs if o.new_token_ids]
        total += sum(len(o.new_token_ids) for o in got)
        if len(got) >= least and len(started) == rows:
            secs += now - last
            tokens += len(got)
            full += 1
        started.update(o.seq.request_id for o in got)
        last = now
    return (tokens / secs if secs else 0.0), full, total


def _gpu_work(
    prompts: list[list[int]], plain: Any, grams: list[Any], b: int, grammar: bool
) -> list[tuple[list[int], Any]]:
    """``b`` requests over the prompts in turn, plain or each under its schema's grammar."""
    return [
        (
            prompts[i % len(prompts)],
            dataclasses.replace(plain, grammar=grams[i % len(grams)]) if grammar else plain,
        )
        for i in range(b)
    ]


def gpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The cloud core on CUDA, plain against grammar rows (see the module docstring)."""
    import gc

    import torch

    from bench.cloud_throughput import SHAPES, random_model
    from cloud_engine.config import EngineConfig
    from cloud_engine.core import EngineCore
    from cloud_engine.model.config import ModelConfig
    from routing.engine import SamplingParams
    from routing.grammar import Grammar, GrammarCompiler, json_schema_spec
    from routing.model_store import resolve
    from routing.prompt import PromptFormatter

    folder = Path(args.tokenizer) if args.tokenizer else resolve(args.model).path
    fmt = PromptFormatter.from_folder(folder)
    stops = fmt.stop_token_ids
    schemas = [schema(i) for i in range(args.schemas)]
    prompts = [fmt.encode_chat([{"role": "user", "content": prompt(s)}]) for s in schemas]
    rows: list[dict[str, Any]] = []
    dev = args.device
    card = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    for name in args.shapes.split(","):
        cfg = ModelConfig.from_dict(dict(SHAPES[name]))
        t0 = time.perf_counter()
        compiler = GrammarCompiler(fmt.tokenizer.to_str(), cfg.vocab_size, stops)
        grams = [
            Grammar(compiler.compile(json_schema_spec(_with_note(s, args.note_min_length))))
            for s in schemas
        ]
        compile_s = time.perf_counter() - t0
        model = random_model(cfg, torch.bfloat16, dev, seed=0)
        top = max(args.batches)
        ecfg = EngineConfig(
            device=dev, max_running=top, kv_memory_bytes=args.kv_gb << 30, overlap=True
        )
        core = EngineCore(model, name, ecfg)
        plain = SamplingParams(max_tokens=args.max_tokens, temperature=0, stop_token_ids=stops)

        work = functools.partial(_gpu_work, prompts, plain, grams)
        _gpu_run(core, work(min(4, top), True))  # warm-up: graphs, kernels, the mask path
        _gpu_run(core, work(min(4, top), False))
        for overlap in (True, False):
            core.config = dataclasses.replace(core.config, overlap=overlap)
            for b in args.batches:
                got: dict[str, list[float]] = {"plain": [], "grammar": []}
                for r in range(args.rounds):
                    for mode in ("plain", "grammar") if r % 2 == 0 else ("grammar", "plain"):
                        tps, steps, _ = _gpu_run(core, work(b, mode == "grammar"))
                        got[mode].append(tps)
                p, g = statistics.median(got["plain"]), statistics.median(got["grammar"])
                rows.append(
                    {
                        "card": card,
                        "shape": name,
                        "overlap": "on" if overlap else "off",
                        "batch": b,
                        "plain_tok_s": p,
                        "grammar_tok_s": g,
                        "grammar_vs_plain": g / p if p else 0.0,
                        "plain_spread": f"{min(got['plain']):.0f}-{max(got['plain']):.0f}",
                        "grammar_spread": f"{min(got['grammar']):.0f}-{max(got['grammar']):.0f}",
                        "counted_steps": steps,
                        "compile_s": compile_s,
                    }
                )
                print(rows[-1], flush=True)
        del core, model
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    return {"gpu": rows, "gpu_meta": {**machine(), "card": card, "torch": torch.__version__}}


GPU_COLS = [
    "card",
    "shape",
    "overlap",
    "batch",
    "plain_tok_s",
    "grammar_tok_s",
    "grammar_vs_plain",
    "plain_spread",
    "grammar_spread",
    "counted_steps",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--variant", default="int8", help="the edge engine's weights")
    ap.add_argument("--threads", type=int, default=2, help="the edge engine's threads")
    ap.add_argument("--schemas", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--engines", nargs="+", default=["edge", "cloud"])
    ap.add_argument("--compare-xgrammar", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shapes", default="qwen3-0.6b,llama-3.1-8b", help="CUDA: model shapes")
    ap.add_argument("--rounds", type=int, default=2, help="CUDA: runs of each mode (median)")
    ap.add_argument("--kv-gb", type=int, default=8, help="CUDA: the KV pool's GiB")
    ap.add_argument(
        "--note-min-length", type=int, default=0, help="CUDA: the note string's minLength"
    )
    ap.add_argument(
        "--tokenizer", default=None, help="CUDA: a folder of tokenizer files (default: --model's)"
    )
    args = ap.parse_args()
    if args.device == "cuda":
        return gpu_main(args)
    res = asyncio.run(bench(args))
    command = recorded_command("structured.py", sys.argv[1:], ())
    decode_cols = [
        "engine",
        "batch",
        "plain_tok_s",
        "grammar_tok_s",
        "grammar_vs_plain",
        "ended",
        "valid_of_ended",
    ]
    lib_cols = list(dict.fromkeys(k for r in res["libraries"] for k in r))
    markdown = "\n".join(
        [
            f"# Structured outputs: JSON-schema grammar against plain decoding "
            f"({args.schemas} schemas, vocabulary {res['vocab']})",
            "",
            f"`{command}`",
            "",
            table(res["decode"], decode_cols),
            "",
            table(res["libraries"], lib_cols),
        ]
    )
    payload = {"meta": {**machine(), **vars(args), "command": command}, **res}
    old = RESULTS / "structured.json"
    if old.exists():  # the GPU rows of an earlier run stay beside the new CPU ones
        kept = json.loads(old.read_text())
        payload.update({k: kept[k] for k in ("gpu", "gpu_meta") if k in kept})
    write_results("structured", payload, markdown + _gpu_markdown(payload))


def _gpu_markdown(payload: dict[str, Any]) -> str:
    if not payload.get("gpu"):
        return ""
    meta = payload["gpu_meta"]
    return "\n".join(
        [
            "",
            "",
            f"## On a GPU: {meta['card']} (random bf16 weights, {meta['date']})",
            "",
            f"`{meta['command']}`",
            "",
            table(payload["gpu"], GPU_COLS),
        ]
    )


def gpu_main(args: argparse.Namespace) -> None:
    """Run :func:`gpu_bench` and put its rows beside the CPU rows of the committed results."""
    res = gpu_bench(args)
    res["gpu_meta"]["command"] = recorded_command("structured.py", sys.argv[1:], ("--tokenizer",))
    old = RESULTS / "structured.json"
    payload = json.loads(old.read_text()) if old.exists() else {}
    payload.update(res)
    cpu_md = (RESULTS / "structured.md").read_text().rstrip("\n") if old.exists() else ""
    cpu_md = cpu_md.split("\n\n## On a GPU")[0]
    write_results("structured", payload, cpu_md + _gpu_markdown(payload))


if __name__ == "__main__":
    main()
