"""The policy YAML: validation, defaults, and hot reload on mtime change."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from routing.policy_config import (
    ConfigError,
    ConfigSource,
    PolicyConfig,
    load_config,
    parse_config,
)

FULL = """
policy: threshold
objective: e2e
default_region: eu-west
gateway_region: eu-central
expected_output:
  default_tokens: 64
  alpha: 0.3
threshold:
  prompt_tokens: 256
circuit:
  failure_threshold: 3
  open_s: 5
regions:
  table: {office: [48.86, 2.35]}
  rtt_overrides: [{a: eu-west, b: us-east, ms: 70}]
  unknown_rtt_ms: 100
"""


def write(path: Path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_full_file_parses_into_every_section():
    cfg = parse_config(FULL)
    assert cfg.policy == "threshold" and cfg.objective == "e2e"
    assert cfg.home_region == "eu-central"
    assert cfg.expected_output.default_tokens == 64
    assert cfg.circuit.open_s == 5 and cfg.circuit.half_open_probes == 1  # unset: the default
    assert cfg.threshold.prompt_tokens == 256
    assert cfg.circuit.failure_threshold == 3
    assert cfg.regions.table["office"] == (48.86, 2.35)
    assert cfg.regions.rtt_overrides[0].ms == 70


def test_empty_file_is_all_defaults():
    assert parse_config("") == PolicyConfig()
    assert PolicyConfig().policy == "latency"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("policy: fastest\n", "policy"),
        ("polcy: latency\n", "polcy"),  # a typo is an error, not a silent default
        ("latency: {prefill_pass: on}\n", "latency"),  # a setting that left is an error
        ("threshold: {prompt_tokens: -1}\n", "prompt_tokens"),
        ("- a list\n", "mapping"),
        ("policy: [unclosed\n", "YAML"),
    ],
)
def test_invalid_files_are_rejected(text: str, match: str):
    with pytest.raises(ConfigError, match=match):
        parse_config(text)


def test_missing_file_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_hot_reload_on_mtime_change(tmp_path: Path):
    path = tmp_path / "policy.yaml"
    write(path, "policy: latency\n", 1_000_000_000_000)
    src = ConfigSource(path, check_interval_s=0.0)
    seen = []
    src.on_change(seen.append)
    assert src.current.policy == "latency" and src.version == 0
    assert src.check() is False  # unchanged

    write(path, "policy: round_robin\nthreshold: {prompt_tokens: 99}\n", 2_000_000_000_000)
    assert src.check() is True
    assert src.current.policy == "round_robin" and src.current.threshold.prompt_tokens == 99
    assert src.version == 1 and [c.policy for c in seen] == ["round_robin"]

    # A broken edit keeps the last good config and says why.
    write(path, "policy: nonsense\n", 3_000_000_000_000)
    assert src.check() is False
    assert src.current.policy == "round_robin"
    assert src.last_error and "policy" in src.last_error

    write(path, "policy: cloud_only\n", 4_000_000_000_000)
    assert src.check() is True and src.current.policy == "cloud_only" and src.last_error is None

    path.unlink()
    assert src.check() is False and "missing" in (src.last_error or "")
    assert src.current.policy == "cloud_only"


def test_checks_are_throttled(tmp_path: Path):
    now = [0.0]
    path = tmp_path / "policy.yaml"
    write(path, "policy: latency\n", 1_000_000_000_000)
    src = ConfigSource(path, check_interval_s=5.0, clock=lambda: now[0])
    write(path, "policy: edge_first\n", 2_000_000_000_000)
    now[0] = 1.0
    assert src.check() is False and src.current.policy == "latency"  # not yet looked
    now[0] = 6.0
    assert src.check() is True and src.current.policy == "edge_first"


def test_fixed_source_never_reloads():
    src = ConfigSource.fixed(PolicyConfig(policy="least_loaded"))
    assert src.check() is False and src.current.policy == "least_loaded"
    src.set(PolicyConfig(policy="cloud_only"))
    assert src.current.policy == "cloud_only" and src.version == 1
