"""What slows the edge's first short prompt of a burst? Its time alone, against the same kind
of prompt with seven long prompts sent to the edge 1 ms behind it (they queue behind its 4
slots: their intake only) and beside five prompts sent to the cloud at the same moment.

Each round sends the three cases in turn, new words each time, straight to the nodes' own
endpoints of the embedded default (no routing), one-token answers for the measured prompt;
the ratios to the alone case (the peer, same run) are the result.

    python bench/edge_burst_intake.py [--rounds 6] [--behind 7] [--beside 5]

Writes bench/results/edge_burst_intake.json and .md and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write_rows_and_summary
from bench._serve import embedded_default
from bench.tier_contention import _ask, _node_urls, _text, _warm
from gateway.node_token import NODE_TOKEN_HEADER


async def _with(
    c: httpx.AsyncClient, edge: str, short: str, others: list[tuple[str, str]], gap_s: float
) -> float:
    """The short prompt's time with ``others`` (url, prompt) sent ``gap_s`` after it."""
    first = asyncio.create_task(_ask(c, edge, short))
    await asyncio.sleep(gap_s)
    await asyncio.gather(*(_ask(c, url, p) for url, p in others))
    return await first


async def _rounds(base: str, token: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    url = _node_urls(base)
    rng = random.Random(args.seed)
    rows = []
    async with httpx.AsyncClient(timeout=120.0, headers={NODE_TOKEN_HEADER: token}) as c:
        await _warm(c, url, 20, rng)
        for i in range(args.rounds):
            alone = await _ask(c, url["edge"], _text(20, rng))
            await asyncio.sleep(0.5)
            longs = [(url["edge"], _text(700, rng)) for _ in range(args.behind)]
            behind = await _with(c, url["edge"], _text(20, rng), longs, 0.001)
            await asyncio.sleep(1.0)
            clouds = [(url["cloud"], _text(20, rng)) for _ in range(args.beside)]
            beside = await _with(c, url["edge"], _text(20, rng), clouds, 0.0)
            await asyncio.sleep(1.0)
            rows.append({"round": i, "edge_alone_ms": alone, "edge_intake_behind_ms": behind,
                         "edge_beside_cloud_ms": beside})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--behind", type=int, default=7, help="long prompts sent to the edge behind")
    ap.add_argument("--beside", type=int, default=5, help="prompts sent to the cloud beside")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.behind < 1 or args.beside < 1:
        ap.error("--rounds, --behind and --beside must be at least 1")
    token = os.environ.get("EDGECLOUD_NODE_TOKEN") or secrets.token_urlsafe(32)
    os.environ["EDGECLOUD_NODE_TOKEN"] = token  # the fleet's nodes take it from here
    with embedded_default() as base:
        rows = asyncio.run(_rounds(base, token, args))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    summary = {**{f"{k}_median": v for k, v in med.items()},
               "intake_ratio": med["edge_intake_behind_ms"] / med["edge_alone_ms"],
               "cloud_ratio": med["edge_beside_cloud_ms"] / med["edge_alone_ms"]}  # fmt: skip
    write_rows_and_summary(
        "edge_burst_intake",
        "The edge's short prompt alone, with long prompts behind it, beside the cloud's",
        rows,
        summary,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
