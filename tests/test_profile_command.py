"""`edgecloud profile` against a real node on loopback, and its prefill fit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from gateway.commands.profile import fit_prefill
from routing.sim.profiles import load_profile
from tests.nodes import cli, serve_node, tiny_cloud_engine


def test_prefill_fit_rises_and_keeps_the_fixed_cost_apart() -> None:
    # 20 ms of fixed cost and 2 us a token, with one noisy point (256 tokens came in fast):
    # the two-point fit this replaced clipped every prompt past it to nothing
    ttfts = {16: 0.0232, 64: 0.0235, 256: 0.0169, 512: 0.0223, 1024: 0.0165, 2048: 0.0291,
             4096: 0.0327, 8000: 0.0384}  # fmt: skip
    overhead, points = fit_prefill(ttfts)
    assert 0.012 < overhead < 0.024
    ms = [p["ms"] for p in points]
    assert ms == sorted(ms) and ms[-1] > 10 * ms[2] > 0


def test_profile_command_measures_a_live_node(tiny_model_path: Path, tmp_path: Path) -> None:
    node = serve_node(tiny_cloud_engine(tiny_model_path), tiny_model_path, "cloud-profiled")
    out = tmp_path / "profile.json"
    try:
        args = ["profile", "--node", node.url, "--out", str(out), "--prefill", "16", "64", "256"]
        args += ["--batches", "1", "2", "--contexts", "64", "--decode-tokens", "8"]
        done = subprocess.run(cli(*args, "--repeats", "1"), capture_output=True, text=True)
    finally:
        node.stop()
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["kind"] == "cloud" and data["source"] == "measured"
    assert [p["tokens"] for p in data["prefill"]] == [16, 64, 256]
    assert [(d["batch"], d["context"]) for d in data["decode"]] == [(1, 64), (2, 64)]
    assert all(d["ms_per_step"] > 0 for d in data["decode"])
    assert data["max_tokens_per_step"] == 1024  # a CPU node's step budget
    profile = load_profile(out)  # the simulator reads what it wrote
    ms = [p.ms for p in profile.prefill]
    assert ms == sorted(ms) and ms[-1] > 0


@pytest.mark.parametrize("url", ["http://127.0.0.1:9"])  # nothing listens on port 9
def test_profile_of_an_unreachable_node_is_one_clear_error(url: str, tmp_path: Path) -> None:
    done = subprocess.run(
        cli("profile", "--node", url, "--out", str(tmp_path / "p.json")),
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert url in done.stderr or "connect" in done.stderr.lower()


def test_profile_of_a_node_that_wants_a_token_says_so(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    node = serve_node(
        tiny_cloud_engine(tiny_model_path), tiny_model_path, "cloud-locked",
        node_token="profile-Tok-9q2Z7xW4mK8vR3nL5j",
    )  # fmt: skip
    try:
        done = subprocess.run(
            cli("profile", "--node", node.url, "--out", str(tmp_path / "p.json")),
            capture_output=True, text=True, env={**os.environ, "EDGECLOUD_NODE_TOKEN": ""},
        )  # fmt: skip
    finally:
        node.stop()
    assert done.returncode != 0 and "internal error" not in done.stderr, done.stderr
    assert "401" in done.stderr and "--node-token" in done.stderr
    assert not (tmp_path / "p.json").exists()
