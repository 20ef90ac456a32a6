"""Do the two tiers of the embedded default slow each other on a CPU-only box?

Both nodes of ``edgecloud serve`` share the machine's cores. Each pair sends a short prompt
straight to the cloud node alone (the peer), then the same kind of prompt again while the
edge node prefills a long one sent at the same moment; the ratio of the cloud's times is the
result. Prompts are new words each time (no prefix to reuse), answers one token long, sent
to the nodes' own endpoints (no routing in between).

    python bench/tier_contention.py [--pairs 6] [--short-words 30] [--long-words 700]

Writes bench/results/tier_contention.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_rows_and_summary
from bench._serve import embedded_default
from bench.edge_shared_prompt import WORDS
from gateway.node_token import NODE_TOKEN_HEADER

MODEL = "smollm2-135m-instruct"


def _text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _ask(client: httpx.AsyncClient, url: str, prompt: str) -> float:
    """One request's time (ms) from send to the whole one-token reply."""
    t0 = time.perf_counter()
    r = await client.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1},
    )
    r.raise_for_status()
    return (time.perf_counter() - t0) * 1000.0


def _node_urls(base: str) -> dict[str, str]:
    """The embedded default's node URLs by kind, from the gateway's view."""
    nodes = httpx.get(base + "/admin/nodes", timeout=5.0).json()["nodes"]
    return {n["kind"]: n["url"] for n in nodes}


async def _warm(c: httpx.AsyncClient, url: dict[str, str], words: int, rng: random.Random) -> None:
    """One short prompt to each node, so that no measured one is its first."""
    for kind in ("cloud", "edge"):
        await _ask(c, url[kind], _text(words, rng))


async def _pairs(base: str, token: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    url = _node_urls(base)
    rng = random.Random(args.seed)
    rows = []
    async with httpx.AsyncClient(timeout=120.0, headers={NODE_TOKEN_HEADER: token}) as c:
        await _warm(c, url, args.short_words, rng)
        for i in range(args.pairs):
            alone = await _ask(c, url["cloud"], _text(args.short_words, rng))
            await asyncio.sleep(0.5)
            edge_ms, beside = await asyncio.gather(
                _ask(c, url["edge"], _text(args.long_words, rng)),
                _ask(c, url["cloud"], _text(args.short_words, rng)),
            )
            rows.append({"pair": i, "cloud_alone_ms": alone, "cloud_beside_ms": beside,
                         "edge_long_ms": edge_ms})  # fmt: skip
            await asyncio.sleep(1.0)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--short-words", type=int, default=30)
    ap.add_argument("--long-words", type=int, default=700)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    token = os.environ.get("EDGECLOUD_NODE_TOKEN") or secrets.token_urlsafe(32)
    os.environ["EDGECLOUD_NODE_TOKEN"] = token  # the fleet's nodes take it from here
    with embedded_default() as base:
        rows = asyncio.run(_pairs(base, token, args))
    alone = statistics.median(r["cloud_alone_ms"] for r in rows)
    beside = statistics.median(r["cloud_beside_ms"] for r in rows)
    summary = {"cloud_alone_median_ms": alone, "cloud_beside_median_ms": beside,
               "ratio": beside / alone,
               "edge_long_median_ms": statistics.median(r["edge_long_ms"] for r in rows)}  # fmt: skip
    write_rows_and_summary(
        "tier_contention",
        "The cloud's short prompt alone and beside the edge's long prefill",
        rows,
        summary,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
