"""Compressed KV under memory pressure: bf16, fp8 and int8 pools in one run (CUDA).

Two measurements, both on the Llama-3.1-8B shape (random bf16 weights: weights do not change
speed), fixed in advance:

- ``pressure``: 256 requests (``--requests``), prompts of 4,096-16,384 random tokens, outputs
  of 128-512 tokens (greedy, EOS ignored), all submitted at once; the KV budget is 20% of the
  device memory free once the weights are loaded, the same bytes for every KV dtype. Reports
  output tokens/s, p99 inter-token latency (the gaps between a request's consecutive tokens as
  the engine returns them), preemptions and the pool's tokens.
- ``decode``: one decode step at batch 32 with 8,192-token contexts (KV bytes: 34 GB in bf16,
  beside 16 GB of weights), the fused model replayed from a CUDA graph over a pool filled with
  random KV (no prefill needed: the step reads the same bytes).

    python bench/cloud_throughput.py --kv-pressure            # both, through the main bench
    python bench/kv_pressure.py --part decode --kv bf16,fp8   # one part, some dtypes

Writes ``bench/results/kv_pressure_<tag>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import cuda_ms, recorded_command
from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.kv_pool import KVPool, KVSpec
from cloud_engine.kv_quant import storage_of
from cloud_engine.model.config import ModelConfig
from routing.engine import GenerationRequest, SamplingParams

SHAPE = "llama-3.1-8b"


def _model(seed: int) -> Any:
    from bench.cloud_throughput import SHAPES, random_model

    cfg = ModelConfig.from_dict(dict(SHAPES[SHAPE]))
    return cfg, random_model(cfg, torch.bfloat16, "cuda", seed)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def pressure(
    args: argparse.Namespace, kvs: list[str], res: dict[str, Any], save: Any
) -> dict[str, Any]:
    """The memory-pressure workload for each KV dtype over one model and one byte budget,
    into ``res`` (``save()`` after each dtype)."""
    _cfg, model = _model(args.seed)
    free, _total = torch.cuda.mem_get_info()
    budget = int(free * args.kv_share)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, 30000) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
        for _ in range(args.requests)
    ]
    outs = [rng.randint(args.out_min, args.out_max) for _ in range(args.requests)]
    res.update(
        {
            "model": SHAPE,
            "requests": args.requests,
            "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(outs),
            "prompt_len": [args.prompt_min, args.prompt_max],
            "output_len": [args.out_min, args.out_max],
            "free_after_weights_bytes": free,
            "kv_budget_bytes": budget,
            "runs": {},
        }
    )
    for kv in kvs:
        econf = EngineConfig(
            device="cuda",
            kv_memory_bytes=budget,
            kv_dtype=kv,  # type: ignore[arg-type]
            max_context=args.prompt_max + args.out_max + 16,
        )
        core = EngineCore(model, f"kv-pressure-{kv}", econf)
        core.runner.capture_graphs()  # type: ignore[attr-defined]
        warm = [GenerationRequest(prompts[0][:300], SamplingParams(max_tokens=4, ignore_eos=True))]
        for r in warm:
            core.add(r)
        while core.has_work():
            core.step()
        core.blocks.reset_cache()
        core.counters = type(core.counters)()
        last: dict[str, float] = {}
        gaps: list[float] = []
        n = 0
        t0 = time.perf_counter()
        for i, (p, m) in enumerate(zip(prompts, outs, strict=True)):
            sp = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
            core.add(GenerationRequest(p, sp, request_id=f"p{i}"))
        while core.has_work():
            outputs = core.step()
            now = time.perf_counter()
            for o in outputs:
                k = len(o.new_token_ids)
                if not k:
                    continue
                rid = o.seq.request_id
                if rid in last:
                    gaps.append((now - last[rid]) / k)
                last[rid] = now
                n += k
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        gaps.sort()
        run = {
            "kv_dtype": core.pool.spec.kv_dtype,
            "pool_blocks": core.pool.num_blocks,
            "pool_tokens": core.pool.capacity_tokens,
            "wall_s": wall,
            "output_tokens": n,
            "tok_s": n / wall,
            "itl_p50_ms": 1e3 * gaps[len(gaps) // 2] if gaps else None,
            "itl_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else None,
            "preemptions": core.counters.preemptions,
            "peak_blocks_used": core.counters.peak_blocks_used,
        }
        res["runs"][kv] = run
        print(f"[pressure {kv}] {json.dumps(run)}", flush=True)
        save()
        del core
        _free()
    del model
    _free()
    return res


def _decode_inputs(batch: int, ctx: int, group: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """AttnInputs of one decode step of ``batch`` sequences of ``ctx`` tokens (blocks laid
    out one sequence after another), their positions and token ids."""
    from cloud_engine.kernels.tiling import tile_shape
    from cloud_engine.model.fused import AttnInputs

    i32 = {"dtype": torch.int32, "device": "cuda"}
    nb = -(-ctx // 16)
    tables = torch.arange(batch * nb, **i32).view(batch, nb)  # type: ignore[arg-type]
    slots = tables[:, (ctx - 1) // 16] * 16 + (ctx - 1) % 16
    a = AttnInputs(
        slots.contiguous(), tables, torch.arange(batch, **i32),  # type: ignore[arg-type]
        torch.full((batch,), ctx, **i32), torch.arange(batch + 1, **i32),  # type: ignore[arg-type]
        torch.arange(batch, **i32), torch.zeros(batch, **i32), tile_shape(group, 1),  # type: ignore[arg-type]
    )  # fmt: skip
    pos = torch.full((batch,), ctx - 1, **i32)  # type: ignore[arg-type]
    ids = torch.randint(100, 30000, (batch,), device="cuda")
    return a, pos, ids


def decode(args: argparse.Namespace, kvs: list[str]) -> dict[str, Any]:
    """One decode step at ``--decode-batch`` x ``--decode-ctx`` for each KV dtype."""
    from cloud_engine.model.fused import FusedLlama
    from cloud_engine.model.triton_ops import TritonOps

    cfg, model = _model(args.seed)
    spec = KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16)
    batch, ctx = args.decode_batch, args.decode_ctx
    blocks = batch * -(-ctx // 16)
    fm = FusedLlama(model, KVPool(spec, 1, "cuda"), TritonOps())
    del model
    _free()
    weight_bytes = fm.weight_bytes()
    a, pos, ids = _decode_inputs(batch, ctx, cfg.num_attention_heads // cfg.num_key_value_heads)
    res: dict[str, Any] = {
        "model": SHAPE, "batch": batch, "ctx": ctx, "weight_bytes": weight_bytes, "runs": {},
    }  # fmt: skip
    for kv in kvs:
        storage = None if kv == "bf16" else storage_of(kv)
        pool = KVPool(spec.with_storage(storage or torch.bfloat16), blocks, "cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        for layer in range(spec.num_layers):  # random KV, layer by layer (no big temporaries)
            x = torch.randn(pool.data[layer].shape, device="cuda", generator=g)
            pool.data[layer].copy_((x * 40).round().clamp(-127, 127) if kv == "int8" else x)
        if pool.scales is not None:
            pool.scales.fill_(0.02)
        fm.pool = pool
        step = lambda: fm.logits_argmax(fm.forward(ids, pos, a))  # noqa: E731
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        ms = cuda_ms(graph.replay, 30)
        kv_bytes = batch * ctx * pool.spec.bytes_per_token
        run = {
            "kv_dtype": kv,
            "kv_bytes": kv_bytes,
            "step_ms": ms,
            "bytes_per_s": (weight_bytes + kv_bytes) / (ms / 1e3),
        }
        res["runs"][kv] = run
        print(f"[decode {kv}] {json.dumps(run)}", flush=True)
        del graph, pool
        fm.pool = None  # type: ignore[assignment]
        _free()
    return res


def markdown(out: dict[str, Any]) -> str:
    meta = out["meta"]
    lines = [f"# Compressed KV under memory pressure ({meta['device_name']})", "",
             f"Command: `{meta['command']}`", ""]  # fmt: skip
    p = out.get("pressure")
    if p and p.get("runs"):
        base = p["runs"].get("bf16")
        lines += [
            f"Pressure: {p['model']} shape, {p['requests']} requests, prompts "
            f"{p['prompt_len'][0]}-{p['prompt_len'][1]} tokens, outputs {p['output_len'][0]}-"
            f"{p['output_len'][1]}; KV budget {p['kv_budget_bytes'] / 2**30:.1f} GiB (20% of the "
            f"{p['free_after_weights_bytes'] / 2**30:.1f} GiB free after the weights).",
            "",
            "| KV | pool tokens | tok/s | vs bf16 | p50 ITL ms | p99 ITL ms | preemptions | wall s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for kv, r in p["runs"].items():
            rel = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
            lines.append(
                f"| {kv} | {r['pool_tokens']:,} | {r['tok_s']:.0f} | {rel} | "
                f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['preemptions']} | "
                f"{r['wall_s']:.1f} |"
            )
        lines.append("")
    d = out.get("decode")
    if d:
        base = d["runs"].get("bf16")
        lines += [
            f"Decode step: {d['model']} shape, batch {d['batch']}, {d['ctx']}-token contexts, "
            f"weights {d['weight_bytes'] / 1e9:.1f} GB; one CUDA-graph replay (median of 30).",
            "",
            "| KV | KV bytes | step ms | speed-up vs bf16 | (weights + KV) / step |",
            "|---|---|---|---|---|",
        ]
        for kv, r in d["runs"].items():
            rel = f"{base['step_ms'] / r['step_ms']:.2f}x" if base else "-"
            lines.append(
                f"| {kv} | {r['kv_bytes'] / 1e9:.1f} GB | {r['step_ms']:.2f} | {rel} | "
                f"{r['bytes_per_s'] / 1e12:.2f} TB/s |"
            )
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--part", default="all", choices=["all", "pressure", "decode"])
    ap.add_argument("--kv", default="bf16,fp8,int8", help="KV dtypes, comma-separated")
    ap.add_argument("--kv-share", type=float, default=0.2, help="KV budget: share of free memory")
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--decode-ctx", type=int, default=8192)
    ap.add_argument("--tag", default=None)


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Both parts (or ``args.part``) for ``args.kv``; writes the result files."""
    kvs = [k.strip() for k in args.kv.split(",") if k.strip()]
    out: dict[str, Any] = {
        "meta": {
            "device_name": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "command": recorded_command(Path(sys.argv[0]).name, argv, ("--out-dir",)),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "weights": "random",
        }
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag or torch.cuda.get_device_name().split()[-1].lower()

    def save() -> None:  # after each part: a cut-short run keeps what it measured
        (out_dir / f"kv_pressure_{tag}.json").write_text(json.dumps(out, indent=2))
        (out_dir / f"kv_pressure_{tag}.md").write_text(markdown(out))

    if args.part in ("all", "decode"):
        out["decode"] = decode(args, kvs)
        save()
    if args.part in ("all", "pressure"):
        out["pressure"] = {}
        pressure(args, kvs, out["pressure"], save)
    print(markdown(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-min", type=int, default=4096)
    ap.add_argument("--prompt-max", type=int, default=16384)
    ap.add_argument("--out-min", type=int, default=128)
    ap.add_argument("--out-max", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    run(args, sys.argv[1:])


if __name__ == "__main__":
    main()
