"""The example YAML files load and validate (they are what a new user copies)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from gateway.front.config import load_gateway_config
from routing.policy_config import PolicyConfig, load_config
from tests.nodes import REPO

EXAMPLES = REPO / "examples"


def test_gateway_example_is_a_two_region_redis_fleet_with_geo_keys_and_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EDGECLOUD_AUTH_SALT", secrets.token_urlsafe(32))  # as its comment says
    cfg = load_gateway_config(EXAMPLES / "gateway.yaml")
    assert cfg.redis_url and cfg.redis_url.startswith("rediss://")
    assert set(cfg.geo.countries.values()) == {"eu-west", "us-east"}
    assert cfg.auth.is_enabled and cfg.auth.keys and cfg.auth.admin_keys
    assert any(k.rpm for k in cfg.auth.keys) and cfg.auth.default_rpm
    cfg.check_exposure()  # 0.0.0.0 is allowed: auth is on
    assert cfg.observability == "loopback"


def test_gateway_example_publishes_no_salt_and_refuses_the_one_it_once_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (EXAMPLES / "gateway.yaml").read_text()
    assert "salt:" not in text and "token_urlsafe" in text
    monkeypatch.delenv("EDGECLOUD_AUTH_SALT", raising=False)
    with pytest.raises(ValueError, match=r"auth\.salt is too weak"):
        load_gateway_config(EXAMPLES / "gateway.yaml")  # no salt given
    old = tmp_path / "gateway.yaml"
    old.write_text(
        text.replace("auth:\n", "auth:\n  salt: change-me-to-a-long-random-salt-0123456789\n")
    )
    with pytest.raises(ValueError, match="well-known or published secret"):
        load_gateway_config(old)


def test_policy_example_has_every_knob_at_its_default() -> None:
    cfg = load_config(EXAMPLES / "policy.yaml")
    assert cfg == PolicyConfig()
    text = (EXAMPLES / "policy.yaml").read_text()
    for name in PolicyConfig.model_fields:
        assert f"\n{name}:" in text, name
