"""The simulator against hand-computed cases (batching, slots, prefix cache, LRU eviction, a
run of decode steps cut by an arrival) and its determinism."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from routing.policy_config import PolicyConfig
from routing.sim.fleet import FleetSpec, load_fleet
from routing.sim.generator import MorningPeak, generate
from routing.sim.metrics import summarize
from routing.sim.simulator import Simulator, simulate
from routing.sim.trace import TraceRequest

FLEETS = Path(__file__).resolve().parent.parent / "routing" / "sim" / "fleets"


def _profile(tmp: Path, kind: str, **kw: object) -> str:
    """1 ms per prompt token, 10 ms per decode step whatever the batch, no overheads."""
    data = {
        "name": f"hand-{kind}",
        "kind": kind,
        "source": "synthetic",
        "slots": 8,
        "chunk_tokens": 256,
        "max_tokens_per_step": 1024,
        "kv_blocks": 1000 if kind == "cloud" else 0,
        "max_context": 8192,
        "prefill": [{"tokens": 1000, "ms": 1000.0}, {"tokens": 2000, "ms": 2000.0}],
        "decode": [
            {"batch": 1, "context": 16, "ms_per_step": 10.0},
            {"batch": 64, "context": 16, "ms_per_step": 10.0},
        ],
        **kw,
    }
    path = tmp / f"{kind}.json"
    path.write_text(json.dumps(data))
    return str(path)


def _local_fleet(nodes: list[dict[str, object]], **top: object) -> FleetSpec:
    """One region, one gateway with no overhead, ``nodes`` (id, kind, profile, ...)."""
    return FleetSpec.model_validate(
        {
            "regions": {"intra_region_ms": 1e-6},
            "gateways": [{"region": "local", "overhead_ms": 0.0}],
            "nodes": [{"region": "local", **n} for n in nodes],
            **top,
        }
    )


def _fleet(tmp: Path, kind: str, **kw: object) -> FleetSpec:
    return _local_fleet([{"id": "n", "kind": kind, "profile": _profile(tmp, kind, **kw)}])


def _req(t: float, prompt: int, out: int, **kw: object) -> TraceRequest:
    return TraceRequest(arrival_s=t, prompt_tokens=prompt, output_tokens=out, **kw)


def _run(fleet: FleetSpec, trace: list[TraceRequest], policy: str = "latency"):
    return simulate(trace, fleet, PolicyConfig(), policy=policy)


def test_cloud_batches_prefills_then_decodes(tmp_path: Path) -> None:
    res = _run(_fleet(tmp_path, "cloud"), [_req(0, 32, 5), _req(0, 32, 5)])
    # A wakes the idle engine alone: prefill 32 ms (first token). B joins the next step:
    # A's decode row (10 ms) plus B's 32 prompt tokens, 74 ms; then both decode together:
    # A's last three tokens at 84, 94, 104 ms, B's last four at 84 .. 114 ms.
    assert res.ttft_s == pytest.approx([0.032, 0.074], abs=1e-6)
    assert res.e2e_s == pytest.approx([0.104, 0.114], abs=1e-6)


def test_edge_slot_queueing(tmp_path: Path) -> None:
    res = _run(_fleet(tmp_path, "edge", slots=1), [_req(0, 32, 3), _req(0, 32, 3)])
    # A: prefill 32 ms (first token), the same loop decodes once (42), once more (52): done.
    # B waits for the slot: prefill 52..84, decode 94, 104.
    assert res.ttft_s == pytest.approx([0.032, 0.084], abs=1e-6)
    assert res.e2e_s == pytest.approx([0.052, 0.104], abs=1e-6)


def test_edge_prompt_beside_a_decoding_answer_goes_in_small_chunks(tmp_path: Path) -> None:
    trace = [_req(0, 16, 100), _req(0.1, 100, 2)]
    res = _run(_fleet(tmp_path, "edge", slots=2, prefill_stall_ratio=1.0), trace)
    # A: prefill 16 ms and a decode step (26), then steps every 10 ms. B arrives at 100 ms and
    # is admitted at the boundary at 106 ms. Beside A's row a chunk takes at most one decode
    # step: 10 tokens at the measured 1 ms a token, raised to the 16-token minimum. B's first
    # chunk (16 ms) and A's step: 132; five more, each a run of its own 1/16 of a full chunk
    # long (16 ms + 15/16 of a 10 ms run's fixed cost) and A's step: 308.875; its last 4
    # tokens (4 + 9.375): B's first token at 322.25 ms.
    assert res.ttft_s[1] == pytest.approx(0.32225 - 0.1, abs=1e-6)
    # full chunks: all 100 tokens at once, first token at 206 ms
    res = _run(_fleet(tmp_path, "edge", slots=2, prefill_stall_ratio=None), trace)
    assert res.ttft_s[1] == pytest.approx(0.206 - 0.1, abs=1e-6)


def test_edge_runs_a_block_beside_each_decode_step(tmp_path: Path) -> None:
    """Beside A's decoding row each loop runs one block of B's 300-token prompt (16 tokens, a
    decode step's worth at stall ratio 1) and A's step: A's answer slows to about 31 ms a
    token while B prefills."""
    trace = [_req(0, 16, 10), _req(0.02, 300, 2)]
    every = _run(_fleet(tmp_path, "edge", slots=2, prefill_stall_ratio=1.0), trace)
    # A's first token at 16 ms, then nine steps: about 31 ms each with a block each step
    assert every.e2e_s[0] == pytest.approx(0.2996, abs=1e-3)


def test_edge_copies_a_prefix_from_a_running_request(tmp_path: Path) -> None:
    g = {"prefix_group": "sys", "prefix_tokens": 48}
    trace = [_req(0, 64, 100, **g), _req(0.2, 64, 2, **g)]
    res = _run(_fleet(tmp_path, "edge", slots=2), trace)
    # A runs in slot 0 with its prompt written; B takes slot 1 with A's three shared blocks
    # copied (as the edge engine does) and prefills only its last 16 tokens
    assert res.cached_tokens == [0, 48]


def test_edge_catches_up_on_a_prefix_written_after_admission(tmp_path: Path) -> None:
    g = {"prefix_group": "sys", "prefix_tokens": 288}
    trace = [_req(0, 320, 2, **g), _req(0, 320, 2, **g)]
    res = _run(_fleet(tmp_path, "edge", slots=2), trace)
    # both take a slot at once, before A has written anything; A (older) prefills first, and
    # before B's first chunk its 18 shared blocks are copied in (as the edge engine does)
    assert res.cached_tokens == [0, 288]
    assert res.ttft_s[1] < res.ttft_s[0] + 0.320 - 0.250


def test_edge_admits_first_the_request_that_reuses_the_freed_slot(tmp_path: Path) -> None:
    g = {"prefix_group": "sys", "prefix_tokens": 96}
    trace = [_req(0, 112, 5, **g), _req(0.001, 64, 2), _req(0.002, 112, 2, **g)]
    res = _run(_fleet(tmp_path, "edge", slots=1), trace)
    # A's slot keeps the six shared blocks when it ends; C (behind B) reuses them and goes
    # first, as the edge engine orders its queue by itself; in arrival order B would
    # overwrite them
    assert res.cached_tokens == [0, 0, 96]
    assert res.ttft_s[2] + 0.002 < res.ttft_s[1] + 0.001


def test_edge_admits_first_the_request_whose_prefix_a_busy_slot_holds(tmp_path: Path) -> None:
    g = {"prefix_group": "sys", "prefix_tokens": 96}
    # A (unrelated, ending after C has prefilled) and C (the app prompt, a long answer) fill
    # both slots; B (unrelated) and then D (the app prompt) wait
    trace = [_req(0, 64, 30), _req(0, 112, 400, **g), _req(0.001, 64, 2), _req(0.002, 112, 2, **g)]
    res = _run(_fleet(tmp_path, "edge", slots=2), trace)
    # A's free slot keeps nothing D reuses, C's busy one its six blocks: D goes first, copies
    # them and computes only its question, as the edge engine orders its queue
    assert res.cached_tokens == [0, 0, 0, 96]
    assert res.ttft_s[3] + 0.002 < res.ttft_s[2] + 0.001


def test_cloud_prefix_cache_hit(tmp_path: Path) -> None:
    g = {"prefix_group": "sys", "prefix_tokens": 320}
    res = _run(_fleet(tmp_path, "cloud"), [_req(0, 320, 2, **g), _req(1.0, 320, 2, **g)])
    assert res.ttft_s[0] == pytest.approx(0.320, abs=1e-6)
    # 19 of 20 blocks reused (at least one token is computed): 16 tokens to prefill
    assert res.cached_tokens == [0, 304]
    assert res.ttft_s[1] == pytest.approx(0.016, abs=1e-6)


def test_cloud_lru_eviction_drops_the_prefix(tmp_path: Path) -> None:
    g = {"prefix_group": "sys", "prefix_tokens": 320}
    other = {"prefix_group": "other", "prefix_tokens": 320}
    trace = [_req(0, 320, 2, **g), _req(1.0, 320, 2, **other), _req(2.0, 320, 2, **g)]
    res = _run(_fleet(tmp_path, "cloud", kv_blocks=30), trace)
    # the pool holds 30 blocks: the second prompt (21 blocks) evicts the first one's cache
    assert res.cached_tokens == [0, 0, 0]
    res = _run(_fleet(tmp_path, "cloud", kv_blocks=60), trace)
    assert res.cached_tokens == [0, 0, 304]


def test_arrival_cuts_a_decode_run_at_the_next_step(tmp_path: Path) -> None:
    res = _run(_fleet(tmp_path, "cloud"), [_req(0, 16, 100), _req(0.2055, 16, 2)])
    # A: first token at 16 ms, then steps end at 26, 36, ...; B arrives at 205.5 ms, is
    # admitted at the boundary at 206 ms, and that step (A's decode 10 + B's 16 tokens) ends
    # at 232 ms with B's first token. A's 99 decode steps plus the mixed one: 16 + 99*10 + 16.
    assert res.ttft_s[1] == pytest.approx(0.232 - 0.2055, abs=1e-6)
    assert res.e2e_s[0] == pytest.approx(0.016 + 0.990 + 0.016, abs=1e-6)


def test_deterministic_for_a_seed() -> None:
    fleet = load_fleet(FLEETS / "test_fleet.yaml")
    trace = generate(MorningPeak(people=60, regions=("eu-west",), region_weights=(1,)), seed=2)
    trace = [r for r in trace if 3600 <= r.arrival_s < 4200]
    a = simulate(trace, fleet, PolicyConfig(), seed=5)
    b = simulate(trace, fleet, PolicyConfig(), seed=5)
    assert a.ttft_s == b.ttft_s and a.e2e_s == b.e2e_s and a.node == b.node
    assert not any(math.isnan(x) for x in a.e2e_s)
    s = summarize(a)
    assert s["failed"] == 0 and s["prefix_hit_rate"] > 0.2


_ACROSS_PROCESSES = """
import json, sys
from pathlib import Path
from routing.policy_config import PolicyConfig
from routing.sim.fleet import load_fleet
from routing.sim.generator import MorningPeak, generate
from routing.sim.simulator import simulate
trace = generate(MorningPeak(people=80, duration_s=3600.0), seed=3)
fleet = load_fleet(Path(sys.argv[1]))
r = simulate(trace, fleet, PolicyConfig(), seed=3, policy="threshold")
print(json.dumps([r.node, r.e2e_s, r.predicted_ttft_s, r.predicted_e2e_s]))
"""


def test_deterministic_across_processes() -> None:
    """Two interpreters with different string-hash seeds give the same result, predictions to
    the last bit (nothing iterates a set of node ids in hash order)."""
    import os
    import subprocess
    import sys

    fleet = str(FLEETS / "morning_peak_fleet.yaml")
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        cmd = [sys.executable, "-c", _ACROSS_PROCESSES, fleet]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True)
        outs.append(json.loads(run.stdout))
    assert len(outs[0][0]) > 300 and outs[0] == outs[1]


def test_counting_in_flight_dispatches_stops_herding(tmp_path: Path) -> None:
    edges = {"id": "e", "kind": "edge", "count": 2, "profile": _profile(tmp_path, "edge", slots=4)}
    fleet = _local_fleet([edges], push_interval_s=5.0)
    burst = [_req(1.0 + 0.001 * i, 200, 50) for i in range(8)]
    counted = simulate(burst, fleet, PolicyConfig(), push_interval_s=5.0)
    blind = simulate(burst, fleet, PolicyConfig(), push_interval_s=5.0, count_in_flight=False)
    assert sorted(counted.node.count(i) for i in (0, 1)) == [4, 4]
    assert sorted(blind.node.count(i) for i in (0, 1)) == [0, 8]  # all on the node that looked idle
    assert max(counted.ttft_s) < max(blind.ttft_s)


def test_warm_nodes_report_their_profiles_rates_from_the_start(tmp_path: Path) -> None:
    slow = [{"tokens": 1000, "ms": 5000.0}, {"tokens": 2000, "ms": 10000.0}]  # 200 tokens/s
    fleet = _local_fleet(
        [
            {"id": "e", "kind": "edge", "profile": _profile(tmp_path, "edge")},
            {"id": "c", "kind": "cloud", "profile": _profile(tmp_path, "cloud", prefill=slow)},
        ]
    )
    warm = Simulator(fleet, PolicyConfig(), warm_prompts=(24, 200))
    cold = Simulator(fleet, PolicyConfig())
    # the edge's 1 ms and the cloud's 5 ms a prompt token, 10 ms a decode step, as measured
    assert [s.prefill_tokens_per_s for s in warm.states] == pytest.approx([1000.0, 200.0])
    assert [s.decode_ms_per_token for s in warm.states] == pytest.approx([10.0, 10.0])
    assert [s.prefill_tokens_per_s for s in cold.states] == [0.0, 0.0]
    # a cold fleet is judged by the kinds' defaults (a cloud prefills at GPU speed), so the
    # slow cloud gets the first prompt (500 ms there against 100 on the edge); a warm one not
    first = [_req(0, 100, 4, stream=True)]
    assert simulate(first, fleet, PolicyConfig()).node == [1]
    warmed = simulate(first, fleet, PolicyConfig(), warm_prompts=(24, 200))
    assert warmed.node == [0] and warmed.ttft_s[0] == pytest.approx(0.1, abs=1e-3)
    # given rates (a live run's first reports) replace the profile's, for the nodes named
    given = Simulator(fleet, PolicyConfig(), warm_prompts=(24, 200), warm_rates={"c": (50.0, 80.0)})
    assert [s.prefill_tokens_per_s for s in given.states] == pytest.approx([1000.0, 50.0])
    assert [s.decode_ms_per_token for s in given.states] == pytest.approx([10.0, 80.0])


def test_prefix_first_picks_the_longest_match_before_any_barrier() -> None:
    from routing.admission import prefix_first

    assert prefix_first([(0, 0), (5, 0), (3, 0)], limit=4) == 1
    assert prefix_first([(0, 0), (3, 0)], limit=4) == 0  # 3 blocks more are not worth it
    assert prefix_first([(0, 0), (5, 0), (9, 0), (12, 0)], limit=4) == 2  # 12 < 9 + 4
    assert prefix_first([(0, 4), (9, 0)], limit=4) == 0  # the head was passed its limit
    assert prefix_first([(0, 0), (1, 4), (9, 0)], limit=4) == 0  # a barrier before the match
    assert prefix_first([(0, 0)] * 40 + [(9, 0)], limit=4) == 0  # beyond the window
