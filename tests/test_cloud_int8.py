"""int8 KV (per-token, per-head scales) against float32 KV on the default model: greedy
agreement over 20 real prompts, stated as numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.model.loader import load_model
from routing.engine import GenerationRequest, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three fruits that are red.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a name for a pet turtle.",
    "Why is the sky blue?",
    "Write a Python function that adds two numbers.",
    "What does a CPU do?",
    "Name the planets of the solar system.",
    "Summarize the plot of Cinderella in one sentence.",
    "What is the boiling point of water in Celsius?",
    "Suggest a title for a blog post about coffee.",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
    "Describe a cat in three words.",
    "How do I reverse a list in Python?",
    "What is the largest ocean on Earth?",
]


def chat_ids(tok: Tokenizer, text: str) -> list[int]:
    # The ChatML layout of the default model (its template adds a system turn by default).
    sys_turn = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    return tok.encode(f"{sys_turn}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids


def run(model, prompts: list[list[int]], int8: bool) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    core = EngineCore(
        model,
        "int8-test",
        EngineConfig(
            kv_dtype="int8" if int8 else "auto", max_kv_blocks=600, max_tokens_per_step=2048
        ),
    )
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add(
            GenerationRequest(
                p,
                SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=(0, 2)),
                request_id=str(i),
            )
        )
    while core.has_work():
        for o in core.step():
            out.setdefault(o.seq.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.slow  # ~1 min alone on 2 cores; measured: 55% identical, 77% agreeing prefix
def test_int8_kv_greedy_agreement(default_model_path: Path) -> None:
    tok = Tokenizer.from_file(str(default_model_path / "tokenizer.json"))
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    model = load_model(default_model_path)
    ref, q8 = run(model, prompts, False), run(model, prompts, True)
    identical = sum(ref[k] == q8[k] for k in ref) / len(ref)
    prefix = []
    for k in ref:
        n = next(
            (i for i, (a, b) in enumerate(zip(ref[k], q8[k], strict=False)) if a != b),
            min(len(ref[k]), len(q8[k])),
        )
        prefix.append(n / max(1, len(ref[k])))
    agree = sum(prefix) / len(prefix)
    print(
        f"int8 KV vs fp32 KV, 20 prompts x 32 tokens: identical outputs {identical:.0%}, mean agreeing prefix {agree:.0%}"
    )
    assert identical >= 0.4 and agree >= 0.6
    assert all(ref[k][:1] == q8[k][:1] for k in ref)  # the first token never flips


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-s"])
