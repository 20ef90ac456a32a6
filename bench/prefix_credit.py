"""Prefix credit against what the nodes report: a replay of the Mooncake trace's shared prefixes.

The gateway credits a node with the leading prefix blocks its index says the node holds
(``x-edgecloud-credited-tokens``); the node then reports the prompt tokens it really served
from its cache (``usage.prompt_tokens_details.cached_tokens``). This replays the first
``--requests`` conversation requests of ``shared/data/traces/mooncake_conversation_trace.jsonl`` in arrival
order through the embedded default (``edgecloud serve``, in-process fleet store), keeping the
requests that continue an earlier one and those they continue (``conversation_requests``): each of the
trace's 512-token prefix blocks becomes ``--tokens-per-block`` token ids derived from its id (so
equal ids give equal prefixes), plus a few tokens unique to the request; prompts are sent as
token ids to ``/v1/completions``, streamed, ``max_tokens`` 2, at ``--concurrency``.

The result is the share of requests whose credited prefix equals the reported cached tokens,
overall and per tier, and how the misses split (credited more / less than reported).

    python bench/prefix_credit.py --requests 200 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RESULTS, machine, recorded_command, table
from bench._serve import embedded_default

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
TRACE_FILE = "mooncake_conversation_trace.jsonl"
VOCAB = 49152  # SmolLM2's vocabulary


def block_tokens(hash_id: int, n: int) -> list[int]:
    rng = random.Random(hash_id * 7919 + 17)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def conversation_requests(path: Path, count: int, window: int = 4000) -> list[list[int]]:
    """The trace's requests that continue an earlier one (equal leading blocks past the first,
    which every request shares) and the requests they continue, in arrival order, up to
    ``count``: consecutive requests of the trace rarely share more than its first block, its
    conversations span minutes."""
    rows = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i >= window:
                break
            rows.append(json.loads(line)["hash_ids"])
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(rows):
        if len(ids) > 1:
            groups.setdefault(ids[1], []).append(i)
    keep = sorted(i for g in groups.values() if len(g) > 1 for i in g)
    return [rows[i] for i in keep[:count]]


def prompts(path: Path, count: int, tokens_per_block: int, max_blocks: int) -> list[list[int]]:
    out = []
    for i, hash_ids in enumerate(conversation_requests(path, count)):
        ids = hash_ids[:max_blocks]
        toks = [t for h in ids for t in block_tokens(h, tokens_per_block)]
        tail = random.Random(i).randrange(3, 12)  # unique tail: never ends on a block edge
        toks += block_tokens(10_000_000 + i, tail)
        out.append(toks)
    return out


async def one(client: httpx.AsyncClient, base: str, prompt: list[int]) -> dict[str, Any]:
    body = {
        "model": "auto",
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        h = r.headers
        usage = None
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                usage = obj.get("usage") or usage
    reported = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", -1))
    return {
        "status": r.status_code,
        "tier": h.get("x-edgecloud-tier"),
        "credited": int(h.get("x-edgecloud-credited-tokens", -1)),
        "reported": reported,
        "prompt_tokens": len(prompt),
        "e2e_ms": (time.perf_counter() - t0) * 1000,
    }


async def replay(base: str, items: list[list[int]], concurrency: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in items]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(items)):
        queue.put_nowait(i)

    async with httpx.AsyncClient(timeout=120.0) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = await one(client, base, items[i])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tier in ("all", "edge", "cloud"):
        sel = [r for r in rows if r["status"] == 200 and (tier == "all" or r["tier"] == tier)]
        if not sel:
            continue
        equal = sum(r["credited"] == r["reported"] for r in sel)
        out.append(
            {
                "tier": tier,
                "requests": len(sel),
                "credited_eq_reported": round(equal / len(sel), 4),
                "credited_more": sum(r["credited"] > r["reported"] for r in sel),
                "credited_less": sum(r["credited"] < r["reported"] for r in sel),
                "mean_reported_cached": round(sum(r["reported"] for r in sel) / len(sel), 1),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--max-blocks", type=int, default=30)
    ap.add_argument(
        "--policy",
        nargs="+",
        default=["latency", "round_robin"],
        help="routing policies to replay under (round_robin splits prefixes over both tiers)",
    )
    ap.add_argument("--trace", type=Path, default=TRACE / TRACE_FILE)
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_credit.json")
    args = ap.parse_args(argv)
    items = prompts(args.trace, args.requests, args.tokens_per_block, args.max_blocks)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policy:
            policy_file = Path(tmp) / f"{policy}.yaml"
            policy_file.write_text(f"policy: {policy}\n")
            for c in args.concurrency:
                # a fresh fleet per run: every cache starts empty
                with embedded_default(["--policy-file", str(policy_file)]) as base:
                    rows = asyncio.run(replay(base, items, c))
                summary = summarize(rows)
                for s in summary:
                    s["policy"], s["concurrency"] = policy, c
                runs.extend(summary)
                bad = sum(r["status"] != 200 for r in rows)
                print(f"{policy}, concurrency {c}: {len(rows)} requests, {bad} not 200")
    cols = [
        "policy",
        "concurrency",
        "tier",
        "requests",
        "credited_eq_reported",
        "credited_more",
        "credited_less",
        "mean_reported_cached",
    ]
    print(table(runs, cols))
    command = recorded_command("prefix_credit.py", sys.argv[1:], ("--out", "--trace"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(
        f"# prefix_credit\n\n`{command}`\n\n{table(runs, cols)}\n"
    )
    args.out.write_text(
        json.dumps(
            {
                "command": command,
                "machine": machine(),
                "trace": TRACE_FILE,
                "requests": args.requests,
                "tokens_per_block": args.tokens_per_block,
                "results": runs,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
