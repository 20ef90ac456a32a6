"""Prefill and decode tokens/s of the torch reference model vs transformers' generate.

Same model folder, same prompts, same thread count, same process, interleaved runs; greedy,
EOS ignored so both decode exactly ``--new-tokens``. Prefill tok/s = prompt tokens / time to the
first token; decode tok/s = (new tokens - 1) / (total time - time to the first token).

    python bench/reference_decode.py [--model NAME_OR_DIR] [--threads 1] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench._common import machine, table, write_results
from cloud_engine.model.dense import generate
from cloud_engine.model.loader import load_model
from routing.engine import SamplingParams
from routing.model_store import DEFAULT_MODEL, resolve
from routing.prompt import PromptFormatter

PROMPTS = [
    "What is the capital of France?",
    "Explain in detail how a transformer language model generates text, step by step. " * 4,
    "Summarize the following meeting notes for an executive audience. " + "The team discussed the "
    "quarterly roadmap, hiring, the budget for cloud infrastructure and the launch timeline. " * 12,
]


def time_ours(model, ids: list[int], n: int) -> tuple[float, float]:
    one = generate(model, ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    full = generate(model, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    total = time.perf_counter() - t0
    assert len(full.token_ids) == n and len(one.token_ids) == 1
    return full.prefill_s, total


def time_hf(hf, ids: list[int], n: int) -> tuple[float, float]:
    x = torch.tensor([ids])
    mask = torch.ones_like(x)
    kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
        total = time.perf_counter() - t0
    assert out.shape[1] - len(ids) == n
    return prefill, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    info = resolve(args.model)
    fmt = PromptFormatter.from_folder(info.path)
    ours = load_model(info.path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.float32).eval()
    rows = []
    for prompt in PROMPTS:
        ids = fmt.encode_chat([{"role": "user", "content": prompt}])
        res: dict[str, list[tuple[float, float]]] = {"ours": [], "transformers": []}
        for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
            res["ours"].append(time_ours(ours, ids, args.new_tokens))
            res["transformers"].append(time_hf(hf, ids, args.new_tokens))
        for name, runs in res.items():
            prefill = statistics.median(p for p, _ in runs)
            total = statistics.median(t for _, t in runs)
            rows.append(
                {
                    "engine": name,
                    "prompt_tokens": len(ids),
                    "prefill_tok_s": len(ids) / prefill,
                    "decode_tok_s": (args.new_tokens - 1) / max(total - prefill, 1e-9),
                }
            )
    for r in rows:
        peer = next(
            p
            for p in rows
            if p["engine"] == "transformers" and p["prompt_tokens"] == r["prompt_tokens"]
        )
        r["decode_vs_transformers"] = r["decode_tok_s"] / peer["decode_tok_s"]
    md = (
        f"### reference_decode ({info.name}, {args.threads} thread(s), {args.new_tokens} new tokens, "
        f"median of {args.repeats})\n\n"
        + table(
            rows,
            ["engine", "prompt_tokens", "prefill_tok_s", "decode_tok_s", "decode_vs_transformers"],
        )
    )
    write_results("reference_decode", {"machine": machine(), "args": vars(args), "rows": rows}, md)


if __name__ == "__main__":
    main()
