"""Time the grouped MoE kernel (``cloud_engine.kernels.moe``) on the Qwen3-30B-A3B layer shape
against SparseMoE's eager loop; bytes counted are the routed experts' weights (distinct experts
hit) plus activations. Usage: ``python bench/moe_kernel.py [--out FILE]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cloud_engine.kernels.moe import moe_forward, route
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="1,4,16,64,256,1024")
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
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = dict(device=torch.cuda.get_device_name(), copy_bw_Bps=copy_bw, layer_rows=rows)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
