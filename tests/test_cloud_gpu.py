"""The CUDA path: Triton kernels against the torch ops, and the engine against dense.

Marked ``gpu`` (run on the device machine). With ``TRITON_INTERPRET=1`` and Triton installed,
the kernel tests also run on CPU tensors: ``TRITON_INTERPRET=1 pytest -m gpu -k kernel``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from cloud_engine.attention_torch import make_meta, paged_attention, store_kv
from cloud_engine.kernels import triton_available
from cloud_engine.kernels.tiling import make_tiles, tile_shape
from cloud_engine.kv_pool import KVPool, KVSpec
from cloud_engine.model.config import ModelConfig
from cloud_engine.model.dense import generate
from cloud_engine.model.llama import LlamaForCausalLM
from routing.engine import GenerationRequest, SamplingParams

pytestmark = pytest.mark.gpu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    not triton_available() or not (torch.cuda.is_available() or INTERPRET),
    reason="needs Triton and CUDA (or TRITON_INTERPRET=1)",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# KV storage: the model's dtype, int8 and fp8 e4m3 (both with a scale per token and head)
KV_STORAGE = {"plain": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def ragged_case(
    hq: int, hkv: int, d: int, dtype: torch.dtype, kv: str, seed: int, decode_only: bool = False
) -> tuple[KVPool, torch.Tensor, dict[str, object]]:
    """A pool with random history for 5 sequences, plus this step's q/k/v: 3 decodes and 2
    prefill chunks (one on top of a cached prefix)."""
    g = torch.Generator().manual_seed(seed)
    spec = KVSpec(1, hkv, d, dtype, storage=KV_STORAGE[kv])
    pool = KVPool(spec, 64, DEV)
    q_lens = [1] * 5 if decode_only else [1, 1, 37, 1, 70]
    ctx = [50, 17, 37, 130, 90]  # KV length after the step
    rng = random.Random(seed)
    blocks = list(range(64))
    rng.shuffle(blocks)
    tables, slots_hist, slots_now = [], [], []
    for ql, c in zip(q_lens, ctx, strict=True):
        nb = -(-c // 16)
        t = [blocks.pop() for _ in range(nb)]
        tables.append(t)
        sl = [t[p // 16] * 16 + p % 16 for p in range(c)]
        slots_hist += sl[: c - ql]
        slots_now += sl[c - ql :]
    hist = torch.tensor(slots_hist, device=DEV)
    kh = torch.randn(len(slots_hist), hkv, d, generator=g).to(DEV, dtype)
    vh = torch.randn(len(slots_hist), hkv, d, generator=g).to(DEV, dtype)
    store_kv(pool, 0, kh, vh, hist)
    n = sum(q_lens)
    q = torch.randn(n, hq, d, generator=g).to(DEV, dtype)
    k = torch.randn(n, hkv, d, generator=g).to(DEV, dtype)
    v = torch.randn(n, hkv, d, generator=g).to(DEV, dtype)
    width = max(map(len, tables))
    tab = torch.zeros(len(tables), width, dtype=torch.int64)
    for i, t in enumerate(tables):
        tab[i, : len(t)] = torch.tensor(t)
    q_start = [0]
    for ql in q_lens:
        q_start.append(q_start[-1] + ql)
    return pool, q, {
        "k": k, "v": v, "slots": torch.tensor(slots_now, device=DEV), "tables": tab.to(DEV),
        "q_start": q_start, "ctx": ctx,
    }  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", list(KV_STORAGE))
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 16), (16, 8, 128), (32, 8, 64)])
@pytest.mark.parametrize("decode_only", [False, True])
def test_kernel_paged_attention_matches_torch(
    hq: int, hkv: int, d: int, dtype: torch.dtype, kv: str, decode_only: bool
) -> None:
    """Against the torch reference reading the same pool (the same stored values): the
    kernel's scaling of score and probability columns equals dequantizing the tiles, up to
    the rounding of q's dtype."""
    if INTERPRET and (d > 16 or dtype != torch.float32):
        pytest.skip("interpreter: small float32 shapes only (its bf16 dot is wrong)")
    from cloud_engine.kernels.attention import paged_attention as triton_attention

    pool, q, c = ragged_case(hq, hkv, d, dtype, kv, seed=hq + d, decode_only=decode_only)
    store_kv(pool, 0, c["k"], c["v"], c["slots"])  # type: ignore[arg-type]
    meta = make_meta(c["slots"], c["tables"], c["q_start"], c["ctx"])  # type: ignore[arg-type]
    ref = paged_attention(pool, 0, q.float(), meta)
    kc, vc, ks, vs = pool.layer(0)
    i32 = {"dtype": torch.int32, "device": DEV}
    q_start = torch.tensor(c["q_start"], **i32)  # type: ignore[arg-type]
    for max_q in (1,) if decode_only else (70,):
        shape = tile_shape(hq // hkv, max_q)
        ts, tq = make_tiles(q_start.cpu().numpy(), shape.block_q)
        out = triton_attention(
            q, kc, vc, ks, vs, c["tables"].to(torch.int32), torch.arange(5, **i32),  # type: ignore[union-attr]
            torch.tensor(c["ctx"], **i32), q_start, torch.from_numpy(ts).to(DEV), torch.from_numpy(tq).to(DEV), shape,  # type: ignore[arg-type]
        )  # fmt: skip
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        assert rel_err(out, ref) < tol


@needs_kernels
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("kv", list(KV_STORAGE))
def test_kernel_rope_store_and_norms_match_torch(qk_norm: bool, kv: str) -> None:
    from cloud_engine.model.fused import AttnInputs, FusedLlama
    from cloud_engine.model.loader import tiny_config
    from cloud_engine.model.torch_ops import TorchOps
    from cloud_engine.model.triton_ops import TritonOps

    cfg = tiny_config(qk_norm=qk_norm, model_type="qwen3" if qk_norm else "llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(DEV)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    spec = KVSpec(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
        storage=KV_STORAGE[kv],
    )  # fmt: skip
    pools = [KVPool(spec, 8, DEV) for _ in range(2)]
    fms = [FusedLlama(model, pools[0], TorchOps()), FusedLlama(model, pools[1], TritonOps())]
    n = 20
    qkv = torch.randn(
        n, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, device=DEV
    )
    pos = torch.randint(0, 500, (n,), device=DEV, dtype=torch.int32)
    slots = torch.randperm(128, device=DEV)[:n].to(torch.int32)
    slots[3] = -1
    a = AttnInputs(slots, None, None, None, None, None, None, None)  # type: ignore[arg-type]
    q0 = fms[0].ops.qk_rope_store(fms[0], 1, qkv, pos, a)
    q1 = fms[1].ops.qk_rope_store(fms[1], 1, qkv, pos, a)
    assert rel_err(q1, q0) < 1e-5
    d0, d1 = pools[0].data[1].float(), pools[1].data[1].float()
    if kv == "int8":
        assert (d0 - d1).abs().max() <= 1  # rounding ties may differ by one step
        assert rel_err(pools[1].scales[1], pools[0].scales[1]) < 1e-5  # type: ignore[index]
    elif kv == "fp8":  # at most one e4m3 step apart (2**-3 of the magnitude) where ties differ
        # (the interpreter's e4m3 conversion drops a value just below a power of two a whole
        # binade: 14 of 8,192 here; the GPU's conversion rounds to nearest)
        assert INTERPRET or ((d0 - d1).abs() <= d0.abs() / 8 + 2**-9).all()
        assert (d0 != d1).float().mean() < 0.01
        assert rel_err(pools[1].scales[1], pools[0].scales[1]) < 1e-5  # type: ignore[index]
    else:
        assert rel_err(d1, d0) < 1e-5
    x, r = torch.randn(n, cfg.hidden_size, device=DEV), torch.randn(n, cfg.hidden_size, device=DEV)
    w = torch.rand(cfg.hidden_size, device=DEV)
    o0, r0 = TorchOps().add_rmsnorm(x, r.clone(), w, 1e-5)
    o1, r1 = TritonOps().add_rmsnorm(x, r.clone(), w, 1e-5)
    assert rel_err(o1, o0) < 1e-5 and rel_err(r1, r0) < 1e-6
    gu = torch.randn(n, 2 * cfg.intermediate_size, device=DEV)
    assert rel_err(TritonOps().silu_mul(gu), TorchOps().silu_mul(gu)) < 1e-5


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("bn", [None, 16])
def test_kernel_gemv_matches_torch(m: int, dtype: torch.dtype, bn: int | None) -> None:
    if INTERPRET and dtype != torch.float32:
        pytest.skip("interpreter: float32 only (its bf16 rounding is not the GPU's)")
    from cloud_engine.kernels import gemv
    from cloud_engine.model.torch_ops import TorchOps

    g = torch.Generator().manual_seed(m)
    k, n = 48, 40  # K pads to 64; with bn=16 the last program masks rows

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DEV, dtype)

    x, w, bias, norm, gate_up, res = rnd(m, k), rnd(n, k), rnd(n), rnd(k), rnd(2 * n, k), rnd(m, n)
    tuning = {"bn": bn} if bn else {}
    ops = TorchOps()

    def residual(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        return (res.float() + F.linear(x, w).float()).to(x.dtype)

    def check(ours: torch.Tensor, ref: Callable[..., torch.Tensor], *args: torch.Tensor) -> None:
        """Ours is as close to the float64 result as the torch ops in ``dtype`` are."""
        exact = ref(*(t.double() for t in args))
        assert rel_err(ours, exact) <= 1.5 * rel_err(ref(*args), exact) + 1e-6

    check(gemv.linear(x, w, bias, **tuning), F.linear, x, w, bias)
    check(
        gemv.linear(x, w, bias, norm, 1e-6, **tuning),
        lambda x, n, w, b: ops.norm_linear(None, x.clone(), n, 1e-6, w, b)[0],
        x, norm, w, bias,
    )  # fmt: skip
    check(
        gemv.silu_linear(x, gate_up, norm, 1e-6, **tuning),
        lambda x, n, gu: ops.norm_swiglu(None, x.clone(), n, 1e-6, gu)[0],
        x, norm, gate_up,
    )  # fmt: skip
    ours = res.clone()
    gemv.linear_residual(x, w, ours, **tuning)
    check(ours, residual, x, w, res)


@needs_kernels
def test_kernel_gemv_argmax_picks_first_maximum() -> None:
    from cloud_engine.kernels import gemv

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 32, generator=g), torch.randn(300, 32, generator=g)
    w[250] = w[17] = 4 * w[0]  # rows 17 and 250 tie for the maximum of row 0
    x[0] = w[0]
    x[2] = 0.0  # every logit of row 2 is zero (some -0.0): the first column wins
    x[3] = -x[1]  # all but one program's maximum negative for some rows
    for bn in (1, 4, None):  # one program per column, several, the default tiling
        logits, ids = gemv.linear_argmax(x.to(DEV), w.to(DEV), bn=bn) if bn else (
            gemv.linear_argmax(x.to(DEV), w.to(DEV))
        )  # fmt: skip
        assert rel_err(logits, F.linear(x, w).to(DEV)) < 1e-5
        assert ids.dtype == torch.int64 and ids.tolist() == torch.argmax(logits, -1).tolist()
        assert ids[0].item() == 17 and ids[2].item() == 0
    # the scratch is reset after every call: a call with smaller maxima still finds its own
    _, ids = gemv.linear_argmax((x[1:2] * 1e-3).to(DEV), w.to(DEV), bn=1)
    assert ids.tolist() == torch.argmax(F.linear(x[1:2] * 1e-3, w), -1).tolist()


@needs_kernels
def test_kernel_embed_fed_matches_torch() -> None:
    from cloud_engine.kernels import embedding
    from cloud_engine.model.torch_ops import TorchOps

    g = torch.Generator().manual_seed(6)
    table = torch.randn(1000, 96, generator=g).to(DEV)  # 96 columns: a masked tail
    i32 = {"dtype": torch.int32, "device": DEV}
    ids = torch.tensor([5, 0, 999, 7, 0], **i32)  # type: ignore[arg-type]
    src = torch.tensor([-1, 2, -1, 0, 1], **i32)  # type: ignore[arg-type]
    fed = torch.tensor([11, 998, 3], dtype=torch.int64, device=DEV)
    want = table[[5, 3, 999, 11, 998]]
    assert torch.equal(embedding.embed_fed(ids, src, fed, table), want)
    assert torch.equal(TorchOps().embed_fed(ids, src, fed, table), want)


def decode_step_inputs(ctx: list[int], group: int) -> tuple[object, torch.Tensor]:
    """AttnInputs (with the torch metadata) and positions of one decode step of sequences with
    KV lengths ``ctx`` (after the step), blocks laid out one sequence after another."""
    from cloud_engine.model.fused import AttnInputs

    i32 = {"dtype": torch.int32, "device": DEV}
    tables, nxt = [], 0
    for c in ctx:
        nb = -(-c // 16)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    width = max(map(len, tables))
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32)  # type: ignore[arg-type]
    slots = [tables[s][(c - 1) // 16] * 16 + (c - 1) % 16 for s, c in enumerate(ctx)]
    slot_t = torch.tensor(slots, **i32)  # type: ignore[arg-type]
    n = len(ctx)
    meta = make_meta(slot_t.long(), tab.long(), list(range(n + 1)), ctx)
    a = AttnInputs(
        slot_t, tab, torch.arange(n, **i32), torch.tensor(ctx, **i32), torch.arange(n + 1, **i32),
        torch.arange(n, **i32), torch.zeros(n, **i32), tile_shape(group, 1), meta,
    )  # type: ignore[arg-type]  # fmt: skip
    return a, torch.tensor([c - 1 for c in ctx], **i32)  # type: ignore[arg-type]


@needs_kernels
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("gemv_rows", [0, 8])
@pytest.mark.parametrize("kv", list(KV_STORAGE))
def test_kernel_decode_forward_matches_torch_ops(
    model_type: str, gemv_rows: int, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One decode step of three sequences (one long enough for several attention splits)
    through the fused decode attention, with library or skinny-GEMV products, against
    TorchOps over the same pool: logits, greedy tokens and the KV written (8-bit: the values
    within one rounding step where float32 ties differ, the scales to float32 rounding)."""
    from cloud_engine.kernels import decode_attention
    from cloud_engine.model.fused import FusedLlama
    from cloud_engine.model.loader import tiny_config
    from cloud_engine.model.torch_ops import TorchOps
    from cloud_engine.model.triton_ops import TritonOps

    calls = []
    fused = decode_attention.decode_attention
    monkeypatch.setattr(
        decode_attention, "decode_attention", lambda *a, **k: calls.append(1) or fused(*a, **k)
    )

    cfg = tiny_config(model_type=model_type, qk_norm=model_type == "qwen3", head_dim=32)
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).to(DEV)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    spec = KVSpec(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
        storage=KV_STORAGE[kv],
    )  # fmt: skip
    pools = [KVPool(spec, 16, DEV) for _ in range(2)]
    noise = torch.randn(pools[0].data.shape, device=DEV)
    if kv == "int8":
        noise = (noise * 40).round().clamp(-127, 127)
    pools[0].data.copy_(noise.to(pools[0].data.dtype))
    pools[1].data.copy_(pools[0].data)
    if pools[0].scales is not None:
        pools[0].scales.uniform_(0.005, 0.02)
        pools[1].scales.copy_(pools[0].scales)  # type: ignore[union-attr]
    ctx = [5, 20, 150]
    a, pos = decode_step_inputs(ctx, cfg.num_attention_heads // cfg.num_key_value_heads)
    ids = torch.tensor([7, 300, 42], device=DEV)
    outs = []
    for pool, ops in zip(pools, (TorchOps(), TritonOps(gemv_rows)), strict=True):
        fm = FusedLlama(model, pool, ops)
        outs.append(fm.logits_argmax(fm.forward(ids, pos, a)))  # type: ignore[arg-type]
    assert len(calls) == cfg.num_hidden_layers  # the fused kernel ran in every layer
    tol = {"plain": 1e-5, "int8": 1e-3, "fp8": 1e-2 if INTERPRET else 1e-3}[kv]
    assert rel_err(outs[1][0], outs[0][0]) < tol
    assert outs[1][1].tolist() == outs[0][1].tolist()
    d0, d1 = pools[0].data.float(), pools[1].data.float()
    if kv == "plain":
        assert rel_err(d1, d0) < 1e-6
    else:
        step = 1.0 if kv == "int8" else d0.abs() / 8 + 2**-9
        assert (INTERPRET and kv == "fp8") or ((d1 - d0).abs() <= step).all()  # as above
        assert rel_err(pools[1].scales, pools[0].scales) < 1e-5  # type: ignore[arg-type]


def tiny_gpu_model(
    model_type: str, dtype: torch.dtype, seed: int = 0, device: str = "cuda"
) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dict(
        {
            "model_type": model_type, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
            "max_position_embeddings": 2048, "rope_theta": 10000.0,
        }
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    model = model.to(device, dtype).eval()
    model.rotary = type(model.rotary)(cfg).to(device)
    return model


def run_engine(
    model: LlamaForCausalLM, reqs: list[GenerationRequest], **kw: object
) -> tuple[dict[str, list[int]], object]:
    import copy

    from cloud_engine.config import EngineConfig
    from cloud_engine.core import EngineCore

    cfg = EngineConfig(
        **{
            "device": "cuda",
            "kv_memory_bytes": 64 * 2**20,
            "max_running": 32,
            "max_tokens_per_step": 512,
            "debug_checks": True,
            **kw,
        }
    )  # type: ignore[arg-type]
    core = EngineCore(copy.deepcopy(model), "gpu-test", cfg)
    rng = random.Random(9)
    arrivals = sorted(rng.randint(0, 40) for _ in reqs)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    step = k = 0
    while k < len(reqs) or core.has_work():
        while k < len(reqs) and arrivals[k] <= step:
            core.add(reqs[k])
            k += 1
        for o in core.step():
            out[o.seq.request_id] += o.new_token_ids
        step += 1
    core.blocks.check_integrity()
    return out, core


def requests(n: int, seed: int, vocab: int = 2048) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [
        GenerationRequest(
            [rng.randrange(vocab) for _ in range(rng.randint(1, 400))],
            SamplingParams(max_tokens=rng.randint(1, 48), temperature=0.0),
            request_id=f"g{i}",
        )
        for i in range(n)
    ]


@needs_cuda
@pytest.mark.parametrize(
    ("model_type", "overlap"), [("llama", True), ("qwen3", True), ("qwen3", False)]
)
def test_cuda_engine_fp32_matches_dense_exactly(model_type: str, overlap: bool) -> None:
    model = tiny_gpu_model(model_type, torch.float32)
    reqs = requests(32, seed=1)
    ref = {r.request_id: generate(model, r.prompt_token_ids, r.sampling).token_ids for r in reqs}
    out, core = run_engine(model, reqs, overlap=overlap)
    assert core.runner.graphs  # type: ignore[attr-defined]
    assert out == ref
    assert (core.counters.ahead_steps > 0) == overlap  # type: ignore[attr-defined]
    # look-ahead steps of greedy graphs take their fed ids inside the graph
    assert (core.runner.graph_feeds > 0) == overlap  # type: ignore[attr-defined]


@needs_cuda
def test_cuda_engine_bf16_agrees_and_preempts() -> None:
    model = tiny_gpu_model("qwen3", torch.bfloat16)
    reqs = requests(24, seed=2)
    ref = {r.request_id: generate(model, r.prompt_token_ids, r.sampling).token_ids for r in reqs}
    out, core = run_engine(model, reqs, max_kv_blocks=40)
    assert core.counters.preemptions > 0  # type: ignore[attr-defined]
    first = sum(out[r][:1] == ref[r][:1] for r in ref) / len(ref)
    tokens = sum(a == b for r in ref for a, b in zip(ref[r], out[r], strict=False)) / sum(
        map(len, ref.values())
    )
    print(f"bf16 paged vs dense: first-token agreement {first:.3f}, token agreement {tokens:.3f}")
    assert first >= 0.9


@needs_cuda
def test_cuda_sampling_seeded_is_reproducible() -> None:
    model = tiny_gpu_model("llama", torch.float32)
    reqs = [
        GenerationRequest(
            [5, 6, 7] * 20,
            SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=s),
            request_id=f"s{i}",
        )
        for i, s in enumerate([1, 1, 2])
    ] + [
        GenerationRequest(
            [5, 6, 7] * 20, SamplingParams(max_tokens=20, temperature=1.0), request_id="u"
        )
    ]
    out, _ = run_engine(model, reqs)
    assert out["s0"] == out["s1"] and out["s0"] != out["s2"]
    assert len(out["u"]) == 20


@needs_cuda
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_cuda_engine_8bit_kv_agrees_with_dense(kv: str) -> None:
    """fp8 / int8 KV through the whole CUDA engine (fused decode attention for small batches,
    the general kernel beyond, prefill chunks, CUDA graphs, a pool small enough to preempt)
    against the dense bf16 reference. Tolerance: the first token of at least 90% of the
    requests, as the bf16 engine is held to, and of all tokens 25% (fp8) or 45% (int8): greedy
    continuations of this random model part at the first flipped token, and the torch runner
    (no kernels) with the same model, requests and pool formats agrees with dense on 0.360
    (fp8), 0.554 (int8) and 0.554 (bf16) of tokens on a CPU (tests/test_kv_dtype.py's slow
    ``test_reference_path_meets_the_cuda_engine_floor``); measured here on an H200: 0.300 and
    0.647."""
    model = tiny_gpu_model("qwen3", torch.bfloat16)
    reqs = requests(24, seed=2)
    ref = {r.request_id: generate(model, r.prompt_token_ids, r.sampling).token_ids for r in reqs}
    out, core = run_engine(model, reqs, kv_dtype=kv, max_kv_blocks=40)
    pool = core.pool  # type: ignore[attr-defined]
    assert pool.spec.kv_dtype == kv and pool.scales is not None
    assert core.runner.graphs  # type: ignore[attr-defined]
    first = sum(out[r][:1] == ref[r][:1] for r in ref) / len(ref)
    tokens = sum(a == b for r in ref for a, b in zip(ref[r], out[r], strict=False)) / sum(
        map(len, ref.values())
    )
    print(f"{kv} paged vs dense bf16: first-token agreement {first:.3f}, tokens {tokens:.3f}")
    assert first >= 0.9 and tokens >= {"fp8": 0.25, "int8": 0.45}[kv]


@needs_cuda
def test_cuda_fp8_pool_holds_about_twice_the_bf16_tokens() -> None:
    """The same byte budget: an fp8 pool (head_dim 64, a 4-byte scale per head) holds
    128 / 68 = 1.88x the blocks of a bf16 one; ``auto`` picks fp8 when bf16 would hold fewer
    than ``kv_auto_min_sequences`` max-length requests."""
    model = tiny_gpu_model("llama", torch.bfloat16)
    cores = {
        kv: run_engine(model, requests(2, seed=3), kv_dtype=kv, kv_memory_bytes=8 * 2**20)[1]
        for kv in ("bf16", "fp8", "auto")
    }
    blocks = {kv: c.pool.num_blocks for kv, c in cores.items()}  # type: ignore[attr-defined]
    assert abs(blocks["fp8"] / blocks["bf16"] - 128 / 68) < 0.01
    # 8 MiB of bf16 holds 5,461 tokens, under 4 requests of 2,048: auto compresses
    assert cores["auto"].pool.spec.kv_dtype == "fp8"  # type: ignore[attr-defined]
