"""The grouped MoE Triton kernel (``cloud_engine.kernels.moe``) against a plain torch loop over
experts and against ``SparseMoE``'s eager path, in bf16 on the Qwen3-30B-A3B layer shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cloud_engine.kernels import triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (triton_available() and torch.cuda.is_available()), reason="needs Triton and CUDA"
    ),
]

H, INTER, E, K = 2048, 768, 128, 8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def weights(e: int = E, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=g)
    router = (torch.randn(e, H, **kw) / H**0.5).bfloat16()
    w_gu = (torch.randn(e, 2 * INTER, H, **kw) / H**0.5).bfloat16()
    w_d = (torch.randn(e, H, INTER, **kw) / INTER**0.5).bfloat16()
    return router, w_gu, w_d


def loop_ref(h, w, idx, w_gu, w_d, e0=0):  # type: ignore[no-untyped-def]
    """float32 over the bf16 tensors, one expert at a time."""
    out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    hf = h.float()
    for t in range(h.shape[0]):
        for s in range(idx.shape[1]):
            e = int(idx[t, s]) - e0
            if not 0 <= e < w_gu.shape[0]:
                continue
            g, u = (hf[t] @ w_gu[e].float().T).chunk(2)
            out[t] += float(w[t, s]) * ((F.silu(g) * u) @ w_d[e].float().T)
    return out


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("norm", [True, False])
def test_moe_kernel_matches_loop(tokens: int, norm: bool) -> None:
    from cloud_engine.kernels.moe import moe_forward, route

    router, w_gu, w_d = weights()
    h = torch.randn(tokens, H, device="cuda").bfloat16()
    got = moe_forward(h, router, w_gu, w_d, K, norm)
    w, idx = route(h, router, K, norm)
    ref = loop_ref(h, w, idx, w_gu, w_d)
    assert got.dtype == torch.bfloat16 and got.shape == h.shape
    assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("tokens", [1, 64])
def test_moe_kernel_rank_slice(tokens: int) -> None:
    """Expert parallelism: a rank holding experts [32, 64) adds only their pairs."""
    from cloud_engine.kernels.moe import experts_forward, route

    router, w_gu, w_d = weights()
    h = torch.randn(tokens, H, device="cuda").bfloat16()
    w, idx = route(h, router, K, True)
    probs = torch.topk(torch.softmax(h.float() @ router.float().T, -1), K, dim=-1).values
    got = experts_forward(h, probs, idx, w_gu[32:64], w_d[32:64], e0=32, norm_topk=True)
    ref = loop_ref(h, w, idx, w_gu[32:64], w_d[32:64], e0=32)
    assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_sparse_moe_cuda_dispatch(tokens: int) -> None:
    """``SparseMoE`` on CUDA takes the kernel; its eager path on the same tensors agrees."""
    from cloud_engine.parallel.moe import MoEConfig, SparseMoE

    router, w_gu, w_d = weights(seed=1)
    moe = object.__new__(SparseMoE)
    moe.cfg = MoEConfig(num_experts=E, top_k=K, intermediate=INTER, norm_topk=True)
    moe.e0, moe.e1 = 0, E
    moe.router, moe.w_gate_up, moe.w_down, moe.shared = router, w_gu, w_d, None
    x = torch.randn(1, tokens, H, device="cuda").bfloat16()
    moe.use_kernel = True
    got = moe(x)
    moe.use_kernel = False
    ref = moe(x)
    assert got.shape == x.shape
    assert rel_err(got, ref) < 1e-2
