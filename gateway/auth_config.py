"""The ``auth`` section of the gateway config: user keys, admin keys, salt and limits.

Invariants:
- Only key hashes are in the config (:func:`gateway.api_keys.hash_key`), never keys.
- Authentication is on when ``enabled`` says so, or (when it is unset) as soon as any key is
  configured or Redis keys are enabled.
- Weak secrets are refused when the config is loaded: with authentication on and any key
  configured, the salt must pass :func:`gateway.secret_strength.check_secret` (length,
  character classes, no repetition, no common word, not a published example), and no key
  (user or admin) may be one of :data:`WEAK_KEYS` (checked by hashing them with the salt).
- The salt defaults to ``$EDGECLOUD_AUTH_SALT``, so it need not be written in the YAML.
- Key names are unique (they name the rate-limit buckets) and no hash appears twice.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from gateway.api_keys import hash_key, valid_hash
from gateway.fair_config import TeamEntry
from gateway.secret_strength import WEAK_KEYS, check_secret

SALT_ENV = "EDGECLOUD_AUTH_SALT"


def _env_salt() -> SecretStr:
    return SecretStr(os.environ.get(SALT_ENV, ""))


class ApiKeyEntry(BaseModel):
    """One user key in the config: ``{name, key_hash, rpm, tpm, team}`` (limits: None =
    default; ``team``: keys sharing a cache scope under ``cache_scope: team``, and the
    team's fair-share terms in ``auth.teams``), its fair-share ``weight`` and
    ``max_concurrent``, and the ``max_tokens`` it gets when it names none and may ask for."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    key_hash: str
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    team: str | None = Field(default=None, min_length=1)
    weight: float = Field(default=1.0, gt=0, le=1_000_000, description="fair-share weight")
    max_concurrent: int | None = Field(default=None, ge=1, description="slots held at once")
    max_tokens_default: int | None = Field(
        default=None, ge=1, description="max_tokens set on requests that name none"
    )
    max_tokens_limit: int | None = Field(
        default=None, ge=1, description="a request asking for more max_tokens gets 400"
    )

    @field_validator("key_hash")
    @classmethod
    def _check_hash(cls, v: str) -> str:
        return valid_hash(v)


class AdminKeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    key_hash: str

    @field_validator("key_hash")
    @classmethod
    def _check_hash(cls, v: str) -> str:
        return valid_hash(v)


class AuthConfig(BaseModel):
    """The ``auth`` section of the gateway config.

    Example::

        auth:
          # salt: from $EDGECLOUD_AUTH_SALT (python -c 'import secrets;
          #       print(secrets.token_urlsafe(32))')
          default_rpm: 600
          keys:
            - {name: alice, key_hash: "hmac-sha256:3f...", rpm: 60, tpm: 100000}
          admin_keys:
            - {name: ops, key_hash: "hmac-sha256:9a..."}
          redis_keys: true
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = Field(default=None, description="unset: on iff any key is configured")
    salt: SecretStr = Field(
        default_factory=_env_salt,
        description=f"per-deployment secret (default ${SALT_ENV}); random, 16+ characters",
    )
    keys: list[ApiKeyEntry] = Field(default_factory=list)
    admin_keys: list[AdminKeyEntry] = Field(default_factory=list)
    teams: dict[str, TeamEntry] = Field(
        default_factory=dict, description="fair-share weight and slot limit per team"
    )
    redis_keys: bool = Field(default=False, description="also accept keys from the Redis store")
    default_rpm: int | None = Field(default=None, ge=1, description="for keys naming none")
    default_tpm: int | None = Field(default=None, ge=1)
    cache_ttl_s: float = Field(default=30.0, ge=0)
    negative_cache_ttl_s: float = Field(default=5.0, ge=0)
    cache_size: int = Field(default=10_000, ge=1)
    failed_auth_per_minute: int = Field(
        default=30,
        ge=1,
        description="failed key checks one client address may make a minute (a burst of "
        "this many); past it the address gets 429 before its key is checked",
    )

    @model_validator(mode="after")
    def _unique(self) -> AuthConfig:
        names = [k.name for k in self.keys]
        if len(names) != len(set(names)):
            raise ValueError("auth.keys: names must be unique (they name the rate-limit buckets)")
        hashes = [k.key_hash for k in self.keys] + [k.key_hash for k in self.admin_keys]
        if len(hashes) != len(set(hashes)):
            raise ValueError("auth: the same key_hash appears twice")
        return self

    @model_validator(mode="after")
    def _strong(self) -> AuthConfig:
        """Weak secrets are refused (see the module invariants)."""
        if not self.is_enabled or not (self.keys or self.admin_keys or self.redis_keys):
            return self
        salt = self.salt.get_secret_value()
        check_secret(salt, "auth.salt")
        weak = {hash_key(w, salt): w for w in WEAK_KEYS}
        for section, entries in (("keys", self.keys), ("admin_keys", self.admin_keys)):
            for k in entries:
                if k.key_hash in weak:
                    raise ValueError(
                        f"auth.{section}: key {k.name!r} is a well-known weak key; make one "
                        "with gateway.auth.generate_key()"
                    )
        return self

    @property
    def is_enabled(self) -> bool:
        if self.enabled is not None:
            return self.enabled
        return bool(self.keys or self.admin_keys or self.redis_keys)
