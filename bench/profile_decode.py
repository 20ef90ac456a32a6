"""Where a small-batch decode step's time goes on CUDA: per-kernel device time of one captured
decode graph replay (torch.profiler), the replay and whole-engine step times, and the memory
bandwidth they imply, for several kernel variants of the same random model.

    python bench/profile_decode.py --shapes qwen3-0.6b,llama-3.2-1b --batches 1 \\
        --variants base,gemv+attn,gemv+attn+pdl

A variant is ``+``-joined parts: ``base`` (cuBLAS products, the separate norm / SwiGLU / RoPE /
combine kernels), ``gemv`` (the skinny-GEMV kernels, up to ``rows=N`` rows), ``attn`` (the fused
decode attention), ``pdl`` (programmatic dependent launch), GEMV tuning ``tile=N``,
``minp=N``, ``warps=N`` (see ``cloud_engine.kernels.gemv``) and decode-attention tuning
``abn=N`` (keys per iteration), ``asplit=N`` (most splits). Every variant starts from the same
seed and prompts: the table gives, against the first variant, the relative error of the logits
of the first decode step and the agreement of greedy tokens over the timed steps (bf16
rounding differences flip near-ties, after which sequences diverge).

Writes ``profile_decode.md`` and ``profile_decode.json`` to ``--out`` (default
``bench/results``; a sweep of variants: another folder, such as ``bench/results/raw``).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, cuda_ms, recorded_command
from bench.cloud_throughput import SHAPES, copy_bandwidth, random_model
from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.kernels import decode_attention, gemv, pdl
from cloud_engine.model.config import ModelConfig
from cloud_engine.model.triton_ops import TritonOps
from routing.engine import GenerationRequest, SamplingParams

DEFAULTS = {
    "tile": gemv.TILE,
    "minp": gemv.MIN_PROGRAMS,
    "warps": gemv.NUM_WARPS,
    "rows": gemv.MAX_ROWS,
    "abn": decode_attention.BLOCK_N,
    "asplit": decode_attention.MAX_SPLITS,
}


def apply_variant(spec: str) -> TritonOps:
    """Set the kernel knobs for ``spec``; returns the ops it runs with."""
    parts = spec.split("+")
    knobs = dict(DEFAULTS)
    for p in parts:
        if "=" in p:
            k, v = p.split("=")
            knobs[k] = int(v)
    gemv.TILE, gemv.MIN_PROGRAMS, gemv.NUM_WARPS = knobs["tile"], knobs["minp"], knobs["warps"]
    decode_attention.BLOCK_N, decode_attention.MAX_SPLITS = knobs["abn"], knobs["asplit"]
    pdl.set_enabled("pdl" in parts)
    return TritonOps(
        gemv_rows=knobs["rows"] if "gemv" in parts else 0, decode_attention="attn" in parts
    )


def start_sequences(core: EngineCore, batch: int, ctx: int, steps: int) -> None:
    """Admit ``batch`` random prompts of ``ctx`` tokens and run until all are decoding."""
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(100, 30000) for _ in range(ctx)]
        sp = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
        core.add(GenerationRequest(prompt, sp, request_id=f"p{batch}-{i}"))
    while any(s.num_output < 2 for s in core.seqs.values()):
        core.step()


def kernel_table(graph: torch.cuda.CUDAGraph, layers: int, reps: int = 10) -> list[dict[str, Any]]:
    """Device time per replay of each kernel position, largest first: a kernel launched ``c``
    times a replay runs ``c // layers`` times per layer, labelled ``name[i]`` by its place in
    the layer (``name[tail]`` after the layers). With PDL a kernel's time includes its wait for
    the previous one, so times overlap and their sum exceeds the replay."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    evs = [
        ev
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0
    ]
    evs.sort(key=lambda ev: ev.time_range.start)
    per_rep = len(evs) // reps
    count: dict[str, int] = defaultdict(int)
    for ev in evs[:per_rep]:
        count[ev.name] += 1
    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    seen: dict[str, int] = defaultdict(int)
    for j, ev in enumerate(evs[: per_rep * reps]):
        if j % per_rep == 0:
            seen.clear()
        k = seen[ev.name]
        seen[ev.name] += 1
        per_layer = count[ev.name] // layers
        label = (
            f"[{k % per_layer}]" if k < per_layer * layers else f"[tail{k - per_layer * layers}]"
        )
        key = ev.name[:70] + label
        total[key] += ev.device_time  # microseconds
        calls[key] += 1
    rows = [
        {
            "kernel": name,
            "calls": calls[name] / reps,
            "us_step": total[name] / reps,
            "us_call": total[name] / calls[name],
        }
        for name in total
    ]
    return sorted(rows, key=lambda r: -r["us_step"])


def run_variant(
    name: str, cfg: ModelConfig, spec: str, args: argparse.Namespace, copy_bw: float
) -> dict[str, Any]:
    ops = apply_variant(spec)
    model = random_model(cfg, torch.bfloat16, "cuda", args.seed)
    econf = EngineConfig(
        device="cuda",
        kv_memory_bytes=args.kv_gib * 2**30,
        max_running=max(args.batches),
        max_context=4096,
        max_graph_batch=max(args.batches),
    )
    core = EngineCore(model, f"profile-{name}", econf)
    runner: Any = core.runner
    runner.fm.ops = ops
    t0 = time.perf_counter()
    runner.capture_graphs()
    out: dict[str, Any] = {"variant": spec, "capture_s": time.perf_counter() - t0, "batches": []}
    for b in args.batches:
        start_sequences(core, b, args.ctx, args.steps)
        seqs = list(core.seqs.values())
        g = runner.graph_for(b)
        first_logits = g.logits[:b].float().cpu()  # of the first decode step (same inputs)
        core.step()  # fill: timed from one step's return (tokens read) to the steps-th after
        t0 = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        step_ms = (time.perf_counter() - t0) / args.steps * 1e3
        torch.cuda.synchronize()
        rep = cuda_ms(g.graph.replay, 50)
        mean_ctx = statistics.mean(s.num_tokens for s in seqs) - args.steps / 2
        total = runner.fm.weight_bytes() + b * mean_ctx * core.pool.spec.bytes_per_token
        row = {
            "batch": b,
            "engine_ms": step_ms,
            "replay_ms": rep,
            "util_engine": total / (step_ms / 1e3) / copy_bw,
            "util_replay": total / (rep / 1e3) / copy_bw,
            "tokens": [s.token_ids[-args.steps :] for s in seqs],
            "first_logits": first_logits,
        }
        if b == args.batches[0]:
            row["kernels"] = kernel_table(g.graph, cfg.num_hidden_layers)
        for s in seqs:
            core.abort(s.request_id)
        out["batches"].append(row)
        print(
            f"[{name} {spec}] b={b}: engine {step_ms:.3f} ms, replay {rep:.3f} ms, "
            f"util {row['util_engine']:.0%} / {row['util_replay']:.0%}",
            flush=True,
        )
    del core, model, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def logits_error(a: torch.Tensor, b: torch.Tensor) -> str:
    """Relative error of ``a`` against ``b`` and how many rows keep their argmax."""
    err = float((a - b).norm() / b.norm())
    same = int((a.argmax(-1) == b.argmax(-1)).sum())
    return f"{err:.1e} ({same}/{a.shape[0]} argmax)"


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def markdown(results: dict[str, list[dict[str, Any]]], meta: dict[str, Any], top: int) -> str:
    lines = [f"# Decode profile ({meta['device']})", "", f"Command: `{meta['command']}`", ""]
    lines += [
        "| model | variant | batch | engine ms | util (engine) | replay ms | util (replay) | first-step logits vs first variant | token agreement |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, variants in results.items():
        ref = variants[0]
        for v in variants:
            for r, r0 in zip(v["batches"], ref["batches"], strict=True):
                lines.append(
                    f"| {model} | {v['variant']} | {r['batch']} | {r['engine_ms']:.3f} | {r['util_engine']:.0%} | {r['replay_ms']:.3f} | {r['util_replay']:.0%} | {logits_error(r['first_logits'], r0['first_logits'])} | {agreement(r['tokens'], r0['tokens']):.3f} |"
                )
    for model, variants in results.items():
        for v in variants:
            r = v["batches"][0]
            lines += [
                "",
                f"## {model}, {v['variant']}, batch {r['batch']}: kernels per replay",
                "",
                "| kernel | calls | us/step | us/call |",
                "|---|---|---|---|",
            ]
            for k in r["kernels"][:top]:
                lines.append(
                    f"| {k['kernel'][:90]} | {k['calls']:.0f} | {k['us_step']:.1f} | {k['us_call']:.2f} |"
                )
            rest = sum(k["us_step"] for k in r["kernels"][top:])
            tot = sum(k["us_step"] for k in r["kernels"])
            lines.append(f"| (others) | | {rest:.1f} | |")
            lines.append(f"| **sum of kernel time** | | {tot:.1f} | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,llama-3.2-1b")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--variants", default="base,gemv+attn+pdl")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": recorded_command("profile_decode.py", sys.argv[1:], ("--out",)),
    }
    copy_bw = copy_bandwidth()
    meta["copy_bw_Bps"] = copy_bw
    results: dict[str, list[dict[str, Any]]] = {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        cfg = ModelConfig.from_dict(dict(SHAPES[name]))
        results[name] = [run_variant(name, cfg, v, args, copy_bw) for v in args.variants.split(",")]
        md = markdown(results, meta, args.top)
        (out / "profile_decode.md").write_text(md)
        (out / "profile_decode.json").write_text(
            json.dumps({"meta": meta, "results": results}, indent=1, default=lambda t: None)
        )
    print(md)


if __name__ == "__main__":
    main()
