"""Time the grouped MoE kernel (``cloud_engine.kernels.moe``) on the Qwen3-30B-A3B layer shape
against SparseMoE's eager loop, and, at decode sizes, the grouped path against the pair kernels
(``cloud_engine.kernels.moe_decode``), both from the residual stream (norm, routing, experts,
residual add) and replayed from CUDA graphs as the engine runs them; bytes counted are the
routed experts' weights (distinct experts hit) plus activations. The crossover sets
``moe_decode.MAX_TOKENS``. Usage: ``python bench/moe_kernel.py [--out FILE]`` (default
``bench/results/moe_kernel.json``, and ``.md`` beside it)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, table
from cloud_engine.kernels import norm as norm_kernels
from cloud_engine.kernels.moe import moe_forward, route
from cloud_engine.kernels.moe_decode import moe_residual
from cloud_engine.parallel.moe import MoEConfig, SparseMoE

H, INTER, E, K = 2048, 768, 128, 8


def cuda_time(fn, iters: int = 50) -> float:  # type: ignore[no-untyped-def]
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters / 1e3


def graph_time(fn, iters: int = 50) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call of ``fn`` replayed from a CUDA graph (warmed up eagerly first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return cuda_time(g.replay, iters)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULTS / "moe_kernel.json")
    ap.add_argument("--tokens", default="1,2,4,8,16,64,256,1024")
    ap.add_argument("--pair-tokens", type=int, default=8, help="time the pair kernels up to here")
    args = ap.parse_args()
    torch.manual_seed(0)
    # several layers' worth of weights so the timed loop is not served from L2
    layers = 8
    ws = [
        (
            (torch.randn(E, H, device="cuda") / H**0.5).bfloat16(),
            (torch.randn(E, 2 * INTER, H, device="cuda") / H**0.5).bfloat16(),
            (torch.randn(E, H, INTER, device="cuda") / INTER**0.5).bfloat16(),
        )
        for _ in range(layers)
    ]
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = cuda_time(lambda: dst.copy_(src), 20)
    copy_bw = 2 * src.numel() / copy_s
    rows = []
    for t in map(int, args.tokens.split(",")):
        h = torch.randn(t, H, device="cuda").bfloat16()
        distinct = []
        for r, _gu, _d in ws:
            _, idx = route(h, r, K, True)
            distinct.append(int(torch.unique(idx).numel()))

        def kern(h: torch.Tensor = h) -> None:
            for r, gu, d in ws:
                moe_forward(h, r, gu, d, K, True)

        moes = []
        for r, gu, d in ws:
            m = object.__new__(SparseMoE)
            m.cfg = MoEConfig(num_experts=E, top_k=K, intermediate=INTER, norm_topk=True)
            m.e0, m.e1, m.router, m.w_gate_up, m.w_down, m.shared = 0, E, r, gu, d, None
            m.use_kernel = False
            moes.append(m)

        def eager(h: torch.Tensor = h, moes: list = moes) -> None:
            for m in moes:
                m(h)

        ks = cuda_time(kern) / layers
        graphs: dict[str, float] = {}
        if t <= args.pair_tokens:
            residual = torch.randn(t, H, device="cuda").bfloat16()
            nw = torch.ones(H, device="cuda").bfloat16()

            def grouped_layers(res: torch.Tensor = residual, nw: torch.Tensor = nw) -> None:
                for r, gu, d in ws:
                    x, _ = norm_kernels.add_rmsnorm(res, None, nw, 1e-6)
                    res.add_(moe_forward(x, r, gu, d, K, True))

            def pair_layers(res: torch.Tensor = residual, nw: torch.Tensor = nw) -> None:
                for r, gu, d in ws:
                    moe_residual(res, nw, 1e-6, r, gu, d, K, True)

            graphs = {
                "grouped_graph_us": graph_time(grouped_layers) / layers * 1e6,
                "pairs_graph_us": graph_time(pair_layers) / layers * 1e6,
            }
        es = cuda_time(eager, 10) / layers
        per_expert = 3 * H * INTER * 2
        nbytes = sum(distinct) / layers * per_expert + E * H * 2 + t * H * 2 * 2
        row = dict(
            tokens=t,
            distinct_experts=sum(distinct) / layers,
            kernel_us=ks * 1e6,
            eager_us=es * 1e6,
            speedup=es / ks,
            bytes=nbytes,
            kernel_bw_util=nbytes / ks / copy_bw,
            **graphs,
        )
        if graphs:  # pairs read an expert once per token that picks it
            pair_bytes = t * K * per_expert + E * H * 2 + t * H * 2 * 2
            row["pairs_bw_util"] = pair_bytes / (graphs["pairs_graph_us"] / 1e6) / copy_bw
            row["grouped_graph_bw_util"] = nbytes / (graphs["grouped_graph_us"] / 1e6) / copy_bw
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = dict(device=torch.cuda.get_device_name(), copy_bw_Bps=copy_bw, layer_rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    args.out.with_suffix(".md").write_text(markdown(res))


def markdown(res: dict) -> str:
    """The layer rows as a table, times in microseconds."""
    rows = res["layer_rows"]
    cols = [c for c in rows[0] if c != "bytes"] if rows else []
    return (
        f"# moe_kernel ({res['device']}, copy bandwidth {res['copy_bw_Bps'] / 1e12:.2f} TB/s)"
        f"\n\n{table(rows, cols)}\n"
    )


if __name__ == "__main__":
    main()
