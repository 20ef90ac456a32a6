"""Traces: the importers on the real files (counts and token sums), the JSONL format, rescaling
and the morning-peak generator."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest

from routing.sim.generator import MorningPeak, generate, shape
from routing.sim.importers import import_azure, import_mooncake
from routing.sim.trace import read_trace, rescale_length, rescale_time, summary, write_trace
from tests.conftest import SHARED_DATA

TRACES = SHARED_DATA / "traces"
needs_traces = pytest.mark.skipif(not TRACES.exists(), reason="shared traces not mounted")


def _csv_sums(path: Path) -> tuple[int, int, int]:
    n = p = o = 0
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            n += 1
            p += int(row["ContextTokens"])
            o += max(1, int(row["GeneratedTokens"]))
    return n, p, o


@needs_traces
@pytest.mark.parametrize("name,count", [("code", 8819), ("conv", 19366)])
def test_azure_import_counts_and_sums(name: str, count: int) -> None:
    path = TRACES / f"AzureLLMInferenceTrace_{name}.csv"
    tr = import_azure(path, regions=["eu-west", "us-east"], seed=1)
    n, p, o = _csv_sums(path)
    assert len(tr) == n == count
    assert sum(r.prompt_tokens for r in tr) == p
    assert sum(r.output_tokens for r in tr) == o
    assert tr[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(tr))
    assert 55 * 60 < tr[-1].arrival_s < 60 * 60
    assert {r.region for r in tr} == {"eu-west", "us-east"}
    again = import_azure(path, regions=["eu-west", "us-east"], seed=1)
    assert [r.region for r in again] == [r.region for r in tr]


@needs_traces
def test_mooncake_import_counts_sums_and_prefixes() -> None:
    path = TRACES / "mooncake_conversation_trace.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tr = import_mooncake(path)
    assert len(tr) == len(rows) == 12031
    assert sum(r.prompt_tokens for r in tr) == sum(d["input_length"] for d in rows)
    assert sum(r.output_tokens for r in tr) == sum(max(1, d["output_length"]) for d in rows)
    assert all(r.hash_block_tokens == 512 for r in tr)
    ids = [h for r in tr for h in (r.hash_ids or [])]
    repeated = 1 - len(set(ids)) / len(ids)
    assert 0.30 < repeated < 0.45  # the README says 37% of blocks are repeats


def test_jsonl_round_trip_and_rescale(tmp_path: Path) -> None:
    tr = generate(MorningPeak(people=50, duration_s=600.0), seed=3)
    path = tmp_path / "t.jsonl"
    assert write_trace(path, tr) == len(tr)
    back = read_trace(path)
    assert back == tr
    slow = rescale_time(tr, 2.0)
    assert slow[-1].arrival_s == pytest.approx(2 * (tr[-1].arrival_s - tr[0].arrival_s))
    short = rescale_length(tr, 0.5, 0.5)
    assert all(
        s.prompt_tokens == max(1, round(r.prompt_tokens * 0.5))
        for s, r in zip(short, tr, strict=False)
    )
    assert all(s.hash_block_tokens == 32 for s in short)
    assert summary(short)["requests"] == len(tr)


def test_morning_peak_shape_and_determinism() -> None:
    spec = MorningPeak(people=200)
    a, b = generate(spec, seed=7), generate(spec, seed=7)
    assert a == b and a != generate(spec, seed=8)
    assert shape(8 * 3600, 0.1) == 0.1 and shape(9.25 * 3600, 0.1) == 1.0
    before = sum(1 for r in a if r.arrival_s < 1800)  # 08:00-08:30
    peak = sum(1 for r in a if 3600 <= r.arrival_s < 5400)  # 09:00-09:30
    assert peak > 4 * before
    kinds = {r.kind for r in a}
    assert kinds == {"chat", "code", "automation"}
    code = [r for r in a if r.kind == "code"]
    auto = [r for r in a if r.kind == "automation"]
    assert min(r.prompt_tokens for r in code) > max(r.prompt_tokens for r in auto) / 4
    assert all(r.output_tokens <= 64 for r in auto)
    # chats of one app share the app's system prompt blocks
    chats = [r for r in a if r.kind == "chat" and r.api_key == "chat-0"]
    assert len({tuple(r.hash_ids[:6]) for r in chats}) == 1  # type: ignore[index]
