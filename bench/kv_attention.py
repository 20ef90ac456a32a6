"""The general paged-attention kernel's decode step over 8-bit KV against bf16 KV (CUDA).

At batch ``--batch`` with ``--ctx``-token contexts (defaults 32 x 8,192, the Llama-3.1-8B KV
shape: 8 KV heads of 128, 32 query heads), one layer's attention alone: the kernel as launched
today and with other launch settings (warps, pipeline stages, keys per iteration), for bf16
(the peer: same kernel, same run), fp8 e4m3 and int8 pools; and an fp8 read that skips the
format conversion: an e4m3 byte shifted into an fp16's bits is the value times 2**-8, exactly
(subnormals too), so keys and values enter fp16 products and the 2**8 joins each token's
scale. Reported: device time (median of CUDA-event timings), bytes read per second, and the
fp8-as-fp16 kernel's largest error against the dequantized cache in float32.

    python bench/kv_attention.py [--batch 32] [--ctx 8192]

Writes bench/results/kv_attention.json and .md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import cuda_ms, machine, recorded_command, table, write_results
from cloud_engine.kernels import attention as A
from cloud_engine.kv_quant import FP8

HKV, HQ, D, BS = 8, 32, 128, 16
LAUNCHES = [(4, 2, 64), (4, 3, 64), (4, 4, 64), (8, 2, 64), (8, 3, 64), (4, 3, 128), (8, 3, 128)]
TODAY = (4, 2, 64)  # attention.paged_attention's num_warps, num_stages and tile_shape's block_n


@triton.jit
def _fp8_as_fp16_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_tr,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
    D: tl.constexpr, SPLITS: tl.constexpr, HQ: tl.constexpr,
):  # fmt: skip
    """Decode attention of sequence ``program_id(0)``, kv head ``program_id(1)``, split
    ``program_id(2)`` over an fp8 cache read as raw bytes; partial outputs as the general
    kernel's splits write them."""
    s = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + s)
    g = tl.arange(0, G_PAD)
    valid = g < G
    head = kvh * G + g
    offs_d = tl.arange(0, D)
    qp = q_ptr + s * HQ * D + head[:, None] * D + offs_d[None, :]
    q = tl.load(qp, mask=valid[:, None], other=0.0).to(tl.float16)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    chunk = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(ctx, lo + chunk)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        blk = tl.load(tables_ptr + s * stride_tr + offs_n // BS, mask=n_ok, other=0).to(tl.int64)
        so = blk * stride_cb + (offs_n % BS) * stride_ct + kvh * stride_ch
        kr = tl.load(k_ptr + so[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0)
        vr = tl.load(v_ptr + so[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0)
        kr = kr.to(tl.uint16)
        vr = vr.to(tl.uint16)
        k = (((kr & 0x80) << 8) | ((kr & 0x7F) << 7)).to(tl.float16, bitcast=True)
        v = (((vr & 0x80) << 8) | ((vr & 0x7F) << 7)).to(tl.float16, bitcast=True)
        sc_off = blk * stride_sb + (offs_n % BS) * stride_st + kvh
        ks = tl.load(ks_ptr + sc_off, mask=n_ok, other=0.0) * 256.0
        vs = tl.load(vs_ptr + sc_off, mask=n_ok, other=0.0) * 256.0
        scores = tl.dot(q, tl.trans(k)) * ks[None, :] * qk_scale
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(tl.float16), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
    part = (s * HQ + head) * SPLITS + split
    tl.store(part_o_ptr + part[:, None] * D + offs_d[None, :], out, mask=valid[:, None])
    tl.store(part_lse_ptr + part, lse, mask=valid)


class Case:
    """One pool of ``kv`` format at batch x ctx with random contents, and the step's inputs."""

    def __init__(self, kv: str, batch: int, ctx: int, seed: int = 0) -> None:
        i32: dict[str, Any] = {"dtype": torch.int32, "device": "cuda"}
        g = torch.Generator(device="cuda").manual_seed(seed)
        nb = -(-ctx // BS)
        self.batch, self.ctx, self.kv = batch, ctx, kv
        self.tables = torch.arange(batch * nb, **i32).view(batch, nb)
        self.q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        self.seq_lens = torch.full((batch,), ctx, **i32)
        x = torch.randn(batch * nb, BS, HKV, D, device="cuda", generator=g)
        dt = {"bf16": torch.bfloat16, "fp8": FP8, "int8": torch.int8}[kv]
        self.k = (x * 40).round().clamp(-127, 127).to(dt) if kv == "int8" else x.to(dt)
        self.v = self.k.flip(0)
        del x
        self.scaled = kv != "bf16"
        shape = (batch * nb, BS, HKV)
        self.ks = torch.rand(shape, device="cuda", generator=g) * 0.02 + 0.01
        self.vs = torch.rand(shape, device="cuda", generator=g) * 0.02 + 0.01
        self.splits = A.decode_splits(batch * HKV)
        self.part_o = torch.empty((batch, HQ, self.splits, D), device="cuda")
        self.part_lse = torch.empty((batch, HQ, self.splits), device="cuda")
        self.out = torch.empty_like(self.q)

    def bytes_read(self) -> int:
        kv = 2 * self.k.numel() * self.k.element_size()
        return kv + (2 * self.ks.numel() * 4 if self.scaled else 0)

    def general(self, warps: int, stages: int, block_n: int) -> None:
        """The general kernel (``attention._paged_attention_kernel``) with these settings."""
        ar = torch.arange(self.batch + 1, dtype=torch.int32, device="cuda")
        zeros = torch.zeros(self.batch, dtype=torch.int32, device="cuda")
        k, ks, q = self.k, self.ks, self.q
        A._paged_attention_kernel[(self.batch, HKV, self.splits)](
            q, self.out, k, self.v, ks if self.scaled else q, self.vs if self.scaled else q,
            self.tables, ar[:-1], self.seq_lens, ar, ar[:-1], zeros, self.part_o,
            self.part_lse, (1 / math.sqrt(D)) * 1.4426950408889634, q.stride(0), q.stride(1),
            self.out.stride(0), self.out.stride(1), k.stride(0), k.stride(1), k.stride(2),
            ks.stride(0), ks.stride(1), self.tables.stride(0), G=HQ // HKV, G_PAD=16,
            BLOCK_Q=1, BLOCK_N=block_n, BS=BS, D=D, SCALED=self.scaled, IEEE=False,
            SPLITS=self.splits, HQ=HQ, PDL=False, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    def fp8_as_fp16(self, warps: int, stages: int, block_n: int) -> None:
        k = self.k
        _fp8_as_fp16_kernel[(self.batch, HKV, self.splits)](
            self.q, k.view(torch.uint8), self.v.view(torch.uint8), self.ks, self.vs,
            self.tables, self.seq_lens, self.part_o, self.part_lse,
            (1 / math.sqrt(D)) * 1.4426950408889634, k.stride(0), k.stride(1), k.stride(2),
            self.ks.stride(0), self.ks.stride(1), self.tables.stride(0), G=HQ // HKV,
            G_PAD=16, BLOCK_N=block_n, BS=BS, D=D, SPLITS=self.splits, HQ=HQ,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip

    def error(self, rows: int = 2) -> float:
        """Largest |output - reference| over |reference|'s largest, the first ``rows``
        sequences, after the split merge; the reference dequantizes in float32."""
        A.combine_splits(self.part_o, self.part_lse, self.out, self.batch)
        worst = 0.0
        for b in range(rows):
            blk = self.tables[b].long()
            k = (self.k[blk].float() * self.ks[blk][..., None]).reshape(-1, HKV, D)[: self.ctx]
            v = (self.v[blk].float() * self.vs[blk][..., None]).reshape(-1, HKV, D)[: self.ctx]
            q = self.q[b].float().view(HKV, HQ // HKV, D)
            w = torch.softmax(torch.einsum("hgd,nhd->hgn", q, k) / math.sqrt(D), -1)
            ref = torch.einsum("hgn,nhd->hgd", w, v).reshape(HQ, D)
            err = (self.out[b].float() - ref).abs().max() / ref.abs().max()
            worst = max(worst, float(err))
        return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    base: float | None = None
    for kv in ("bf16", "fp8", "int8"):
        case = Case(kv, args.batch, args.ctx)
        kernels = [("general", case.general)]
        if kv == "fp8":
            kernels.append(("fp8-as-fp16", case.fp8_as_fp16))
        for name, fn in kernels:
            for warps, stages, block_n in LAUNCHES:
                launch = f"{warps}w {stages}s {block_n}n" + (
                    " (today)" if (warps, stages, block_n) == TODAY and name == "general" else ""
                )
                try:
                    ms = cuda_ms(lambda: fn(warps, stages, block_n), args.reps)  # noqa: B023
                except Exception as exc:  # a launch the compiler refuses (shared memory)
                    print(f"{kv} {name} {launch}: {type(exc).__name__}", flush=True)
                    continue
                base = ms if base is None else base
                row = {"kv": kv, "kernel": name, "launch": launch, "ms": ms,
                       "vs_bf16_today": base / ms, "GB_per_s": case.bytes_read() / ms / 1e6}  # fmt: skip
                if name == "fp8-as-fp16":
                    row["max_rel_err"] = case.error()
                rows.append(row)
                print(row, flush=True)
        del case
        torch.cuda.empty_cache()
    command = recorded_command("kv_attention.py", sys.argv[1:], ())
    md = "\n\n".join([
        f"# 8-bit KV through the paged-attention kernel ({torch.cuda.get_device_name()})",
        f"`{command}`: batch {args.batch}, {args.ctx}-token contexts, one layer "
        f"(8 KV heads of {D}); vs_bf16_today: bf16's time with today's launch over this row's.",
        table(rows, ["kv", "kernel", "launch", "ms", "vs_bf16_today", "GB_per_s", "max_rel_err"]),
    ])  # fmt: skip
    write_results("kv_attention", {"command": command, "machine": machine(), "rows": rows}, md)


if __name__ == "__main__":
    main()
