"""The cloud engine's first requests after a start: cold against warmed up (CPU).

Each round loads the default model twice, each time in a new process (a node's process is new
when it starts: torch's own first calls are part of what is cold), one core left cold and one
put through ``EngineCore.warm_up`` (what ``edgecloud cloud serve`` does unless told
``--no-warmup``), then serves the same requests on each, one at a time, greedy, 4 tokens: the
mix's short questions and chat turns (20-85 prompt tokens, random ids) and one 300-token
prompt. Each request's time to its first token is timed from ``add`` to the step that samples
it. Rounds alternate which core goes first; the result is the per-position median over the
rounds and the ratio cold / warm (the peer runs in the same process, the same minutes).

    python bench/cloud_warmup.py [--rounds 3] [--threads 2]

Writes bench/results/cloud_warmup.json and .md and prints a table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, recorded_command, table, write_results

PROMPTS = [20, 37, 20, 59, 20, 85, 20, 37, 300, 20]


def first_token_ms(core: object, ids: list[int]) -> float:
    from routing.engine import GenerationRequest, SamplingParams

    req = GenerationRequest(ids, SamplingParams(max_tokens=4, temperature=0.0))
    core.add(req)  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    first = None
    while core.has_work():  # type: ignore[attr-defined]
        outs = core.step()  # type: ignore[attr-defined]
        if first is None and any(o.new_token_ids for o in outs):
            first = (time.perf_counter() - t0) * 1e3
    assert first is not None
    return first


def serve(warm: bool, threads: int, seed: int) -> tuple[list[float], float]:
    """One fresh core: the first-token times of ``PROMPTS`` and the warm-up's seconds."""
    import torch

    from cloud_engine.config import EngineConfig
    from cloud_engine.engine import CloudEngine

    torch.set_num_threads(threads)
    engine = CloudEngine.from_model(
        "smollm2-135m-instruct", "cpu", config=EngineConfig(threads=threads, warmup=warm)
    )
    core = engine.core
    t0 = time.perf_counter()
    steps = core.warm_up() if warm else 0
    took = time.perf_counter() - t0 if steps else 0.0
    rng = random.Random(seed)
    times = [first_token_ms(core, [rng.randrange(100, 20000) for _ in range(n)]) for n in PROMPTS]
    return times, took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    runs: dict[str, list[list[float]]] = {"cold": [], "warm": []}
    warmups: list[float] = []
    for r in range(args.rounds):
        order = ("cold", "warm") if r % 2 == 0 else ("warm", "cold")
        for name in order:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                times, took = pool.submit(serve, name == "warm", args.threads, r).result()
            runs[name].append(times)
            if name == "warm":
                warmups.append(took)
    rows = []
    for i, n in enumerate(PROMPTS):
        cold = statistics.median(t[i] for t in runs["cold"])
        warm = statistics.median(t[i] for t in runs["warm"])
        rows.append(
            {
                "request": i + 1,
                "prompt_tokens": n,
                "cold_ms": cold,
                "warm_ms": warm,
                "cold_over_warm": cold / warm,
            }
        )
    md = table(rows, ["request", "prompt_tokens", "cold_ms", "warm_ms", "cold_over_warm"])
    md += f"\n\nwarm-up: {statistics.median(warmups):.2f} s (median of {len(warmups)})"
    payload = {
        "command": recorded_command("cloud_warmup.py", argv or sys.argv[1:], ()),
        "machine": machine(),
        "rows": rows,
        "warmup_s": warmups,
        "raw_ms": runs,
    }
    write_results("cloud_warmup", payload, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
