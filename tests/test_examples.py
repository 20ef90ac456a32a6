"""The example YAML files load and validate (they are what a new user copies)."""

from __future__ import annotations

from gateway.front.config import load_gateway_config
from routing.policy_config import PolicyConfig, load_config
from tests.nodes import REPO

EXAMPLES = REPO / "examples"


def test_gateway_example_is_a_two_region_redis_fleet_with_geo_keys_and_limits() -> None:
    cfg = load_gateway_config(EXAMPLES / "gateway.yaml")
    assert cfg.redis_url and cfg.redis_url.startswith("rediss://")
    assert set(cfg.geo.countries.values()) == {"eu-west", "us-east"}
    assert cfg.auth.is_enabled and cfg.auth.keys and cfg.auth.admin_keys
    assert any(k.rpm for k in cfg.auth.keys) and cfg.auth.default_rpm
    cfg.check_exposure()  # 0.0.0.0 is allowed: auth is on


def test_policy_example_has_every_knob_at_its_default() -> None:
    cfg = load_config(EXAMPLES / "policy.yaml")
    assert cfg == PolicyConfig()
    text = (EXAMPLES / "policy.yaml").read_text()
    for name in PolicyConfig.model_fields:
        assert f"\n{name}:" in text, name
