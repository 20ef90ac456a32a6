"""Prefix block keys of a trace request: :func:`block_keys` gives one key per full 16-token
prompt block, equal keys for equal prefixes (shared ``hash_ids`` blocks, a prefix group, else
the request's own). Invariants: keys are ``hash`` of int tuples, so equal in every process
(unlike ``hash`` of strings); a request gets exactly ``prompt_tokens // 16`` keys.
"""

from __future__ import annotations

import zlib

from routing.blocks import BLOCK_SIZE
from routing.sim.trace import TraceRequest

_GROUP, _UNIQUE = 0x6A09E667, 0x3C6EF372  # tags: keys of int tuples hash the same in every process


def block_keys(tr: TraceRequest, idx: int, cache: dict[int, tuple[int, ...]]) -> list[int]:
    """Keys of the request's full 16-token prompt blocks (equal keys: equal prefixes).

    Keys are ``hash`` of int tuples (stable across processes, unlike ``hash`` of strings):
    ``(id, j)`` for sub-block ``j`` of a shared ``hash_ids`` block, ``(_GROUP, crc32(group), j)``
    for a prefix group, ``(_UNIQUE, idx, j)`` for the request's own blocks."""
    n = tr.prompt_tokens // BLOCK_SIZE
    out: list[int] = []
    if tr.hash_ids:
        per = tr.hash_block_tokens // BLOCK_SIZE
        for h in tr.hash_ids:
            if len(out) >= n:
                break
            sub = cache.get(h)
            if sub is None:
                sub = cache[h] = tuple(hash((h, j)) for j in range(per))
            out.extend(sub)
        del out[n:]
    elif tr.prefix_group and tr.prefix_tokens >= BLOCK_SIZE:
        g = zlib.crc32(tr.prefix_group.encode())
        out = [hash((_GROUP, g, j)) for j in range(min(n, tr.prefix_tokens // BLOCK_SIZE))]
    out.extend(hash((_UNIQUE, idx, j)) for j in range(len(out), n))
    return out
