"""Batched sampling on the logits' device: greedy, temperature, top-k, top-p, per-request seeds.

Invariants: a greedy row is ``argmax`` of its logits (so paged and dense greedy agree whenever
their logits do); a seeded row uses the reference ``cloud_engine.model.sampling.sample`` with
its own generator, so it reproduces the dense reference's draws; unseeded rows share one
vectorized draw (exponential race over the filtered probabilities).

Before ``min_tokens`` tokens were generated, a row's stop token ids are never sampled: their
logits are taken as -inf (``banned``, from :func:`banned_stops`), as vLLM does.

Per-request isolation: :func:`prepare` checks a request's parameters
(``routing.sampling_limits.check_sampling``) and makes its generator; the engine core calls it
when the request arrives, so parameters a sampler would fail on fail that request alone and
never reach :func:`sample_batch`, where one row's error would fail the whole batch's step.
Seeds are taken as their 64-bit pattern (``seed mod 2**64``, see ``routing.sampling_limits``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cloud_engine.model.sampling import sample
from routing.engine import SamplingParams
from routing.sampling_limits import MAX_TOP_K, check_sampling, seed_u64


def _filtered_probs_batch(
    logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Row-wise softmax of ``logits / temp`` restricted to each row's top-k and top-p."""
    x = logits.float() / temp.clamp_min(1e-5).unsqueeze(1)
    sorted_x, idx = torch.sort(x, dim=-1, descending=True)
    v = x.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp_max(v), torch.full_like(top_k, v))
    kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    p = torch.softmax(sorted_x, dim=-1)
    drop = (p.cumsum(-1) - p) > top_p.unsqueeze(1)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    x = torch.full_like(x, float("-inf")).scatter(1, idx, sorted_x)
    return torch.softmax(x, dim=-1)


def banned_stops(
    params: Sequence[SamplingParams], generated: Sequence[int]
) -> list[tuple[int, ...]] | None:
    """Per row, the stop token ids it may not sample with ``generated`` tokens already out
    (``SamplingParams.banned_stops``); None when no row bans any."""
    bans = [p.banned_stops(g) for p, g in zip(params, generated, strict=True)]
    return bans if any(bans) else None


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[S, V]``, as an int64 tensor on the same device;
    ``banned[i]``: token ids row ``i`` may not be (see :func:`banned_stops`)."""
    if banned is not None:
        rows = [i for i, ids in enumerate(banned) for t in ids if 0 <= t < logits.shape[-1]]
        cols = [t for ids in banned for t in ids if 0 <= t < logits.shape[-1]]
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
    greedy = [p.greedy for p in params]
    out = torch.argmax(logits, dim=-1)
    if all(greedy):
        return out
    dev = logits.device
    seeded = [i for i, p in enumerate(params) if not greedy[i] and generators[i] is not None]
    rest = [i for i, p in enumerate(params) if not greedy[i] and generators[i] is None]
    for i in seeded:
        out[i] = sample(logits[i], params[i], generators[i])
    if rest:
        rows = to_device(torch.tensor(rest), dev)
        sub = [params[i] for i in rest]
        probs = _filtered_probs_batch(
            logits[rows],
            to_device(torch.tensor([p.temperature for p in sub]), dev),
            to_device(torch.tensor([min(p.top_k, MAX_TOP_K) for p in sub]), dev),
            to_device(torch.tensor([p.top_p for p in sub]), dev),
        )
        race = torch.empty_like(probs).exponential_()
        out[rows] = torch.argmax(probs / race, dim=-1)
    return out


def to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """The CPU tensor ``t`` on ``dev`` without the host waiting for the device: on CUDA through
    pinned memory from torch's caching host allocator (which reuses a block only once its copy
    has completed, so ``t`` may change at once) and an asynchronous copy. A copy from pageable
    memory would wait for the whole stream, e.g. for a look-ahead decode graph still running."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's generator (None: greedy or unseeded); raises ``InvalidSampling`` for a
    seed outside what torch can take (``[-2**63, 2**64)``)."""
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed_u64(params.seed))
    return g


def prepare(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """Check ``params`` and make the request's generator: raises ``InvalidSampling`` (and
    nothing else for parameters of the right types) exactly when sampling it would fail."""
    check_sampling(params)
    return make_generator(params, device)
