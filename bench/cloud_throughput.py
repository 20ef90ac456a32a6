"""Cloud engine throughput: our paged engine vs transformers' continuous batching, same run.

CPU (the default model, real weights):
    python bench/cloud_throughput.py --device cpu --requests 64
GPU (random bf16 models of real shapes; weights do not change speed):
    python bench/cloud_throughput.py --device cuda --shapes qwen3-0.6b,llama-3.2-1b --requests 256

Both engines get the same prompts (random token ids, lengths uniform in [--prompt-min,
--prompt-max]) and the same output lengths (uniform in [--out-min, --out-max]; EOS ignored), and
are timed from submission of all requests to the last token. Ours runs after start-up (CUDA
graphs captured, kernels compiled: the start-up time is reported apart); the peer is warmed up
with a small batch first. On CUDA it also measures decode memory-bandwidth utilization at
batch 1 and 64 (weights + KV bytes read per step over the measured copy bandwidth) and the KV
waste at peak (slots of in-use blocks holding no token). Writes JSON and markdown to
bench/results/.

Compressed KV (bf16, fp8 and int8 pools in one run: the Llama-3.1-8B shape under memory
pressure, and the decode step at batch 32 with 8k-token contexts): ``--kv-pressure``, which runs
``bench/kv_pressure.py`` with the arguments that follow.

Larger shapes: ``--shapes llama-3.1-8b`` (dense), ``--shapes qwen3-30b-a3b`` (MoE: loaded by
``cloud_engine.parallel`` at tp=1 over the peer's own tensors, one copy of 61 GB, and run by the
fused CUDA engine with its graphs). ``--peer-requests N``: the peer runs the first N requests only, and ours runs
them too, so the speedup is taken at the same concurrency.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import cuda_ms, recorded_command
from cloud_engine.config import EngineConfig
from cloud_engine.core import EngineCore
from cloud_engine.model.config import ModelConfig
from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.model.loader import init_random_weights
from cloud_engine.step_stats import CoreCounters
from routing.engine import GenerationRequest, SamplingParams

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500_000.0, max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500_000.0, max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}  # fmt: skip

# MoE shapes: HF config dicts (loaded by the parallel package at tp=1; on CUDA the fused engine
# runs them, on CPU the eager layers). "qwen3-moe-tiny" is a CPU smoke test.
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
    ),
    "qwen3-moe-tiny": dict(
        model_type="qwen3_moe", vocab_size=32000, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
}  # fmt: skip


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: str, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    with torch.device(device):
        model = init_random_weights(LlamaForCausalLM(cfg))
    model = model.to(dtype).eval()
    model.rotary = type(model.rotary)(cfg).to(device)  # keep inv_freq in float32
    return model


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, 30000) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
        for _ in range(args.requests)
    ]
    outs = [rng.randint(args.out_min, args.out_max) for _ in range(args.requests)]
    return prompts, outs


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_ours(
    core: EngineCore, prompts: list[list[int]], outs: list[int], device: str
) -> dict[str, Any]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in outs]
    # warm-up: compile kernels for prefill and decode, capture graphs
    t0 = time.perf_counter()
    warm = getattr(core.runner, "capture_graphs", None)
    if warm is not None:
        warm()
    for i in range(2):
        core.add(
            GenerationRequest(
                prompts[i][:200], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            )
        )
    while core.has_work():
        core.step()
    sync(device)
    startup_s = time.perf_counter() - t0
    core.blocks.reset_cache()
    core.counters = CoreCounters()
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add(GenerationRequest(p, sp, request_id=f"b{i}"))
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.seq.request_id, []).extend(o.new_token_ids)
    sync(device)
    wall = time.perf_counter() - t0
    n = sum(len(v) for v in tokens.values())
    c = core.counters
    return {
        "wall_s": wall,
        "output_tokens": n,
        "tok_s": n / wall,
        "startup_s": startup_s,
        "steps": c.steps,
        "preemptions": c.preemptions,
        "kv_waste_at_peak": c.kv_waste_at_peak,
        "peak_blocks_used": c.peak_blocks_used,
        "kv_blocks_total": core.blocks.num_blocks,
        "prefill_tok_s_ewma": c.prefill_tok_s.value,
        "decode_ms_ewma": c.decode_ms.value,
        "first_tokens": [tokens[f"b{i}"][:1] for i in range(len(prompts))],
    }


def run_peer(hf: Any, prompts: list[list[int]], outs: list[int], device: str) -> dict[str, Any]:
    from transformers import GenerationConfig

    gcfg = GenerationConfig(
        max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    hf.generate_batch(
        inputs=[p[:100] for p in prompts[:4]], generation_config=gcfg, max_new_tokens=8
    )
    sync(device)
    t0 = time.perf_counter()
    firsts: dict[int, list[int]] = {}
    if len(set(outs)) == 1:
        mode = "generate_batch"
        res = hf.generate_batch(inputs=prompts, generation_config=gcfg, max_new_tokens=outs[0])
        n = 0
        for rid, r in res.items():
            n += len(r.generated_tokens)
            firsts[int(rid.split("_")[-1])] = list(r.generated_tokens[:1])
    else:  # per-request output lengths: the manager that generate_batch wraps
        mode = "continuous batching manager (add_request with per-request max_new_tokens)"
        mgr = hf.init_continuous_batching(generation_config=gcfg)
        mgr.start()
        for i, (p, m) in enumerate(zip(prompts, outs, strict=True)):
            mgr.add_request(p, request_id=f"q{i}", max_new_tokens=m)
        n = done = 0
        while done < len(prompts):
            r = mgr.get_result(timeout=5)
            if r is not None and r.is_finished():
                done += 1
                n += len(r.generated_tokens)
                firsts[int(r.request_id[1:])] = list(r.generated_tokens[:1])
        mgr.stop(block=True)
    sync(device)
    wall = time.perf_counter() - t0
    return {
        "mode": mode,
        "wall_s": wall,
        "output_tokens": n,
        "tok_s": n / wall,
        "first_tokens": [firsts.get(i, []) for i in range(len(prompts))],
    }


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    x = torch.randn(2**30 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    seconds = cuda_ms(functools.partial(y.copy_, x), 20) / 1e3
    bw = 2 * x.numel() * x.element_size() / seconds
    del x, y
    return bw


def decode_bandwidth(
    core: EngineCore,
    batch: int,
    ctx: int,
    copy_bw: float,
    steps: int = 16,
    rounds: int = 3,
    weight_bytes: int | None = None,
) -> dict[str, Any]:
    """Decode step time at ``batch`` sequences of about ``ctx`` tokens: through the engine
    (host work included) with and without overlap (alternating rounds, median), and as a bare
    graph replay; bytes read = weights (``weight_bytes``, else the fused model's) + every KV
    byte. An engine round is timed in steady
    state: from the return of one step (tokens read) to the return of the ``steps``-th after
    it, so with overlap neither the first step's launch nor the look-ahead step still in flight
    at the end counts."""
    runner: Any = core.runner
    rng = random.Random(batch)
    for i in range(batch):
        prompt = [rng.randrange(100, 30000) for _ in range(ctx)]
        core.add(
            GenerationRequest(
                prompt,
                SamplingParams(
                    max_tokens=2 * rounds * (steps + 2) + 40, temperature=0.0, ignore_eos=True
                ),
                request_id=f"bw{batch}-{i}",
            )
        )
    while any(s.num_output < 2 for s in core.seqs.values()):
        core.step()
    seqs = list(core.seqs.values())
    assert len(seqs) == batch
    start_ctx = statistics.mean(s.num_tokens for s in seqs)
    overlap = core.config.overlap
    per_mode: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for mode in (True, False):
            core.config = replace(core.config, overlap=False)
            if core.has_ahead:
                core.step()  # collect the look-ahead step in flight: each round starts planned
            core.config = replace(core.config, overlap=mode)
            core.step()  # fill: with overlap a look-ahead step is now in flight
            t0 = time.perf_counter()
            for _ in range(steps):
                core.step()  # returns once a step's tokens are read
            per_mode[mode].append((time.perf_counter() - t0) / steps)
    core.config = replace(core.config, overlap=overlap)
    step_s = statistics.median(per_mode[True])
    sync_s = statistics.median(per_mode[False])
    mean_ctx = (start_ctx + statistics.mean(s.num_tokens for s in seqs)) / 2
    kv_bytes = batch * mean_ctx * core.pool.spec.bytes_per_token
    w_bytes = runner.fm.weight_bytes() if weight_bytes is None else weight_bytes
    g = runner.graph_for(batch)
    replay_s = cuda_ms(g.graph.replay, 20) / 1e3
    for s in seqs:
        core.abort(s.request_id)
    total = w_bytes + kv_bytes
    return {
        "batch": batch,
        "ctx": round(mean_ctx),
        "weight_bytes": w_bytes,
        "kv_bytes": int(kv_bytes),
        "engine_step_ms": step_s * 1e3,
        "engine_step_ms_no_overlap": sync_s * 1e3,
        "graph_replay_ms": replay_s * 1e3,
        "util_engine": total / step_s / copy_bw,
        "util_engine_no_overlap": total / sync_s / copy_bw,
        "util_graph": total / replay_s / copy_bw,
    }


def bench_model(
    name: str, cfg: ModelConfig, args: argparse.Namespace, hf_path: Path | None
) -> dict[str, Any]:
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    prompts, outs = workload(args)
    out: dict[str, Any] = {
        "model": name,
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_len": [min(outs), max(outs)],
    }
    if hf_path is not None:
        from cloud_engine.model.loader import load_model

        model = load_model(hf_path, dtype=dtype, device=device)
    else:
        model = random_model(cfg, dtype, device, args.seed)
    state = (
        {k: v.detach().clone() for k, v in model.state_dict().items()}
        if not args.skip_peer
        else None
    )
    econf = EngineConfig(
        device=device,
        kv_memory_fraction=args.kv_fraction,
        kv_memory_bytes=None if device == "cuda" else args.kv_bytes,
        max_running=args.max_running,
        max_tokens_per_step=args.max_tokens_per_step,
        max_context=min(cfg.max_position_embeddings, 4096),
        threads=args.threads,
    )
    core = EngineCore(model, f"bench-{name}", econf)
    print(f"[{name}] ours: {core.blocks.num_blocks} KV blocks", flush=True)
    out["ours"] = ours = run_ours(core, prompts, outs, device)
    print(f"[{name}] ours: {ours['tok_s']:.0f} tok/s ({ours['wall_s']:.1f} s)", flush=True)
    if core.config.overlap:  # the same engine planning every step after reading the last
        core.config = replace(core.config, overlap=False)
        core.blocks.reset_cache()
        sync_run = run_ours(core, prompts, outs, device)
        core.config = replace(core.config, overlap=True)
        sync_run.pop("first_tokens")
        out["ours_no_overlap"] = sync_run
        print(f"[{name}] ours without overlap: {sync_run['tok_s']:.0f} tok/s", flush=True)
    n_peer = peer_count(args, len(prompts))
    if n_peer < len(prompts):  # the peer runs fewer: ours at the same concurrency too
        core.blocks.reset_cache()
        sub = run_ours(core, prompts[:n_peer], outs[:n_peer], device)
        out["ours_at_peer_requests"] = sub
        print(f"[{name}] ours at {n_peer} requests: {sub['tok_s']:.0f} tok/s", flush=True)
    if device == "cuda" and not args.skip_bw:
        bw = copy_bandwidth()
        out["copy_bw_Bps"] = bw
        out["decode_bw"] = [decode_bandwidth(core, b, args.bw_ctx, bw) for b in (1, 64)]
        for r in out["decode_bw"]:
            print(
                f"[{name}] decode b={r['batch']}: {r['engine_step_ms']:.3f} ms/step engine ({r['engine_step_ms_no_overlap']:.3f} without overlap), {r['graph_replay_ms']:.3f} ms replay; util {r['util_engine']:.0%} / {r['util_graph']:.0%}",
                flush=True,
            )
    del core, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_peer:
        from transformers import AutoConfig, AutoModelForCausalLM

        if hf_path is not None:
            hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=dtype).to(device).eval()
        else:
            hcfg = AutoConfig.for_model(**cfg.to_hf_dict())
            with torch.device(device):  # built on the device: no host-side init of 8B weights
                hf = AutoModelForCausalLM.from_config(hcfg, dtype=dtype).eval()
            assert state is not None
            hf.load_state_dict({k: v for k, v in state.items() if "rotary" not in k}, strict=False)
            del state
        peer_vs(out, hf, prompts[:n_peer], outs[:n_peer], device, name)
        del hf
    for k in ("ours", "ours_at_peer_requests", "peer"):
        if k in out:
            out[k].pop("first_tokens", None)
    return out


def peer_count(args: argparse.Namespace, n: int) -> int:
    return min(n, args.peer_requests or n)


def peer_vs(
    out: dict[str, Any], hf: Any, prompts: list[list[int]], outs: list[int], device: str, name: str
) -> None:
    """Run the peer on ``prompts`` and compare with ours at the same request count."""
    out["peer"] = peer = run_peer(hf, prompts, outs, device)
    peer["requests"] = len(prompts)
    same = out.get("ours_at_peer_requests", out["ours"])
    firsts = [a == b for a, b in zip(same["first_tokens"], peer["first_tokens"], strict=True) if b]
    if not out.get("shared_weights_with_peer", True):
        firsts = []
    out["first_token_agreement"] = sum(firsts) / len(firsts) if firsts else None
    out["speedup"] = same["tok_s"] / peer["tok_s"]
    print(
        f"[{name}] peer ({len(prompts)} requests): {peer['tok_s']:.0f} tok/s ({peer['wall_s']:.1f} s); "
        f"ours at the same requests {same['tok_s']:.0f}; speedup {out['speedup']:.1f}x",
        flush=True,
    )


class MemCheckpoint:
    """The parallel package's ``Checkpoint`` interface over in-memory tensors (the peer's
    state dict): slices are views, so both engines share one copy of the weights."""

    def __init__(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.state, self.dtype = state, dtype

    def has(self, name: str) -> bool:
        return name in self.state

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype).contiguous()  # no copy when already so

    def full(self, name: str) -> torch.Tensor:
        return self._out(self.state[name])

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        return self._out(self.state[name][a:b])

    def cols(self, name: str, a: int, b: int) -> torch.Tensor:
        return self._out(self.state[name][:, a:b])

    def rows_padded(self, name: str, a: int, b: int) -> torch.Tensor:
        t = self.state[name]
        assert a == 0 and b == t.shape[0], "tp=1 only: no padded vocabulary"
        return self._out(t)


def bench_moe(name: str, d: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A MoE shape: the peer's random model is built first (on the device), and our engine runs
    over the same tensors (no second copy: 61 GB fits once): ours, then the peer."""
    from unittest import mock

    from transformers import AutoConfig, AutoModelForCausalLM

    import cloud_engine.parallel.model as pmodel
    from cloud_engine.cuda_runner import CudaRunner
    from cloud_engine.kv_pool import budget_bytes_for
    from cloud_engine.model.triton_ops import TritonOps
    from cloud_engine.parallel.dist import ParallelConfig, Rank
    from cloud_engine.parallel.moe import MoEConfig, base_config_dict
    from cloud_engine.parallel.runner import DistRunner, make_pool

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    prompts, outs = workload(args)
    out: dict[str, Any] = {
        "model": name,
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_len": [min(outs), max(outs)],
        "engine": "the fused CUDA engine over the parallel package's tp=1 shard: decode in CUDA "
        "graphs (MoE pair kernels up to 4 tokens, the grouped Triton kernel beyond)"
        if device == "cuda"
        else "cloud_engine.parallel (tp=1, pp=1): eager torch layers",
    }
    cfg = ModelConfig.from_dict(base_config_dict(dict(d)))
    mc = MoEConfig.from_dict(d)
    assert mc is not None
    torch.manual_seed(args.seed)
    hcfg = AutoConfig.for_model(**d)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hcfg, dtype=dtype).eval()
    out["peer_experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
    state = dict(hf.state_dict())
    ck = MemCheckpoint(state, dtype)
    rank = Rank(ParallelConfig(), 0, None, torch.device(device))
    with (
        mock.patch.object(pmodel, "Checkpoint", lambda *a: ck),
        mock.patch.object(pmodel, "read_config", lambda folder: (cfg, mc)),
    ):
        model = pmodel.ShardedLlama("<memory>", rank, range(cfg.num_hidden_layers), dtype)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    per_expert = sum(
        nbytes(t) // mc.num_experts
        for t in (model.blocks[0].moe.w_gate_up, model.blocks[0].moe.w_down)
    )
    dense = 0
    for b in model.blocks:
        dense += sum(nbytes(t) for t in (b.w_qkv, b.w_o, b.ln1, b.ln2) if t is not None)
        dense += sum(nbytes(t) for t in (b.q_norm, b.k_norm) if t is not None)
        dense += (
            nbytes(b.moe.router) if b.moe is not None else nbytes(b.w_gate_up) + nbytes(b.w_down)
        )
    dense += nbytes(model.head) + nbytes(model.norm)
    sparse_layers = sum(b.moe is not None for b in model.blocks)
    moe_bytes = {
        "total_weight_bytes": sum(nbytes(t) for t in state.values()),
        "dense_weight_bytes": dense,
        "expert_bytes": per_expert,
        "active_weight_bytes": dense + sparse_layers * mc.top_k * per_expert,
    }
    out["weights"] = moe_bytes
    print(f"[{name}] weights {moe_bytes['total_weight_bytes'] / 1e9:.1f} GB, read per batch-1 "
          f"step {moe_bytes['active_weight_bytes'] / 1e9:.2f} GB", flush=True)  # fmt: skip
    econf = EngineConfig(
        device=device,
        kv_memory_fraction=args.kv_fraction,
        kv_memory_bytes=None if device == "cuda" else args.kv_bytes,
        max_running=args.max_running,
        max_tokens_per_step=args.max_tokens_per_step,
        max_context=min(cfg.max_position_embeddings, 4096),
        threads=args.threads,
        overlap=device == "cuda",
    ).resolved()
    budget = budget_bytes_for(rank.device, econf.kv_memory_fraction, econf.kv_memory_bytes)
    pool = make_pool(model, rank, budget, econf)
    if device == "cuda":  # the fused model over the shard's tensors, CUDA graphs for decode
        ops = TritonOps(moe_pairs=not args.no_moe_pairs)
        runner = CudaRunner(
            model, pool, max_batch=econf.max_running or 256, max_context=econf.max_context or 4096,
            max_graph_batch=econf.max_graph_batch, ops=ops,
        )  # fmt: skip
    else:
        runner = DistRunner(model, pool, rank)
    core = EngineCore(model, f"bench-{name}", econf, runner)  # type: ignore[arg-type]
    print(f"[{name}] ours: {core.blocks.num_blocks} KV blocks", flush=True)
    out["ours"] = ours = run_ours(core, prompts, outs, device)
    print(f"[{name}] ours: {ours['tok_s']:.0f} tok/s ({ours['wall_s']:.1f} s)", flush=True)
    n_peer = peer_count(args, len(prompts))
    if n_peer < len(prompts):
        core.blocks.reset_cache()
        out["ours_at_peer_requests"] = sub = run_ours(core, prompts[:n_peer], outs[:n_peer], device)
        print(f"[{name}] ours at {n_peer} requests: {sub['tok_s']:.0f} tok/s", flush=True)
    if not args.skip_bw and device == "cuda":
        bw = copy_bandwidth()
        out["copy_bw_Bps"] = bw
        active = moe_bytes["active_weight_bytes"]
        out["decode_bw_moe"] = r = decode_bandwidth(core, 1, args.bw_ctx, bw, weight_bytes=active)
        r["total_weight_bytes"] = moe_bytes["total_weight_bytes"]
        print(f"[{name}] decode b=1: {r['engine_step_ms']:.3f} ms/step engine, "
              f"{r['graph_replay_ms']:.3f} ms replay; util {r['util_engine']:.0%} / "
              f"{r['util_graph']:.0%}", flush=True)  # fmt: skip
    del core, pool, model, runner
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_peer:
        peer_vs(out, hf, prompts[:n_peer], outs[:n_peer], device, name)
    del hf, state
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    for k in ("ours", "ours_at_peer_requests", "peer"):
        if k in out:
            out[k].pop("first_tokens", None)
    return out


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"# Cloud engine throughput ({meta['device_name']})",
        "",
        *([f"Note: {meta['note']}.", ""] if meta.get("note") else []),
        f"Command: `{meta['command']}`",
        "",
        *(
            f"- Workload {r['model']}: {r['requests']} requests, {r['prompt_tokens']} prompt tokens, "
            f"outputs {r['output_len'][0]}-{r['output_len'][1]} tokens (greedy, EOS ignored); "
            f"peer: transformers {meta.get('transformers', '-')} ({r.get('peer', {}).get('mode', '-')})."
            for r in results
        ),
        "",
        "| model | requests | ours tok/s | ours without overlap | peer requests | ours tok/s at peer's requests | peer tok/s | speedup (same requests) | ours start-up s | KV waste at peak | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        o, p = r["ours"], r.get("peer")
        sync_tok_s = f"{r['ours_no_overlap']['tok_s']:.0f}" if "ours_no_overlap" in r else "-"
        same = r.get("ours_at_peer_requests", o)
        peer = (
            f"{p.get('requests', r['requests'])} | {same['tok_s']:.0f} | {p['tok_s']:.0f} | {r['speedup']:.1f}x"
            if p
            else "- | - | - | -"
        )
        lines.append(
            f"| {r['model']} | {r['requests']} | {o['tok_s']:.0f} | {sync_tok_s} | {peer} | {o['startup_s']:.1f} | {o['kv_waste_at_peak']:.2%} | {o['preemptions']} |"
        )
    moe = [r for r in results if "decode_bw_moe" in r]
    if moe:
        lines += [
            "",
            "MoE batch-1 decode: bytes read per step = non-expert weights + top-k experts of every layer + KV.",
            "",
            "| model | ctx | weights (all) | read per step | engine ms/step | util (engine) | without overlap | graph replay ms | util (replay) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in moe:
            d = r["decode_bw_moe"]
            lines.append(
                f"| {r['model']} | {d['ctx']} | {d['total_weight_bytes'] / 1e9:.1f} GB | {(d['weight_bytes'] + d['kv_bytes']) / 1e9:.2f} GB | {d['engine_step_ms']:.3f} | {d['util_engine']:.0%} | {d['engine_step_ms_no_overlap']:.3f} | {d['graph_replay_ms']:.3f} | {d['util_graph']:.0%} |"
            )
    if any("decode_bw" in r for r in results):  # dense shapes
        lines += [
            "",
            "Decode memory-bandwidth utilization: (weights + KV bytes read per step) / step time / copy bandwidth.",
            "",
            "| model | batch | ctx | bytes/step | engine ms/step | util (engine) | without overlap | util | graph replay ms | util (replay) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            for d in r.get("decode_bw", []):
                lines.append(
                    f"| {r['model']} | {d['batch']} | {d['ctx']} | {(d['weight_bytes'] + d['kv_bytes']) / 1e9:.2f} GB | {d['engine_step_ms']:.3f} | {d['util_engine']:.0%} | {d['engine_step_ms_no_overlap']:.3f} | {d['util_engine_no_overlap']:.0%} | {d['graph_replay_ms']:.3f} | {d['util_graph']:.0%} |"
                )
        bws = {r["model"]: r["copy_bw_Bps"] for r in results if r.get("copy_bw_Bps")}
        lines += [
            "",
            "Copy bandwidth (read + write): "
            + ", ".join(f"{v / 1e12:.2f} TB/s" for v in bws.values()),
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--kv-pressure" in sys.argv:  # the compressed-KV workloads (bench/kv_pressure.py)
        from bench.kv_pressure import main as kv_pressure

        sys.argv.remove("--kv-pressure")
        kv_pressure()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--shapes",
        default=None,
        help="random models of these shapes (CUDA default: qwen3-0.6b,llama-3.2-1b); "
        f"dense: {','.join(SHAPES)}; MoE: {','.join(MOE_SHAPES)}",
    )
    ap.add_argument(
        "--peer-requests",
        type=int,
        default=None,
        help="the peer runs only the first N requests (too slow for all); ours runs them too",
    )
    ap.add_argument(
        "--model", default=None, help="CPU: model name or folder (default: the default model)"
    )
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--prompt-min", type=int, default=100)
    ap.add_argument("--prompt-max", type=int, default=None)
    ap.add_argument("--out-min", type=int, default=None)
    ap.add_argument("--out-max", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=None)
    ap.add_argument("--max-tokens-per-step", type=int, default=None)
    ap.add_argument("--kv-fraction", type=float, default=0.5)
    ap.add_argument("--kv-bytes", type=int, default=2 * 2**30)
    ap.add_argument("--bw-ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-bw", action="store_true")
    ap.add_argument(
        "--no-moe-pairs", action="store_true", help="MoE decode: the grouped kernel at any batch"
    )
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--device-kind", default=None, help="recorded in the JSON (e.g. nvidia-h200)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.requests = args.requests or (256 if cuda else 64)
    args.prompt_max = args.prompt_max or (1024 if cuda else 1000)
    args.out_min = args.out_min or (256 if cuda else 32)
    args.max_running = args.max_running or (256 if cuda else 64)

    meta = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "command": recorded_command("cloud_throughput.py", sys.argv[1:], ("--out-dir",)),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "weights": "random" if cuda or args.shapes else "real",
    }
    if args.device_kind:
        meta["device_kind"] = args.device_kind
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        args.skip_peer = True
    tag = args.tag or ("h200" if cuda and "H200" in meta["device_name"] else args.device)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []

    def save() -> str:  # after every model, so a cut-short run keeps what it measured
        (out_dir / f"cloud_throughput_{tag}.json").write_text(
            json.dumps({"meta": meta, "results": results}, indent=2)
        )
        md = markdown(results, meta)
        (out_dir / f"cloud_throughput_{tag}.md").write_text(md)
        return md

    if cuda or args.shapes:
        for name in (args.shapes or "qwen3-0.6b,llama-3.2-1b").split(","):
            if name in MOE_SHAPES:
                results.append(bench_moe(name, MOE_SHAPES[name], args))
            else:
                cfg = ModelConfig.from_dict(dict(SHAPES[name]))
                results.append(bench_model(name, cfg, args, None))
            md = save()
    else:
        from routing.model_store import DEFAULT_MODEL, resolve

        info = resolve(args.model or DEFAULT_MODEL)
        results.append(
            bench_model(info.name, ModelConfig.from_folder(info.path), args, Path(info.path))
        )
        md = save()
    print(md)


if __name__ == "__main__":
    main()
