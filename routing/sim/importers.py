"""Importers: the Azure LLM inference 2023 CSVs and the Mooncake conversation JSONL, into
:class:`routing.sim.trace.TraceRequest` lists.

Invariants:
- Request count and token sums are preserved exactly (nothing dropped, nothing clipped);
  arrivals are seconds from the first request.
- Client regions, when several are given, are drawn from a ``random.Random(seed)``: the same
  seed gives the same assignment.
- Mooncake ``hash_ids`` are kept as is with ``hash_block_tokens=512``; the simulator maps each
  512-token block onto 32 of our 16-token blocks.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Sequence
from datetime import datetime

from routing.sim.trace import TraceRequest


def _parse_azure_time(text: str) -> float:
    """``2023-11-16 18:17:03.9799600`` (7 fraction digits) -> POSIX seconds."""
    text = text.strip()
    base, _, frac = text.partition(".")
    t = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp()
    return t + (float("0." + frac) if frac else 0.0)


def _regions(regions: Sequence[str] | None, seed: int) -> tuple[list[str], random.Random]:
    return (list(regions) if regions else ["local"]), random.Random(seed)


def import_azure(
    path: str | os.PathLike[str],
    *,
    regions: Sequence[str] | None = None,
    api_key: str | None = None,
    seed: int = 0,
    stream: bool = True,
) -> list[TraceRequest]:
    """``TIMESTAMP, ContextTokens, GeneratedTokens`` rows; no shared prefixes are known."""
    names, rng = _regions(regions, seed)
    key = api_key or ("azure-" + os.path.basename(str(path)).rsplit("_", 1)[-1].split(".")[0])
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append(
                (
                    _parse_azure_time(row["TIMESTAMP"]),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0] if rows else 0.0
    return [
        TraceRequest(
            arrival_s=t - t0,
            prompt_tokens=max(1, p),
            output_tokens=max(1, o),
            region=names[0] if len(names) == 1 else rng.choice(names),
            api_key=key,
            stream=stream,
            kind="azure",
        )
        for t, p, o in rows
    ]


def import_mooncake(
    path: str | os.PathLike[str],
    *,
    regions: Sequence[str] | None = None,
    api_key: str = "mooncake",
    seed: int = 0,
    stream: bool = True,
) -> list[TraceRequest]:
    """``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (512-token blocks)."""
    names, rng = _regions(regions, seed)
    out: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            out.append(
                TraceRequest(
                    arrival_s=float(d["timestamp"]) / 1000.0,
                    prompt_tokens=max(1, int(d["input_length"])),
                    output_tokens=max(1, int(d["output_length"])),
                    region=names[0] if len(names) == 1 else rng.choice(names),
                    api_key=api_key,
                    stream=stream,
                    kind="mooncake",
                    hash_ids=[int(h) for h in d.get("hash_ids", [])] or None,
                    hash_block_tokens=512,
                )
            )
    out.sort(key=lambda r: r.arrival_s)
    t0 = out[0].arrival_s if out else 0.0
    return [r.model_copy(update={"arrival_s": r.arrival_s - t0}) for r in out] if t0 else out


def import_any(path: str | os.PathLike[str], **kw: object) -> list[TraceRequest]:
    """By extension: ``.csv`` Azure, ``.jsonl`` Mooncake if its first line has ``hash_ids`` or
    ``input_length``, else our own format (a gateway's request log among them: its wall-clock
    arrivals start at 0)."""
    p = str(path)
    if p.endswith(".csv"):
        return import_azure(p, **kw)  # type: ignore[arg-type]
    with open(p) as f:
        first = f.readline()
    if "input_length" in first:
        return import_mooncake(p, **kw)  # type: ignore[arg-type]
    from routing.sim.trace import read_trace

    out = read_trace(p)
    # a gateway's request log (gateway/request_log.py) stamps arrivals with the wall clock
    t0 = out[0].arrival_s if out else 0.0
    if t0 > 86_400.0:
        out = [r.model_copy(update={"arrival_s": r.arrival_s - t0}) for r in out]
    return out
