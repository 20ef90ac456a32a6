"""``edgecloud replay --trace T --url GATEWAY``: an open-loop replayer that sends a trace
through a live gateway at the trace's arrival times and records what each request measured.

A trace has no text: each request's prompt is made of token ids derived from its prefix block
keys (``routing.sim.block_keys.block_keys``: requests that share a prefix in the trace send the
same leading token ids, so the gateway's block hashes and the nodes' prefix caches see the
sharing), sent as a ``/v1/completions`` token-id prompt with ``max_tokens`` = the trace's
output tokens, streamed (``stream_options.include_usage``) when the trace says so.

Invariants: arrivals are kept (open loop: a request is sent at its time whether or not earlier
ones finished); every request is recorded once, with its error if it failed; token ids are a
pure function of the block keys (seeded), so two replays send the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

VOCAB = (200, 20000)


def prompt_ids(tr: Any, idx: int, cache: dict[int, tuple[int, ...]]) -> list[int]:
    from routing.sim.block_keys import block_keys

    ids: list[int] = []
    for key in block_keys(tr, idx, cache):
        rng = random.Random(key)
        ids.extend(rng.randrange(*VOCAB) for _ in range(16))
    rng = random.Random(hash((0x51ED, idx)))
    ids.extend(rng.randrange(*VOCAB) for _ in range(tr.prompt_tokens - len(ids)))
    return ids


async def _one(
    client: Any,
    url: str,
    model: str,
    tr: Any,
    ids: list[int],
    t_start: float,
    extra: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids,
        "max_tokens": tr.output_tokens,
        "temperature": 0.0,
        "stream": tr.stream,
        **(extra or {}),
    }
    if tr.stream:
        body["stream_options"] = {"include_usage": True}
    delay = t_start + tr.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"arrival_s": tr.arrival_s, "sent_late_s": t0 - t_start - tr.arrival_s}
    try:
        if tr.stream:
            first = None
            usage: dict[str, Any] = {}
            async with client.stream(
                "POST", url + "/v1/completions", json=body, headers=headers
            ) as resp:
                headers = resp.headers
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if first is None and d.get("choices") and d["choices"][0].get("text"):
                        first = time.perf_counter()
                    if d.get("usage"):
                        usage = d["usage"]
            t1 = time.perf_counter()
            rec["ttft_s"] = (first or t1) - t0
        else:
            resp = await client.post(url + "/v1/completions", json=body, headers=headers)
            headers = resp.headers
            resp.raise_for_status()
            usage = resp.json().get("usage", {})
            t1 = time.perf_counter()
            m = headers.get("x-edgecloud-measured-ttft-ms")
            rec["ttft_s"] = float(m) / 1000.0 if m else None
        rec.update(
            e2e_s=t1 - t0,
            completion_tokens=int(usage.get("completion_tokens", 0)),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(headers.get("x-edgecloud-cached-tokens", 0) or 0),
            node=headers.get("x-edgecloud-node"),
            tier=headers.get("x-edgecloud-tier"),
            predicted_ttft_ms=float(headers.get("x-edgecloud-predicted-ttft-ms", "nan")),
            predicted_e2e_ms=float(headers.get("x-edgecloud-predicted-e2e-ms", "nan")),
        )
    except Exception as exc:  # recorded, not raised: one failure must not stop a replay
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def replay(
    url: str,
    trace: list[Any],
    model: str | None = None,
    timeout_s: float = 600.0,
    *,
    prompts: list[list[int]] | None = None,
    extra_body: dict[str, Any] | None = None,
    keys: dict[str, str] | None = None,
    max_connections: int = 1000,
) -> list[dict[str, Any]]:
    """Send ``trace`` open-loop; one record per request. ``prompts``: the token ids to send
    (default: :func:`prompt_ids` of each request by its index); ``extra_body``: fields added
    to every request (``ignore_eos``); ``keys``: the bearer key sent for each trace
    ``api_key`` (none: no key)."""
    import httpx

    cache: dict[int, tuple[int, ...]] = {}
    if prompts is None:
        prompts = [prompt_ids(tr, i, cache) for i, tr in enumerate(trace)]
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        auth = {k: {"authorization": f"Bearer {v}"} for k, v in (keys or {}).items()}
        if model is None:
            first = next(iter(auth.values()), None)
            model = (await client.get(url + "/v1/models", headers=first)).json()["data"][0]["id"]
        t_start = time.perf_counter() + 0.5
        tasks = [
            _one(client, url, model, tr, ids, t_start, extra_body, auth.get(tr.api_key))
            for tr, ids in zip(trace, prompts, strict=True)
        ]
        return list(await asyncio.gather(*tasks))


def register(sub: Any) -> None:
    from gateway.commands.sim import add_trace_args

    p = sub.add_parser("replay", help="replay a trace open-loop through a live gateway")
    add_trace_args(p, fleet=False)
    p.add_argument("--url", required=True, help="the gateway's base URL")
    p.add_argument("--out", required=True, help="JSONL of per-request measurements")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from gateway.commands.sim import load_trace_args

    trace = load_trace_args(args)
    recs = asyncio.run(replay(args.url.rstrip("/"), trace))
    with open(args.out, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    bad = sum(1 for r in recs if "error" in r)
    print(f"replayed {len(recs)} requests ({bad} failed) -> {args.out}")
    return 0
