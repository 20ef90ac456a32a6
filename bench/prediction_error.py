"""Predicted against measured latency on the embedded default, per tier and concurrency.

Starts ``edgecloud serve`` (edge node, cloud node, gateway with the in-process store) and
replays a seeded mix of chats through it at each ``--concurrency``:

- ``short``: one short question, ``max_tokens`` 16 or 32;
- ``long``: a unique document of ~700-1,300 tokens to summarize, ``max_tokens`` 16;
- ``shared``: one long system prompt shared by every request of the class (its prefix is
  cached after the first) and a short question, ``max_tokens`` 16 or 32;
- ``followup``: the third turn of a chat whose first two turns were sent before (the node that
  served them may hold the prefix).

Half of the requests stream. Every sample keeps the client's clock when it was sent, and the
follow-ups' earlier turns are kept too (class ``turn``, not counted), so the JSON holds each
node's whole timeline. For each request the gateway's prediction
(``x-edgecloud-predicted-ttft-ms`` / ``-e2e-ms``) is compared with what the client measured:
TTFT at the first content chunk of a stream (for a reply sent whole, the gateway's
``x-edgecloud-measured-ttft-ms``, the node's first-token time) and the end-to-end time.
The first ``--warmup`` requests (at concurrency 1) are not counted: the model learns each
node's rates from them. Errors are relative: ``|predicted - measured| / measured``.

    python bench/prediction_error.py --concurrency 1 4 16 --requests 48

"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import RAW, machine, recorded_command, table
from bench._common import write_results as write_summary
from bench._serve import embedded_default

WORDS = [
    "system",
    "network",
    "latency",
    "cache",
    "region",
    "request",
    "model",
    "token",
    "answer",
    "office",
    "morning",
    "report",
    "budget",
    "meeting",
    "schedule",
    "project",
    "customer",
    "invoice",
    "policy",
    "review",
    "update",
]
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many days are in a week?",
    "Give me a synonym for happy.",
    "What is two plus two?",
    "Translate 'good morning' to Spanish.",
    "What colour is the sky on a clear day?",
    "Who wrote Romeo and Juliet?",
]
SYSTEM = " ".join(
    f"Rule {i}: answer the user briefly, politely and precisely, citing the office handbook."
    for i in range(60)
)


@dataclass
class Sample:
    cls: str
    concurrency: int
    variant: str
    stream: bool
    tier: str
    status: int
    predicted_ttft_ms: float
    predicted_e2e_ms: float
    measured_ttft_ms: float | None
    measured_e2e_ms: float
    cached_tokens: int
    completion_tokens: int
    max_tokens: int
    predicted_queue_ms: float = float("nan")
    in_hand: int = -1
    credited_tokens: int = -1  # what the router credited (x-edgecloud-credited-tokens)
    expected_output_tokens: float = float("nan")
    predicted_prefill_ms: float = float("nan")  # the router's own-prompt compute
    node_prefill_ms: float = float("nan")  # the node's (the rest of its TTFT was waiting)
    node_ttft_ms: float = float("nan")  # the node's own time to first token
    prompt_tokens: int = 0
    sent_at_s: float = 0.0  # the client's clock (perf_counter) when it was sent
    error: str = ""  # the body of a reply other than 200


# Policy files for --variants (the default policy is the gateway's own).
VARIANTS = {
    # output lengths without the whole prompt's own statistic (its app's and coarser)
    "no_prompt_key": "expected_output:\n  whole_prompt: false\n",
    # an app's requests under one cap pooled (no last-message or prompt-length statistics)
    "app_output_keys": "expected_output:\n  last_message: false\n  length_bucket: false\n",
    # the delay a request's prefill adds to the requests decoding on a node counted beside its own
    "interference": "interference_weight: 1\n",
}
# Node variants for --variants: flags of ``edgecloud serve`` (the default policy).
SERVE_VARIANTS = {
    # both nodes prefill in full chunks even while answers decode
    "full_chunks": ["--prefill-stall-ratio", "off"],
    # a prompt's chunk gets half / a quarter of a decode step's time while answers decode
    "stall_half": ["--prefill-stall-ratio", "0.5"],
    "stall_quarter": ["--prefill-stall-ratio", "0.25"],
    # the edge decodes 8 answers at once (default 4)
    "edge_slots8": ["--edge-slots", "8"],
    # the CPU cloud node runs up to 8 or 64 sequences at once (default on one thread: 4)
    "cloud_rows8": ["--cloud-max-running", "8"],
    "cloud_rows64": ["--cloud-max-running", "64"],
    # the cloud node on the CPU where the machine also has a GPU
    "cloud_cpu": ["--cloud-device", "cpu"],
}


def document(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(600, 1100)))


def make_request(rng: random.Random, n: int) -> tuple[str, list[dict[str, str]], int]:
    kind = rng.choice(["short", "short", "long", "shared", "followup"])
    if kind == "short":
        return kind, [{"role": "user", "content": rng.choice(QUESTIONS)}], rng.choice([16, 32])
    if kind == "long":
        msg = "Summarize this log in one sentence:\n" + document(rng)
        return kind, [{"role": "user", "content": msg}], 16
    if kind == "shared":
        return (
            kind,
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": rng.choice(QUESTIONS)},
            ],
            rng.choice([16, 32]),
        )
    topic = rng.choice(WORDS)
    conv = [
        {"role": "user", "content": f"Tell me about the {topic} in our office, chat {n}."},
        {"role": "assistant", "content": "It is an important part of how the office works. "},
        {"role": "user", "content": "Why does it matter?"},
        {"role": "assistant", "content": "Because people rely on it every morning. "},
        {"role": "user", "content": rng.choice(QUESTIONS)},
    ]
    return kind, conv, 16


async def send(
    client: httpx.AsyncClient,
    base: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    stream: bool,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "auto",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    error = ""
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            error = (await r.aread()).decode(errors="replace")[:300]
        elif stream:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if ttft is None and any(
                    (c.get("delta") or {}).get("content") for c in obj.get("choices") or ()
                ):
                    ttft = (time.perf_counter() - t0) * 1000
                usage = obj.get("usage") or usage
        else:
            usage = json.loads(await r.aread()).get("usage") or {}
    e2e = (time.perf_counter() - t0) * 1000
    h = r.headers
    if not stream and "x-edgecloud-measured-ttft-ms" in h:
        ttft = float(h["x-edgecloud-measured-ttft-ms"])
    return {
        "sent_at_s": t0,
        "error": error,
        "status": r.status_code,
        "tier": h.get("x-edgecloud-tier", "?"),
        "predicted_ttft_ms": float(h.get("x-edgecloud-predicted-ttft-ms", "nan")),
        "predicted_e2e_ms": float(h.get("x-edgecloud-predicted-e2e-ms", "nan")),
        "predicted_queue_ms": float(h.get("x-edgecloud-predicted-queue-ms", "nan")),
        "in_hand": int(h.get("x-edgecloud-in-hand", "-1")),
        "credited_tokens": int(h.get("x-edgecloud-credited-tokens", "-1")),
        "expected_output_tokens": float(h.get("x-edgecloud-expected-output-tokens", "nan")),
        "predicted_prefill_ms": float(h.get("x-edgecloud-predicted-prefill-ms", "nan")),
        "node_prefill_ms": float(h.get("x-edgecloud-prefill-ms", "nan")),
        "node_ttft_ms": float(h.get("x-edgecloud-node-ttft-ms", "nan")),
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "measured_ttft_ms": ttft,
        "measured_e2e_ms": e2e,
        "cached_tokens": int(
            ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
        ),
        "completion_tokens": int(usage.get("completion_tokens") or 0),
    }


def parse_names(spec: str) -> dict[str, list[str]]:
    """``OLD=NEW,OLD2=NEW2+NEW3`` as old name -> its new names."""
    out: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        old, _, new = part.partition("=")
        out[old] = new.split("+")
    return out


def renamed(samples: list[Sample], names: dict[str, list[str]] | None) -> list[Sample]:
    """``samples`` under the ``names`` given (one copy per new name, the variants not named
    left out); all of them with ``names`` None."""
    if names is None:
        return samples
    return [replace(s, variant=n) for s in samples for n in names.get(s.variant, ())]


async def run_level(
    base: str,
    concurrency: int,
    count: int,
    seed: int,
    variant: str = "default",
    all_streamed: bool = False,
) -> list[Sample]:
    rng = random.Random(seed)
    plan = [make_request(rng, seed * 1000 + i) for i in range(count)]
    # the same draws either way: --streamed all keeps the mix and streams every request
    streams = [rng.random() < 0.5 or all_streamed for _ in range(count)]
    out: list[Sample] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                cls, messages, max_tokens = plan[i]
                if cls == "followup":  # send the first two turns first, as the chat did
                    for k in (1, 3):
                        turn = await send(client, base, messages[:k], 16, all_streamed)
                        out.append(
                            Sample(
                                "turn", concurrency, variant, all_streamed, max_tokens=16, **turn
                            )
                        )
                r = await send(client, base, messages, max_tokens, streams[i])
                out.append(
                    Sample(cls, concurrency, variant, streams[i], max_tokens=max_tokens, **r)
                )

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def rel_errors(samples: list[Sample], metric: str) -> list[float]:
    errs = []
    for s in samples:
        measured = getattr(s, f"measured_{metric}_ms")
        predicted = getattr(s, f"predicted_{metric}_ms")
        if s.status == 200 and measured is not None and measured > 0 and predicted == predicted:
            errs.append(abs(predicted - measured) / measured)
    return errs


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(samples: list[Sample]) -> list[dict[str, Any]]:
    rows = []
    variants = list(dict.fromkeys(s.variant for s in samples))
    levels = sorted({s.concurrency for s in samples})
    for v, c, tier in itertools.product(variants, levels, ("all", "edge", "cloud")):
        sel = [  # the earlier turns of follow-ups are kept for the timeline, not counted
            s
            for s in samples
            if s.variant == v
            and s.concurrency == c
            and s.cls != "turn"
            and (tier == "all" or s.tier == tier)
        ]
        if sel:
            ttft, e2e = rel_errors(sel, "ttft"), rel_errors(sel, "e2e")
            took = [s.measured_e2e_ms for s in sel if s.status == 200]
            rows.append(
                {
                    "variant": v,
                    "concurrency": c,
                    "tier": tier,
                    "requests": len(sel),
                    # what users waited first: mean and p99 end-to-end of the replies
                    "mean_e2e_ms": round(statistics.fmean(took), 1) if took else float("nan"),
                    "p99_e2e_ms": round(quantile(took, 0.99), 1),
                    "ttft_median_err": round(quantile(ttft, 0.5), 3),
                    "ttft_p90_err": round(quantile(ttft, 0.9), 3),
                    "e2e_median_err": round(quantile(e2e, 0.5), 3),
                    "e2e_p90_err": round(quantile(e2e, 0.9), 3),
                    "not_200": sum(s.status != 200 for s in sel),
                }
            )
    return rows


COLUMNS = [  # users' latency first, then the prediction's error
    "variant",
    "concurrency",
    "tier",
    "requests",
    "mean_e2e_ms",
    "p99_e2e_ms",
    "ttft_median_err",
    "ttft_p90_err",
    "e2e_median_err",
    "e2e_p90_err",
    "not_200",
]
# issue 14's goal: median and p90 relative error of predicted TTFT and end-to-end time
GOAL = {"ttft_median_err": 0.25, "ttft_p90_err": 0.5, "e2e_median_err": 0.2, "e2e_p90_err": 0.5}


def goal_cells_met(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Per variant, how many of its all-tier cells (four a concurrency) meet the goal."""
    met: dict[str, int] = {}
    for r in rows:
        if r["tier"] == "all":
            ok = sum(r[k] <= bound for k, bound in GOAL.items())
            met[r["variant"]] = met.get(r["variant"], 0) + ok
    return met


EXPLAIN_COLUMNS = [
    "variant",
    "concurrency",
    "tier",
    "decoded",
    "decode_ratio",
    "rows_sent",
    "rows_seen",
    "rows_recent",
    "e2e_over_half",
    "by_length",
    "decode_slow",
    "decode_fast",
    "first_token",
    "p90_length_known",
    "p90_rate_only",
]


def explain(samples: list[Sample]) -> list[dict[str, Any]]:
    """What the e2e errors are made of, per variant, concurrency and tier (``--pool``):

    - ``decode_ratio``: the geometric mean of measured over predicted ms a token after the
      first, over the replies of 4 tokens or more (``decoded`` of them);
    - ``rows_sent`` / ``rows_seen`` / ``rows_recent``: the mean requests the tier's node (for
      ``all``: the gateway) held when each was sent (itself included), over its decode, and
      over the 10 s before it was sent, from the client's timeline of every request (the
      earlier turns included);
    - ``e2e_over_half``: errors over 0.5, each put down to its answer length (under 0.5 with
      the measured token count at the predicted rate), else a decode 1.5x slower or faster
      than predicted, else its first token;
    - ``p90_length_known`` / ``p90_rate_only``: the e2e p90 had the prediction known the
      answer's length (the predicted first token and rate), and its first token too (only the
      rate a token after the first predicted): what is left to the decode rate alone."""
    rows: list[dict[str, Any]] = []
    ok = [s for s in samples if s.status == 200]
    ends = {id(s): s.sent_at_s + s.measured_e2e_ms / 1000.0 for s in ok}

    def held(pop: list[Sample], start: float, end: float) -> float:
        if end <= start:
            return 0.0
        return sum(max(0.0, min(end, ends[id(x)]) - max(start, x.sent_at_s)) for x in pop) / (
            end - start
        )

    keys = dict.fromkeys(
        (s.variant, s.concurrency, t) for s in ok if s.cls != "turn" for t in (s.tier, "all")
    )
    for v, c, tier in keys:
        # one run's timeline: the same variant, concurrency and node, or all nodes (the
        # gateway's requests; pooled runs overlap in nothing: each run's clock starts its own)
        pop = [s for s in ok if s.variant == v and s.concurrency == c and tier in (s.tier, "all")]
        ratios, sent, seen, recent = [], [], [], []
        causes = dict.fromkeys(["by_length", "decode_slow", "decode_fast", "first_token"], 0)
        length_known, rate_only = [], []
        for s in pop:
            if s.cls == "turn":
                continue
            steps = s.expected_output_tokens - 1.0
            per_token = (s.predicted_e2e_ms - s.predicted_ttft_ms) / max(steps, 1.0)
            decode = per_token * max(s.completion_tokens - 1, 0)
            length_known.append(
                abs(s.predicted_ttft_ms + decode - s.measured_e2e_ms) / s.measured_e2e_ms
            )
            if s.measured_ttft_ms is not None:
                rate_only.append(
                    abs(s.measured_ttft_ms + decode - s.measured_e2e_ms) / s.measured_e2e_ms
                )
            measured = None
            if s.measured_ttft_ms is not None and s.completion_tokens >= 4 and per_token > 0:
                measured = (s.measured_e2e_ms - s.measured_ttft_ms) / (s.completion_tokens - 1)
                ratios.append(math.log(max(measured, 1e-6) / per_token))
                first = s.sent_at_s + s.measured_ttft_ms / 1000.0
                sent.append(s.in_hand + 1.0)
                seen.append(held(pop, first, ends[id(s)]))
                recent.append(held(pop, s.sent_at_s - 10.0, s.sent_at_s))
            if abs(s.predicted_e2e_ms - s.measured_e2e_ms) / s.measured_e2e_ms <= 0.5:
                continue
            with_length = s.predicted_ttft_ms + per_token * max(s.completion_tokens - 1, 0)
            if abs(with_length - s.measured_e2e_ms) / s.measured_e2e_ms <= 0.5:
                causes["by_length"] += 1
            elif measured is not None and measured > 1.5 * per_token:
                causes["decode_slow"] += 1
            elif measured is not None and measured < per_token / 1.5:
                causes["decode_fast"] += 1
            else:
                causes["first_token"] += 1
        mean = statistics.fmean
        rows.append(
            {
                "variant": v,
                "concurrency": c,
                "tier": tier,
                "decoded": len(ratios),
                "decode_ratio": round(math.exp(mean(ratios)), 2) if ratios else float("nan"),
                "rows_sent": round(mean(sent), 2) if sent else float("nan"),
                "rows_seen": round(mean(seen), 2) if seen else float("nan"),
                "rows_recent": round(mean(recent), 2) if recent else float("nan"),
                "e2e_over_half": sum(causes.values()),
                **causes,
                "p90_length_known": round(quantile(length_known, 0.9), 2),
                "p90_rate_only": round(quantile(rate_only, 0.9), 2),
            }
        )
    return rows


async def scrape_gateway(base: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The gateway's running prediction errors (``/metrics``) and its learned rates."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(base + "/metrics")).text
        admin = (await client.get(base + "/admin/nodes")).json()
    metrics = {
        line.split(" ")[0]: line.split(" ")[1]
        for line in text.splitlines()
        if line.startswith("edgecloud_prediction_")
    }
    return metrics, {"latency_model": admin.get("latency_model"), "nodes": admin.get("nodes")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=48, help="counted requests per level")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--streamed",
        choices=["half", "all"],
        default="half",
        help="which requests stream: half of them (the earlier turns of follow-ups sent "
        "whole), or all (the gateway then sees every request's progress token by token)",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["default"],
        choices=["default", *VARIANTS, *SERVE_VARIANTS],
        help="policy or node variants to run one after the other, each on a fresh fleet",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of every variant, pooled (round r runs the mix of --seed + 10 r, the "
        "variants in turn, every other round in reverse order; a p90 over 48 requests moves "
        "by 0.1 from run to run on a 2-core machine)",
    )
    ap.add_argument("--log", type=Path, default=None, help="write serve's output here")
    ap.add_argument(
        "--edge-variant",
        default="auto",
        choices=("auto", "fp32", "int8", "int4"),
        help="serve's --edge-variant in every arm (default auto: the quality gate's pick)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=RAW / "prediction_error.json",
        help="the run's samples (--pool reads them); its summary goes to bench/results/",
    )
    ap.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: summarize the samples of these earlier runs together, per variant "
        "(a p90 over 48 requests is their 5th largest error; pooled runs pin it better)",
    )
    ap.add_argument(
        "--as",
        dest="names",
        nargs="+",
        default=None,
        metavar="OLD=NEW,...",
        help="with --pool, one renaming for each JSON, so that arms of runs that named them "
        "otherwise pool together: each variant named gets the new "
        "name (NEW+NEW2: counted under both), the rest are left out",
    )
    ap.add_argument(
        "--summary",
        default="prediction_error",
        help="the committed summary's name in bench/results/ (a GPU machine's run: "
        "device_prediction_error, beside the CPU one)",
    )
    args = ap.parse_args(argv)
    if args.names is not None and (not args.pool or len(args.names) != len(args.pool)):
        ap.error("--as takes one renaming for each --pool JSON")
    if args.pool:
        pooled: list[Sample] = []
        ran_on: dict[str, Any] | None = None  # the machine the first run was measured on
        for i, f in enumerate(args.pool):
            run = json.loads(f.read_text())
            ran_on = ran_on or run.get("machine")
            known = {f.name for f in fields(Sample)}  # runs from before a field left
            samples = [Sample(**{k: v for k, v in x.items() if k in known}) for x in run["samples"]]
            names = None if args.names is None else parse_names(args.names[i])
            pooled += renamed(samples, names)
        rows = [r for r in summarize(pooled) if r["tier"] == "all"]
        print(table(rows, COLUMNS))
        for variant, met in goal_cells_met(rows).items():
            print(f"{variant}: {met} of {4 * len(args.concurrency)} goal cells met")
        print(table(explain(pooled), EXPLAIN_COLUMNS))
        write_summary_of(rows, args.summary, ran_on)
        return 0

    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    samples: list[Sample] = []
    metrics: dict[str, str] = {}
    learned: dict[str, Any] = {}
    rounds = [
        (r, variant)
        for r in range(args.repeat)
        for variant in (args.variants if r % 2 == 0 else args.variants[::-1])
    ]
    for r, variant in rounds:
        seed = args.seed + 10 * r
        key = variant if r == 0 else f"{variant}#{r}"  # what the gateway learned, per round
        extra: list[str] = []
        if variant in VARIANTS:
            policy = Path(tempfile.mkdtemp(prefix="prediction-error-")) / f"{variant}.yaml"
            policy.write_text(VARIANTS[variant])
            extra = ["--policy-file", str(policy)]
        extra += [*SERVE_VARIANTS.get(variant, []), "--edge-variant", args.edge_variant]
        # every variant gets a fresh fleet (nothing learned or cached carries over), the same mix
        with embedded_default(extra, log_path=args.log) as base:
            all_streamed = args.streamed == "all"
            asyncio.run(run_level(base, 1, args.warmup, seed + 999, variant, all_streamed))
            mine: list[Sample] = []
            for i, c in enumerate(args.concurrency):
                t0 = time.perf_counter()
                mine += asyncio.run(
                    run_level(base, c, args.requests, seed + i, variant, all_streamed)
                )
                took = time.perf_counter() - t0
                print(f"{key}: concurrency {c}: {args.requests} requests in {took:.1f} s")
            m, learned[key] = asyncio.run(scrape_gateway(base))
            metrics.update({f"{key}:{k}": v for k, v in m.items()})
        if args.repeat > 1:
            met = goal_cells_met([x for x in summarize(mine) if x["tier"] == "all"])
            print(f"{key}: {met[variant]} of {4 * len(args.concurrency)} goal cells met alone")
        samples += mine
        # after every round, so that a later round's failure keeps the finished ones
        write_results(args.out, summarize(samples), metrics, learned, samples, args.summary)
    rows = summarize(samples)
    print(table(rows, COLUMNS))
    for variant, met in goal_cells_met(rows).items():
        print(f"{variant}: {met} of {4 * len(args.concurrency)} goal cells met")
    if args.repeat > 1:
        print(table(explain(samples), EXPLAIN_COLUMNS))
    return 0


def write_results(
    out: Path,
    rows: list[dict[str, Any]],
    metrics: dict[str, str],
    learned: dict[str, Any],
    samples: list[Sample],
    summary: str = "prediction_error",
) -> None:
    """The run's JSON so far: its summary rows, what each round's gateway exported and
    learned, and every sample (``--pool`` reads these); its summary as ``summary``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": recorded_command(
                    "prediction_error.py", sys.argv[1:], ("--out", "--log")
                ),
                "machine": machine(),
                "results": rows,
                "gateway_metrics": metrics,
                "learned": learned,
                "samples": [asdict(s) for s in samples],
            },
            indent=1,
        )
    )
    write_summary_of([r for r in rows if r["tier"] == "all"], summary)


def write_summary_of(
    rows: list[dict[str, Any]], name: str = "prediction_error", ran_on: dict[str, Any] | None = None
) -> None:
    """The benchmark's committed summary, ``bench/results/NAME.{json,md}``; ``ran_on``: the
    machine the samples were measured on (default: this one)."""
    command = recorded_command("prediction_error.py", sys.argv[1:], ("--out", "--log"))
    where = ran_on or machine()
    markdown = "\n\n".join([f"# {name}", f"`{command}`", f"Machine: {where}", table(rows, COLUMNS)])
    write_summary(name, {"command": command, "machine": where, "results": rows}, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
