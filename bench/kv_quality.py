"""Quality of compressed KV on the default model (real weights, CPU): fp32 (the model's own
dtype, uncompressed), bf16, fp8 and int8 pools through the paged engine.

- NLL: the mean negative log-likelihood per token of the quality set's reference answers
  (``edge_runtime/data/quality_set.json``), each answer scored after its chat-rendered
  prompt as prompt log-probabilities of one prefill, so every answer token attends over keys
  and values read back from the pool in its format. Goal: within 1% of fp32 KV.
- Greedy prefix: 64 greedy tokens (EOS ignored) for 50 held prompts (the quality set's
  questions and reference prompts, then ``PROMPTS`` below), and the mean length of the prefix
  identical to the fp32-KV run's.

    python bench/kv_quality.py [--prompts 50] [--tokens 64] [--threads 2]

Writes ``bench/results/kv_quality.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results
from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.model.loader import load_model
from routing.engine import GenerationRequest, SamplingParams
from routing.model_store import DEFAULT_MODEL, resolve
from routing.prompt import PromptFormatter

KV = ("auto", "bf16", "fp8", "int8")  # auto on CPU: the model's fp32, the baseline
PROMPTS = (  # beyond the quality set's, to make up the held prompts
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three fruits that are red.",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle.",
    "Why is the sky blue?",
    "Write a Python function that adds two numbers.",
    "What does a CPU do?",
    "Summarize the plot of Cinderella in one sentence.",
    "Suggest a title for a blog post about coffee.",
    "Describe a cat in three words.",
    "How do I reverse a list in Python?",
    "Write a short note thanking a colleague for their help.",
    "What are the benefits of regular exercise?",
    "Explain recursion to a child.",
    "Draft an email asking for a meeting next week.",
)


def held_prompts(n: int) -> tuple[list[str], list[tuple[str, str]]]:
    """``n`` distinct prompts and the quality set's (prompt, reference answer) pairs."""
    data = json.loads(Path("edge_runtime/data/quality_set.json").read_text())
    refs = [(r["prompt"], r["answer"]) for r in data["references"]]
    seen: list[str] = []
    for p in [q["prompt"] for q in data["questions"]] + [p for p, _ in refs] + list(PROMPTS):
        if p not in seen:
            seen.append(p)
    if len(seen) < n:
        raise SystemExit(f"only {len(seen)} held prompts")
    return seen[:n], refs


def run_kv(
    model: Any, fmt: PromptFormatter, kv: str, prompts: list[str], refs: list[tuple[str, str]],
    tokens: int, threads: int,
) -> dict[str, Any]:  # fmt: skip
    """NLL of the references and greedy tokens of the prompts with a ``kv`` pool."""
    cfg = EngineConfig(
        kv_dtype=kv,  # type: ignore[arg-type]
        max_kv_blocks=800,
        max_tokens_per_step=2048,
        threads=threads,
        prefill_stall_ratio="off",
    )
    core = EngineCore(model, f"kv-quality-{kv}", cfg)

    def chat(text: str) -> list[int]:
        return fmt.encode(fmt.render([{"role": "user", "content": text}]))

    t0 = time.perf_counter()
    answer_len: dict[str, int] = {}
    for i, (p, a) in enumerate(refs):
        ids = fmt.encode(a)
        answer_len[f"n{i}"] = len(ids)
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        core.add(GenerationRequest(chat(p) + ids, sp, request_id=f"n{i}"))
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        core.add(GenerationRequest(chat(p), sp, request_id=f"g{i}"))
    out: dict[str, list[int]] = {}
    nll_sum, nll_n = 0.0, 0
    while core.has_work():
        for o in core.step():
            rid = o.seq.request_id
            out.setdefault(rid, []).extend(o.new_token_ids)
            if rid.startswith("n") and o.finish_reason is not None:
                lps = o.seq.prompt_logprobs[-answer_len[rid] :]  # type: ignore[index]
                nll_sum -= sum(lp.logprob for lp in lps)  # type: ignore[union-attr]
                nll_n += len(lps)
    return {
        "kv_dtype": core.pool.spec.kv_dtype,
        "pool_tokens_per_GiB": round(2**30 / core.pool.spec.bytes_per_token),
        "nll": nll_sum / nll_n,
        "answer_tokens": nll_n,
        "greedy": [out[f"g{i}"] for i in range(len(prompts))],
        "seconds": time.perf_counter() - t0,
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    info = resolve(args.model)
    model = load_model(Path(info.path))
    fmt = PromptFormatter.from_folder(info.path)
    prompts, refs = held_prompts(args.prompts)
    runs = {}
    for kv in KV:
        with torch.inference_mode():
            runs[kv] = run_kv(model, fmt, kv, prompts, refs, args.tokens, args.threads)
        print(f"{kv}: NLL {runs[kv]['nll']:.4f} ({runs[kv]['seconds']:.0f} s)", flush=True)
    base = runs["auto"]
    rows = []
    for r in runs.values():
        pre = [common_prefix(g, b) for g, b in zip(r["greedy"], base["greedy"], strict=True)]
        rows.append(
            {
                "KV": r["kv_dtype"],
                "tokens per GiB": r["pool_tokens_per_GiB"],
                "NLL": round(r["nll"], 4),
                "NLL vs fp32": f"{100 * (r['nll'] / base['nll'] - 1):+.2f}%",
                "mean identical prefix": round(sum(pre) / len(pre), 1),
                "identical outputs": f"{sum(p == args.tokens for p in pre)}/{len(pre)}",
            }
        )
    command = recorded_command("kv_quality.py", sys.argv[1:], ())
    md = "\n\n".join(
        [
            f"# Compressed KV quality ({info.name}, real weights, CPU)",
            f"`{command}`",
            f"NLL: mean per token over the {len(refs)} reference answers "
            f"({base['answer_tokens']} tokens). Greedy: {args.tokens} tokens (EOS ignored) for "
            f"{len(prompts)} held prompts; prefix identical to the fp32-KV run's.",
            table(rows, list(rows[0])),
        ]
    )
    payload = {
        "command": command,
        "machine": machine(),
        "model": info.identity,
        "rows": rows,
        "runs": {k: {x: y for x, y in v.items() if x != "greedy"} for k, v in runs.items()},
    }
    write_results("kv_quality", payload, md)


if __name__ == "__main__":
    main()
