"""``edgecloud profile --node URL``: measure a live node and write a node profile JSON
(``routing.sim.profiles.NodeProfile``) for the simulator.

What it measures, through the Node API only (``/load`` and streamed ``/v1/completions`` with
token-id prompts, so prompt lengths are exact):
- prefill: time to first token of a lone request by prompt length (fresh random prompts, so no
  prefix hit), minus the per-request overhead (the intercept at the shortest prompts);
- decode: ms per step by batch size (concurrent streams) and context, from each stream's time
  between its first and last token over its completion tokens;
- slots / max batch, KV blocks and max context from ``/load``;
- prefix-hit speedup: TTFT of a repeated prompt against its first, cold, run;
- the provider and device it really runs on (``device`` in ``/load``, e.g. ``OpenVINO:CPU``),
  part of the profile's name and identity, and its watts at idle and under load where it
  reports them (``routing.power``).

Invariants: nothing else may use the node while it runs (the numbers would include it);
every prompt is seeded (``--seed``), so two runs send the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from datetime import UTC, datetime
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure a live node into a simulator profile JSON")
    p.add_argument("--node", required=True, help="the node's base URL, e.g. http://127.0.0.1:8001")
    p.add_argument(
        "--out", required=True, help="where to write the profile JSON (a folder: NAME.json in it)"
    )
    p.add_argument("--name", default=None, help="profile name (default: kind-model-device)")
    p.add_argument("--prefill", type=int, nargs="*", default=None, help="prompt lengths")
    p.add_argument("--batches", type=int, nargs="*", default=None, help="decode batch sizes")
    p.add_argument(
        "--contexts", type=int, nargs="*", default=[128, 1024], help="decode context lengths"
    )
    p.add_argument("--decode-tokens", type=int, default=48, help="tokens per decode run")
    p.add_argument("--repeats", type=int, default=3, help="runs per point (median kept)")
    p.add_argument("--seed", type=int, default=0, help="prompt token seed")
    p.add_argument("--notes", default="", help="free text stored in the profile")
    p.add_argument(
        "--node-token", default=None, help="the node's token (default: $EDGECLOUD_NODE_TOKEN)"
    )
    p.set_defaults(func=_run)


async def _stream(
    client: Any,
    url: str,
    model: str,
    ids: list[int],
    max_tokens: int,
    seed: int,
    chunks: list[float] | None = None,
) -> tuple[float, float, int, float]:
    """(ttft_s, e2e_s, completion tokens, time of the last token) of one streamed completion;
    ``chunks`` collects the arrival time (perf_counter) of every content chunk."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 1.0,
        "seed": seed,
    }
    t0 = time.perf_counter()
    first = last = -1.0
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            now = time.perf_counter()
            if d.get("choices") and d["choices"][0].get("text") is not None:
                if first < 0:
                    first = now
                last = now
                if chunks is not None:
                    chunks.append(now)
            if d.get("usage"):
                tokens = int(d["usage"].get("completion_tokens", 0))
    t1 = time.perf_counter()
    if first < 0:
        first = last = t1
    return first - t0, t1 - t0, tokens, last - t0


def fit_prefill(ttfts: dict[int, float]) -> tuple[float, list[dict[str, float]]]:
    """``ttft(n) = overhead + a n + b n^2`` by non-negative least squares on relative error
    (a loaded machine makes single points noisy; the curve must rise, and long prompts must
    not drown the short ones). Returns (overhead_s, points in ms)."""
    import numpy as np

    ns = np.asarray(sorted(ttfts), dtype=float)
    ys = np.asarray([ttfts[int(n)] for n in ns])
    best: tuple[float, np.ndarray] | None = None
    for cols in ((0, 1, 2), (0, 1), (1, 2), (1,)):
        a = np.stack([ns**c for c in cols], axis=1)
        coef, *_ = np.linalg.lstsq(a / ys[:, None], np.ones_like(ys), rcond=None)
        if (coef < 0).any():
            continue
        err = float((((a @ coef) / ys - 1.0) ** 2).sum())
        full = np.zeros(3)
        full[list(cols)] = coef
        if best is None or err < best[0]:
            best = (err, full)
    assert best is not None
    c0, c1, c2 = best[1]
    pts = [{"tokens": int(n), "ms": max(0.05, 1000.0 * float(c1 * n + c2 * n * n))} for n in ns]
    return float(c0), pts


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 20000) for _ in range(n)]


def _node_state(resp: Any, url: str, token_sent: bool) -> dict[str, Any]:
    """The node's ``/load`` state, or a :class:`CLIError` saying why it gave none."""
    from gateway.cli import CLIError

    if resp.status_code in (401, 403):
        hint = "the node token it was given" if token_sent else "a node token"
        raise CLIError(
            f"{url} refused /load ({resp.status_code}): it wants {hint}; pass --node-token "
            "or set EDGECLOUD_NODE_TOKEN to the token the node was started with"
        )
    try:
        state = resp.json()
    except ValueError:
        state = None
    if resp.status_code != 200 or not isinstance(state, dict) or not state.get("models"):
        raise CLIError(
            f"{url}/load answered {resp.status_code} without a node's state: is it an "
            "edgecloud edge or cloud node (not a gateway)?"
        )
    return state


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from routing.sim.profiles import profile_name

    url = args.node.rstrip("/")
    rng = random.Random(args.seed)
    import os

    token = args.node_token or os.environ.get("EDGECLOUD_NODE_TOKEN")
    headers = {"x-edgecloud-node-token": token} if token else {}
    async with httpx.AsyncClient(timeout=600.0, headers=headers) as client:
        state = _node_state(await client.get(url + "/load"), url, bool(token))
        model = state["models"][0]
        kind = state["kind"]
        max_ctx = int(state["max_context"])
        slots = int(state["max_batch"])
        # warm up
        await _stream(client, url, model, _ids(rng, 32), 4, 1)
        lengths = args.prefill or [16, 64, 256, 512, 1024, 2048, 4096]
        lengths = [n for n in lengths if n + 2 <= max_ctx]
        ttfts: dict[int, float] = {}
        for n in lengths:
            xs = []
            for k in range(args.repeats):
                t, _, _, _ = await _stream(client, url, model, _ids(rng, n), 1, k)
                xs.append(t)
            ttfts[n] = statistics.median(xs)
            print(f"prefill {n:5d} tokens: ttft {ttfts[n] * 1000:8.1f} ms", flush=True)
        overhead, prefill = fit_prefill(ttfts)
        batches = args.batches or [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= slots]
        decode = []
        for ctx in args.contexts:
            if ctx + args.decode_tokens + 2 > max_ctx:
                continue
            for b in batches:
                runs = [
                    _stream(client, url, model, _ids(rng, ctx), args.decode_tokens, 100 + i)
                    for i in range(b)
                ]
                res = await asyncio.gather(*runs)
                per = [(last - ttft) * 1000.0 / (tok - 1) for ttft, _, tok, last in res if tok > 2]
                if per:
                    ms = statistics.median(per)
                    decode.append({"batch": b, "context": ctx, "ms_per_step": ms})
                    print(f"decode batch {b:3d} ctx {ctx:5d}: {ms:7.2f} ms/step", flush=True)
        # prefix hit: a long prompt twice
        n = min(1024, max_ctx - 8)
        ids = _ids(rng, n)
        cold, _, _, _ = await _stream(client, url, model, ids, 1, 0)
        warm, _, _, _ = await _stream(client, url, model, ids, 1, 0)
        speedup = cold / max(warm, 1e-6)
        print(f"prefix hit ({n} tokens): cold {cold * 1000:.1f} ms, warm {warm * 1000:.1f} ms")
        # after the runs: a node that reads RAPL has learned its watts by now
        state = _node_state(await client.get(url + "/load"), url, bool(token))
    device = str(state.get("device", ""))
    return {
        "name": args.name or profile_name(kind, model, device),
        "kind": "edge" if kind == "edge" else "cloud",
        "device": device,
        "model": model,
        "source": "measured",
        "notes": args.notes,
        "slots": slots,
        "chunk_tokens": 256,
        # the engines' own defaults: the cloud engine plans 8,192 tokens a step on CUDA
        "max_tokens_per_step": 8192 if "cuda" in str(state.get("device", "")) else 1024,
        "kv_blocks": int(state.get("kv_blocks_total", 0)),
        "max_context": max_ctx,
        "overhead_ms": 0.0,
        "request_overhead_ms": overhead * 1000.0,
        "prefill": prefill,
        "decode": decode,
        "prefix_hit_speedup": speedup,
        "watts_idle": state.get("watts_idle"),
        "watts_load": state.get("watts_load"),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from routing.sim.profiles import NodeProfile, save_profile

    data = asyncio.run(measure(args))
    prof = NodeProfile.model_validate(data)
    out = Path(args.out)
    if out.is_dir() or args.out.endswith("/"):
        out = out / f"{prof.name}.json"
    save_profile(prof, out)
    print(f"wrote {out} ({prof.device or 'device unknown'})")
    return 0
