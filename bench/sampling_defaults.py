"""What a request that names no temperature gets: the model's recommended sampling (its
generation_config, applied by the node) against the API's own default (temperature 1, top_p 1,
what a node without it would sample with), on the default model's edge engine.

Each of the quality gate's plain questions (``edge_runtime/data/quality_set.json``, the README's
question first) is asked ``--samples`` times per arm with a seed each, all through one
``EdgeEngine`` on the variant its quality gate picks; an answer is right when it contains an
accepted answer (the gate's rule). Arms: ``model default`` (the folder's generation_config:
temperature 0.2, top_p 0.9 for SmolLM2), ``API default`` (1.0 / 1.0) and greedy (the ceiling).
**Peer:** the API default, same engine, same questions, same seeds, same run.

    python bench/sampling_defaults.py [--samples 10] [--max-tokens 32]

Writes bench/results/sampling_defaults.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results
from edge_runtime.engine import EdgeEngine, EdgeEngineConfig
from edge_runtime.quality_gate import QualitySet, answers_right, cpu_signature
from routing.engine import GenerationRequest, SamplingParams
from routing.model_store import DEFAULT_MODEL
from routing.prompt import API_SAMPLING, SAMPLING_FIELDS, PromptFormatter

SLOTS = 4  # the edge engine's default: requests decoded together


async def answer(
    engine: EdgeEngine, gate: asyncio.Semaphore, ids: list[int], sampling: SamplingParams
) -> list[int]:
    """One answer's tokens; ``gate`` keeps the engine's queue within its bound."""
    out: list[int] = []
    async with gate:
        async for event in engine.generate(GenerationRequest(ids, sampling)):
            out += event.token_ids
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = EdgeEngineConfig(slots=SLOTS, context=1024, threads=args.threads)
    engine = EdgeEngine.from_model(args.model, config=config)
    gate = asyncio.Semaphore(2 * SLOTS)
    fmt = PromptFormatter.from_folder(engine.tokenizer_dir)
    stops = tuple(fmt.stop_token_ids)
    arms = {  # the model's: what the node gives a request that names none (fmt.sampling)
        "model default": {k: fmt.sampling(k, None) for k in SAMPLING_FIELDS},
        "API default": dict(API_SAMPLING),
        "greedy": API_SAMPLING | {"temperature": 0.0},
    }
    questions = QualitySet.shipped().questions
    await engine.start()
    try:
        rows = []
        for arm, knobs in arms.items():
            samples = 1 if arm == "greedy" else args.samples
            jobs, accepts = [], []
            for prompt, accept in questions:
                ids = fmt.encode_chat([{"role": "user", "content": prompt}])
                for seed in range(samples):
                    sp = SamplingParams(
                        max_tokens=args.max_tokens,
                        temperature=knobs["temperature"],
                        top_p=knobs["top_p"],
                        top_k=int(knobs["top_k"]),
                        seed=seed,
                        stop_token_ids=stops,
                    )
                    jobs.append(answer(engine, gate, ids, sp))
                    accepts.append(accept)
            outs = await asyncio.gather(*jobs)
            right = [answers_right(fmt.decode(o), a) for o, a in zip(outs, accepts, strict=True)]
            first = right[:samples]  # the README's question
            rows.append(
                {
                    "arm": arm,
                    "temperature / top_p": f"{knobs['temperature']:g} / {knobs['top_p']:g}",
                    "answers right": f"{sum(right)}/{len(right)}",
                    "share right": round(sum(right) / len(right), 3),
                    "README question right": f"{sum(first)}/{len(first)}",
                }
            )
            print(rows[-1], flush=True)
    finally:
        await engine.shutdown()
    return {"rows": rows, "variant": engine.weights, "questions": len(questions)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--samples", type=int, default=10, help="samples per question and arm")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    res = asyncio.run(run(args))
    command = recorded_command("sampling_defaults.py", sys.argv[1:], ())
    cols = list(res["rows"][0])
    markdown = "\n\n".join(
        [
            "# sampling_defaults: the model's recommended sampling against the API default",
            f"`{command}` on {cpu_signature()}, edge weights: {res['variant']}; "
            f"{res['questions']} plain questions, {args.samples} seeded samples each per arm "
            "(greedy once).",
            table(res["rows"], cols),
        ]
    )
    write_results("sampling_defaults", {"machine": machine(), "command": command} | res, markdown)


if __name__ == "__main__":
    main()
