"""Where a batch-1 decode layer's time goes on CUDA, kernel by kernel, against the bandwidth limit.

    python bench/decode_kernels.py --shapes qwen3-0.6b,llama-3.2-1b --ctx 564,2048

Two tables, each timed as CUDA-graph replays of chains over a model's distinct layer weights
(as many as it has layers, so weights come from memory, not L2):

- products: each skinny product of a layer (qkv with its input norm, o with the residual add,
  gate|up with norm and SwiGLU, down with the residual add) through our GEMV kernels with and
  without PDL, against cuBLAS's ``F.linear`` (the peer: the product alone, no norm or epilogue);
  the ``floor`` row is a chain of 1-row products of 8 rows, the fixed cost of one kernel;
- layers: whole decoder layers (the four products and the fused decode attention) at each
  context length, the same without the attention (its marginal cost), and the layer's bandwidth
  limit (its weight and KV bytes over the measured copy bandwidth).

Random bf16 weights of the model's shapes; one sequence. Writes ``decode_kernels.md`` and
``.json`` to ``--out`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, cuda_ms, recorded_command, table
from bench.cloud_throughput import SHAPES, copy_bandwidth
from cloud_engine.kernels import decode_attention, gemv, pdl
from cloud_engine.model.config import ModelConfig

BF16 = torch.bfloat16


def replay_us(fn: Callable[[], None], reps: int = 30) -> float:
    """Median device time of one replay of ``fn`` captured as a CUDA graph, in microseconds."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    return cuda_ms(g.replay, reps) * 1e3


class Layers:
    """Distinct random weights of every layer of ``cfg``, one sequence's paged KV of ``ctx``
    tokens per layer, and the step inputs of its next token."""

    def __init__(self, cfg: ModelConfig, ctx: int) -> None:
        h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.L = cfg.num_hidden_layers

        def w(rows: int, cols: int) -> list[torch.Tensor]:
            return [torch.randn(rows, cols, device="cuda", dtype=BF16) / 30 for _ in range(self.L)]

        self.qkv = w((self.hq + 2 * self.hkv) * d, h)
        self.o, self.gate_up, self.down = w(h, self.hq * d), w(2 * f, h), w(h, f)
        self.norm = torch.ones(h, device="cuda", dtype=BF16)
        self.qk_norm = torch.ones(d, device="cuda", dtype=BF16) if cfg.qk_norm else None
        blocks = ctx // 16 + 2
        self.kv = [
            (
                torch.randn(blocks, 16, self.hkv, d, device="cuda", dtype=BF16),
                torch.randn(blocks, 16, self.hkv, d, device="cuda", dtype=BF16),
            )
            for _ in range(self.L)
        ]

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, device="cuda", dtype=torch.int32)

        self.pos, self.slot, self.lens = i32([ctx - 1]), i32([ctx - 1]), i32([ctx])
        self.rows = i32([0])
        self.tables = torch.arange(blocks, device="cuda", dtype=torch.int32)[None]
        self.cos_sin = torch.randn(ctx + 1, d, device="cuda")
        self.residual = torch.randn(1, h, device="cuda", dtype=BF16)
        self.ctx = ctx

    def layer_bytes(self) -> int:
        w = sum(t[0].numel() for t in (self.qkv, self.o, self.gate_up, self.down)) * 2
        return w + 2 * self.ctx * self.hkv * self.d * 2

    def attention(self, i: int, qkv: torch.Tensor) -> torch.Tensor:
        kc, vc = self.kv[i]
        return decode_attention.decode_attention(
            qkv, self.pos, self.cos_sin, self.qk_norm, self.qk_norm, 1e-6, self.hq, kc, vc,
            None, None, self.slot, self.tables, self.rows, self.lens,
        )  # fmt: skip

    def chain(self, attention: bool) -> Callable[[], None]:
        res = self.residual

        def run() -> None:
            for i in range(self.L):
                qkv = gemv.linear(res, self.qkv[i], norm=self.norm, eps=1e-6)
                if attention:
                    o = self.attention(i, qkv).view(1, -1)
                else:
                    o = qkv[:, : self.hq * self.d]
                gemv.linear_residual(o, self.o[i], res)
                act = gemv.silu_linear(res, self.gate_up[i], self.norm, 1e-6)
                gemv.linear_residual(act, self.down[i], res)

        return run


def each(ws: list[torch.Tensor], op: Callable[[torch.Tensor], object]) -> Callable[[], None]:
    def run() -> None:
        for w in ws:
            op(w)

    return run


def products(name: str, lay: Layers, copy_bw: float) -> list[dict[str, Any]]:
    x = lay.residual
    act = torch.randn(1, lay.down[0].shape[1], device="cuda", dtype=BF16)
    att = torch.randn(1, lay.o[0].shape[1], device="cuda", dtype=BF16)
    tiny = [torch.randn(8, x.shape[1], device="cuda", dtype=BF16) for _ in range(lay.L)]
    cases: dict[str, tuple[list[torch.Tensor], Callable[[torch.Tensor], object], torch.Tensor]] = {
        "qkv (norm)": (lay.qkv, lambda w: gemv.linear(x, w, norm=lay.norm, eps=1e-6), x),
        "o (+residual)": (lay.o, lambda w: gemv.linear_residual(att, w, x), att),
        "gate_up (norm, SwiGLU)": (
            lay.gate_up,
            lambda w: gemv.silu_linear(x, w, lay.norm, 1e-6),
            x,
        ),
        "down (+residual)": (lay.down, lambda w: gemv.linear_residual(act, w, x), act),
        "floor (8 rows)": (tiny, lambda w: gemv.linear(x, w), x),
    }
    rows = []
    for case, (ws, ours, inp) in cases.items():
        per = {}
        for on in (True, False):
            pdl.set_enabled(on)
            per[on] = replay_us(each(ws, ours)) / lay.L
        pdl.set_enabled(True)
        cublas = replay_us(each(ws, lambda w, inp=inp: F.linear(inp, w))) / lay.L
        mb = ws[0].numel() * 2 / 1e6
        rows.append(
            {
                "model": name,
                "product": case,
                "MB": round(mb, 1),
                "limit us": mb * 1e12 / copy_bw,
                "ours us": per[True],
                "ours TB/s": mb / per[True],
                "ours no-PDL us": per[False],
                "cuBLAS us": cublas,
                "cuBLAS TB/s": mb / cublas,
                "cuBLAS / ours": cublas / per[True],
            }
        )
        print(rows[-1], flush=True)
    return rows


def layers(name: str, cfg: ModelConfig, ctxs: list[int], copy_bw: float) -> list[dict[str, Any]]:
    rows = []
    for ctx in ctxs:
        lay = Layers(cfg, ctx)
        full = replay_us(lay.chain(True)) / lay.L
        bare = replay_us(lay.chain(False)) / lay.L
        limit = lay.layer_bytes() / copy_bw * 1e6
        rows.append(
            {
                "model": name,
                "ctx": ctx,
                "layer us": full,
                "without attention us": bare,
                "attention adds us": full - bare,
                "limit us": limit,
                "util": f"{limit / full:.0%}",
            }
        )
        print(rows[-1], flush=True)
        del lay
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,llama-3.2-1b")
    ap.add_argument("--ctx", default="564,2048")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    copy_bw = copy_bandwidth()
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bw_TBps": round(copy_bw / 1e12, 3),
        "command": recorded_command("decode_kernels.py", sys.argv[1:], ("--out",)),
    }
    prod_rows: list[dict[str, Any]] = []
    layer_rows: list[dict[str, Any]] = []
    for name in args.shapes.split(","):
        cfg = ModelConfig.from_dict(dict(SHAPES[name]))
        prod_rows += products(name, Layers(cfg, 64), copy_bw)
        torch.cuda.empty_cache()
        layer_rows += layers(name, cfg, [int(c) for c in args.ctx.split(",")], copy_bw)
    md = "\n".join(
        [
            f"# Batch-1 decode kernels ({meta['device']})",
            "",
            f"Command: `{meta['command']}`; copy bandwidth {meta['copy_bw_TBps']} TB/s.",
            "",
            "## Products (per kernel, over distinct layer weights)",
            "",
            table(prod_rows, list(prod_rows[0])),
            "",
            "## Layers (per layer)",
            "",
            table(layer_rows, list(layer_rows[0])),
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode_kernels"
    (out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "products": prod_rows, "layers": layer_rows}, indent=1)
    )
    (out / f"{stem}.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
