"""Parallel cloud engine on CPU: output tok/s at TP=1/2 and PP=1/2, each stage's busy share
under load, and the driver's per-step control cost.

Default model (fp32), one torch thread per rank, every rank its own process (gloo over
loopback). ``concurrency`` requests arrive at once (random prompts of ``--prompt`` tokens,
greedy, ``--output`` tokens each); the run ends when all finished. ``busy`` is the share of
the run a rank spent computing its part of steps (layers, LM head); ``control`` is the
driver's time per step to flatten the batch, pack it into int64 tensors and post it
(broadcast to its TP peers, send to the next stage), in microseconds.

    python bench/parallel.py [--concurrency 16 64] [--prompt 32] [--output 32]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import RESULTS, machine, recorded_command, table  # noqa: E402


def _requests(n: int, prompt: int, output: int, vocab: int, seed: int = 0):  # type: ignore[no-untyped-def]
    from routing.engine import GenerationRequest, SamplingParams

    rng = random.Random(seed)
    return [
        GenerationRequest(
            [rng.randrange(vocab) for _ in range(prompt)],
            SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True),
            request_id=f"b{i}",
        )
        for i in range(n)
    ]


def _run(core, reqs) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    for r in reqs:
        core.add(r)
    t0 = time.perf_counter()
    n = 0
    while core.has_work():
        for o in core.step():
            n += len(o.new_token_ids)
    return time.perf_counter() - t0, n


def bench_rank(
    rank_idx: int,
    world: int,
    init: str,
    folder: str,
    tp: int,
    pp: int,
    pp_layers: tuple[int, ...] | None,
    runs: list[int],
    prompt: int,
    output: int,
) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    import torch

    from cloud_engine.config import EngineConfig
    from cloud_engine.core import EngineCore
    from cloud_engine.model.loader import load_model
    from cloud_engine.parallel.build import driver_core, run_worker
    from cloud_engine.parallel.dist import ParallelConfig, close_world, init_world

    torch.set_num_threads(1)
    cfg = EngineConfig(
        kv_memory_bytes=256 * 2**20, max_running=64, max_tokens_per_step=1024, threads=1
    )
    out: list[dict[str, Any]] = []
    with torch.inference_mode():
        if world == 1:
            core = EngineCore(load_model(folder), "bench", cfg)
            for n in runs:
                reqs = _requests(n, prompt, output, core.vocab_size)
                _run(core, _requests(4, prompt, 4, core.vocab_size, seed=9))  # warm-up
                steps0 = core.counters.steps
                wall, toks = _run(core, reqs)
                out.append(
                    dict(
                        concurrency=n,
                        wall_s=wall,
                        tokens=toks,
                        tok_s=toks / wall,
                        steps=core.counters.steps - steps0,
                        busy=[1.0],
                        control_us=0.0,
                    )
                )
            return out
        rank = init_world(
            ParallelConfig(tp, pp, pp_layers), rank_idx, init_method=init, timeout_s=120
        )
        try:
            if not rank.is_driver:
                for _ in runs:
                    run_worker(folder, rank, cfg)
                return []
            for n in runs:
                core = driver_core(folder, "bench", rank, cfg)
                _run(core, _requests(4, prompt, 4, core.vocab_size, seed=9))  # warm-up
                runner = core.runner
                reqs = _requests(n, prompt, output, core.vocab_size)
                runner.reset_stats()  # type: ignore[attr-defined]  # the measured run only
                wall, toks = _run(core, reqs)
                nsteps = max(1, runner.steps)  # type: ignore[attr-defined]
                ctrl = runner.control_s / nsteps  # type: ignore[attr-defined]
                pack = runner.pack_s / nsteps  # type: ignore[attr-defined]
                stats = runner.stop()  # type: ignore[attr-defined]
                # each rank's busy seconds over the measured run (its first step to STOP)
                busy = [round(s[0] / max(s[1], 1e-9), 3) for s in stats]
                out.append(
                    dict(
                        concurrency=n,
                        wall_s=wall,
                        tokens=toks,
                        tok_s=toks / wall,
                        steps=runner.steps,  # type: ignore[attr-defined]
                        busy=busy,
                        control_us=ctrl * 1e6,
                        pack_us=pack * 1e6,
                    )
                )  # type: ignore[attr-defined]
            return out
        finally:
            close_world()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--output", type=int, default=32)
    p.add_argument(
        "--layouts",
        nargs="+",
        default=["1x1", "2x1", "1x2"],
        help="TPxPP, or TPxPP:L0,L1,... or TPxPP:balanced for the layers of each stage (--pp-layers)",
    )
    p.add_argument("--model", default=None, help="a model folder (default: the default model)")
    p.add_argument("--results", default="parallel.json", help="file name under bench/results")
    args = p.parse_args(argv)

    from cloud_engine.parallel.dist import parse_pp_layers
    from cloud_engine.parallel.local import run_world

    if args.model:  # routing.model_store needs the gateway's packages: not on every machine
        folder, model_name = args.model, Path(args.model).name
    else:
        from routing.model_store import DEFAULT_MODEL, resolve

        folder, model_name = str(resolve(DEFAULT_MODEL).path), DEFAULT_MODEL
    rows = []
    for layout in args.layouts:
        shape, _, split = layout.partition(":")
        tp, pp = (int(x) for x in shape.split("x"))
        pp_layers = parse_pp_layers(split or None, folder, pp)
        res = run_world(
            bench_rank,
            tp * pp,
            folder,
            tp,
            pp,
            pp_layers,
            args.concurrency,
            args.prompt,
            args.output,
            timeout_s=1800,
        )
        for r in res:
            r.update(tp=tp, pp=pp, pp_layers=list(pp_layers) if pp_layers else None)
            rows.append(r)
            print(
                f"TP={tp} PP={pp} c={r['concurrency']:3d}: {r['tok_s']:7.1f} tok/s, {r['steps']} steps, "
                f"busy {r['busy']}, control {r['control_us']:.0f} us/step "
                f"(pack {r.get('pack_us', 0):.0f})",
                flush=True,
            )
    try:
        import os

        load = os.getloadavg()[0]
    except OSError:
        load = None
    result = dict(
        machine=machine(),
        model=model_name,
        prompt=args.prompt,
        output=args.output,
        threads_per_rank=1,
        load_average_1m_after=load,
        rows=rows,
        command=recorded_command("parallel.py", sys.argv[1:] if argv is None else argv, ()),
    )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / args.results
    out.write_text(json.dumps(result, indent=2) + "\n")
    cols = ["tp", "pp", "pp_layers", "concurrency", "tok_s", "busy", "control_us", "pack_us"]
    out.with_suffix(".md").write_text(
        f"# parallel\n\n`{result['command']}`\n\n{table(rows, cols)}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
