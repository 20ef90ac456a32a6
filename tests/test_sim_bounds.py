"""The alone-on-the-best-node latency (routing.sim.bounds): hand-computed, and a true lower
bound of what every policy gets in the simulator."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from routing.policy_config import PolicyConfig
from routing.sim.bounds import alone, shared_prefix_tokens
from routing.sim.fleet import load_fleet
from routing.sim.generator import MorningPeak, generate
from routing.sim.simulator import simulate
from routing.sim.trace import TraceRequest
from tests.nodes import cli
from tests.test_sim_engine import FLEETS, _fleet, _req


def test_a_lone_request_costs_what_the_simulator_charges(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, "cloud")  # 1 ms a prompt token, 10 ms a decode step
    trace = [_req(0, 32, 5), _req(10, 48, 3, prefix_group="app", prefix_tokens=32)]
    trace.append(_req(20, 48, 3, prefix_group="app", prefix_tokens=32))
    bound = alone(trace, fleet)
    # the third shares two blocks with the second: 16 uncached tokens; the first two none
    assert bound.cached_tokens.tolist() == [0, 0, 32]
    assert bound.ttft_s == pytest.approx([0.032, 0.048, 0.016], abs=1e-6)
    assert bound.e2e_s == pytest.approx([0.072, 0.068, 0.036], abs=1e-6)
    run = simulate(trace, fleet, PolicyConfig())  # each alone there too: equal
    assert run.e2e_s == pytest.approx(bound.e2e_s.tolist(), abs=1e-6)


def test_shared_blocks_are_only_those_sent_before() -> None:
    a = TraceRequest(arrival_s=0, prompt_tokens=100, output_tokens=1, hash_ids=[7, 8])
    b = TraceRequest(arrival_s=1, prompt_tokens=100, output_tokens=1, hash_ids=[7, 9])
    # 512-token hash blocks cut to the prompt: b shares a's first 6 blocks (96 tokens)
    assert shared_prefix_tokens([a, b]).tolist() == [0, 96]
    assert shared_prefix_tokens([b]).tolist() == [0]


@pytest.mark.parametrize("policy", ["latency", "least_loaded", "cloud_only", "round_robin"])
def test_no_policy_beats_the_bound(policy: str) -> None:
    fleet = load_fleet(FLEETS / "test_fleet.yaml")
    trace = generate(MorningPeak(people=60, regions=("eu-west",), region_weights=(1,)), seed=2)
    trace = [r for r in trace if 3600 <= r.arrival_s < 4200]
    bound = alone(trace, fleet)
    res = simulate(trace, fleet, PolicyConfig(policy=policy))
    e2e, ttft = np.asarray(res.e2e_s), np.asarray(res.ttft_s)
    ok = ~np.isnan(e2e)
    assert ok.sum() > 100
    assert np.all(e2e[ok] >= bound.e2e_s[ok] - 1e-9)
    assert np.all(ttft[ok] >= bound.ttft_s[ok] - 1e-9)
    assert np.all(bound.ttft_s[ok] > 0) and np.all(bound.e2e_s[ok] >= bound.ttft_s[ok])


def test_sim_command_prints_the_bound_and_starts_warm(tmp_path: Path) -> None:
    out = tmp_path / "sums.json"
    args = ["sim", "--trace", "morning-peak", "--people", "40", "--start", "3600"]
    args += ["--duration", "300", "--fleet", str(FLEETS / "test_fleet.yaml"), "--json", str(out)]
    proc = subprocess.run(
        cli(*args, "--policy", "latency", "cloud_only", "--warm-prompts", "24", "200"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no policy beats" in proc.stdout
    sums = json.loads(out.read_text())
    for pol in ("latency", "cloud_only"):
        assert sums[pol]["p99_e2e_s"] >= sums["alone"]["p99_e2e_s"] > 0
        assert sums[pol]["mean_e2e_s"] >= sums["alone"]["mean_e2e_s"]
