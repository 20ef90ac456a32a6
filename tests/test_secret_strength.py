"""Weak secrets are refused by entropy rules, not only a word list (issue 49, item 6): salts
and node tokens typed by a person fail, random ones pass, and no message repeats the secret."""

from __future__ import annotations

import secrets

import pytest

from gateway.api_keys import generate_key, hash_key
from gateway.auth_config import AuthConfig
from gateway.front.config import GatewayConfig
from gateway.secret_strength import PUBLISHED_SECRETS, check_node_token, check_secret, weakness

WEAK = [
    "aaaaaaaaaaaaaaaa",  # one class, one character
    "passwordpassword",  # a word, repeated
    "hunter2",  # short
    "1",
    "change-me-to-a-long-random-salt-0123456789",  # the salt examples/gateway.yaml published
    "Password1Password1",  # repeated
    "My-Secret-Salt-2024",  # a common word
    "abababababababab1234",  # few distinct characters
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa1b2c3d4e",
    "0123456789012345678901234567890123456789",  # one class, repeated
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ",  # one class
]


@pytest.mark.parametrize("secret", WEAK)
def test_person_made_secrets_are_refused_without_being_repeated(secret: str) -> None:
    assert weakness(secret) is not None
    with pytest.raises(ValueError, match="too weak") as err:
        check_node_token(secret)
    assert len(secret) < 4 or secret not in str(err.value)


def test_random_secrets_pass() -> None:
    for _ in range(300):
        for s in (secrets.token_urlsafe(32), secrets.token_hex(16), generate_key()):
            assert weakness(s) is None, s
    for s in ("test-deployment-salt", "k3Y-salt-for-tenant-tests-9f2e1c"):
        assert weakness(s) is None  # the test suites' own salts: long, mixed, no common word
    assert check_secret("x9-Q" + secrets.token_urlsafe(16), "s")


def test_weak_salts_and_tokens_are_refused_when_the_config_is_loaded() -> None:
    key = generate_key()
    for salt in ("aaaaaaaaaaaaaaaa", *PUBLISHED_SECRETS):
        with pytest.raises(ValueError, match=r"auth\.salt is too weak"):
            AuthConfig.model_validate(
                {"salt": salt, "keys": [{"name": "u", "key_hash": hash_key(key, salt)}]}
            )
    with pytest.raises(ValueError, match="node token is too weak"):
        GatewayConfig(node_token="passwordpassword")
    good = secrets.token_urlsafe(32)
    assert AuthConfig.model_validate(
        {"salt": good, "keys": [{"name": "u", "key_hash": hash_key(key, good)}]}
    )
    assert GatewayConfig(node_token=secrets.token_urlsafe(32)).node_token is not None


def test_the_salt_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    key, salt = generate_key(), secrets.token_urlsafe(32)
    entry = {"name": "u", "key_hash": hash_key(key, salt)}
    with pytest.raises(ValueError, match=r"auth\.salt is too weak"):
        AuthConfig.model_validate({"keys": [entry]})
    monkeypatch.setenv("EDGECLOUD_AUTH_SALT", salt)
    assert AuthConfig.model_validate({"keys": [entry]}).salt.get_secret_value() == salt
