"""Mixture-of-experts in the fused CUDA path: the decode pair kernels against a loop over
experts, and the CUDA engine (fused model, Triton kernels, CUDA graphs) over tiny MoE
checkpoints against the eager layers on CPU. Marked ``gpu``; the kernel test also runs on CPU
tensors under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_checkpoints import VOCAB, write_moe_models
from parallel_jobs import drive, mixed_requests
from test_cloud_gpu import DEV, INTERPRET, needs_kernels
from test_moe_kernel import loop_ref, rel_err

from cloud_engine.config import EngineConfig

pytestmark = pytest.mark.gpu


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 4])
@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("e0", [0, 2])
def test_kernel_moe_pairs_match_loop(tokens: int, norm_topk: bool, e0: int) -> None:
    """``residual + sum_k w * expert(rmsnorm(residual))`` in place; with ``e0`` this rank
    holds experts ``[e0, e0 + E)`` of the router's eight and the others add nothing."""
    from cloud_engine.kernels.moe import route
    from cloud_engine.kernels.moe_decode import moe_residual

    small = INTERPRET or DEV == "cpu"
    h, inter, experts, k = (64, 48, 8, 3) if small else (2048, 768, 128, 8)
    dtype = torch.float32 if small else torch.bfloat16
    g = torch.Generator().manual_seed(tokens + 10 * e0)
    held = experts // 2 if e0 else experts
    router = (torch.randn(experts, h, generator=g) / h**0.5).to(DEV, dtype)
    w_gu = (torch.randn(held, 2 * inter, h, generator=g) / h**0.5).to(DEV, dtype)
    w_d = (torch.randn(held, h, inter, generator=g) / inter**0.5).to(DEV, dtype)
    norm = (torch.rand(h, generator=g) + 0.5).to(DEV, dtype)
    residual = torch.randn(tokens, h, generator=g).to(DEV, dtype)
    x = _rms(residual, norm, 1e-6)
    w, idx = route(x, router, k, norm_topk)
    want = residual.float() + loop_ref(x, w.float(), idx, w_gu, w_d, e0)
    got = residual.clone()
    moe_residual(got, norm, 1e-6, router, w_gu, w_d, k, norm_topk, e0)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(got, residual) > 1e-3  # the experts did add something


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_moe_models(tmp_path_factory.mktemp("moe-gpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_cuda_engine_over_moe_matches_eager_layers(moe_models: dict[str, Path], name: str) -> None:
    """float32: the CUDA engine (decode graphs with the pair kernels at up to eight sequences
    and the grouped kernel beyond, eager prefill) gives the eager CPU layers' tokens."""
    from cloud_engine.parallel.build import driver_core, single_process_core
    from cloud_engine.parallel.dist import ParallelConfig, Rank

    reqs, arrivals = mixed_requests(12, VOCAB, seed=3)
    cpu = EngineConfig(max_kv_blocks=60, max_tokens_per_step=128)
    gpu = EngineConfig(
        device="cuda", dtype=torch.float32, max_kv_blocks=60, max_tokens_per_step=128,
        max_running=16, debug_checks=True,
    )  # fmt: skip
    one = Rank(ParallelConfig(), 0, None, torch.device("cpu"))
    with torch.inference_mode():
        ref = drive(driver_core(moe_models[name], "moe", one, cpu), reqs, arrivals)
        core = single_process_core(moe_models[name], "moe", gpu)
        got = drive(core, reqs, arrivals)
    assert got == ref
    assert core.runner.graphs  # type: ignore[attr-defined]
