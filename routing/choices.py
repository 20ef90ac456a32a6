"""The choices of one ``n > 1`` request: their request ids and their seeds.

Invariants: choice 0 keeps the request's own id and seed, so ``n = 1`` is unchanged; choice
``i > 0`` gets ``choice_seed(seed, i)``, a pure function of the seed and the index (the same
on every node and every run), distinct for distinct indices with near certainty.
"""

from __future__ import annotations

import hashlib

from routing.sampling_limits import seed_u64

MAX_CHOICES = 128  # OpenAI's bound on ``n``


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` (None stays None: unseeded choices differ anyway)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(
        seed_u64(seed).to_bytes(8, "little") + index.to_bytes(4, "little"), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64: valid at the API too


def choice_request_id(request_id: str, index: int) -> str:
    """The engine request id of choice ``index``."""
    return request_id if index == 0 else f"{request_id}-{index}"
