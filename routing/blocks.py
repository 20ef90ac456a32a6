"""Prefix block hashing shared by the gateway and the engines.

Invariants:
- A block is ``BLOCK_SIZE`` (16) consecutive prompt tokens; only full blocks are hashed.
- ``hash[i]`` depends on ``hash[i-1]`` and the token ids of block ``i``, so equal hashes mean
  equal token prefixes (up to 64-bit collisions, which the cloud engine guards against).
- Hashes are seeded by the model's identity: two models never share a block hash space.
- A request's cache scope (``cache_salt``, an opaque string the gateway derives per tenant)
  re-seeds the chain (:func:`scope_seed`): two scopes never share a block hash, so no tenant
  is credited, served or told of another's prefixes. The empty salt is the model's own seed
  (one scope: the embedded default without keys hashes exactly as before).
- Hashes are stable across processes, machines and Python versions (blake2b, not ``hash()``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

BLOCK_SIZE = 16
_MASK64 = (1 << 64) - 1


def reusable_blocks(prompt_tokens: int) -> int:
    """Leading whole blocks of a prompt an engine may take from a prefix cache: at least one
    prompt token is always computed (its logits give the first output token)."""
    return max(0, prompt_tokens - 1) // BLOCK_SIZE


def model_seed(model_identity: str) -> int:
    """The 64-bit root hash for a model identity; the parent of every model's first block."""
    return int.from_bytes(
        hashlib.blake2b(model_identity.encode(), digest_size=8).digest(), "little"
    )


@lru_cache(maxsize=4096)
def scope_seed(seed: int, cache_salt: str = "") -> int:
    """The root hash of a cache scope: ``seed`` itself for the empty salt, else the seed
    chained with the salt's bytes (a pure function, cached)."""
    if not cache_salt:
        return seed
    payload = (seed & _MASK64).to_bytes(8, "little") + b"scope:" + cache_salt.encode()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Chain one block's token ids onto its parent's hash (unsigned 64-bit)."""
    payload = (parent & _MASK64).to_bytes(8, "little") + array("I", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], seed: int, block_size: int = BLOCK_SIZE) -> list[int]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block is not hashed)."""
    out: list[int] = []
    parent = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out


@dataclass(slots=True)
class BlockEvents:
    """Prefix-index changes since the last drain: hashes stored and removed (disjoint)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)
