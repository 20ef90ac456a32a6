"""Every routing knob in one YAML file, validated by pydantic and hot-reloaded on change.

Invariants:
- Unknown keys are errors (a typo never silently falls back to a default).
- :class:`ConfigSource` always holds a valid config: a file that fails to parse or validate
  at reload leaves the previous config in place and is reported in ``last_error``; only the
  first load raises.
- :meth:`ConfigSource.check` is cheap enough to call per request: at most one ``stat`` per
  ``check_interval_s``, and a re-read only when the file's mtime or size changed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from routing.output_length import OutputKnobs
from routing.regions import RegionKnobs

PolicyName = Literal[
    "latency", "threshold", "round_robin", "least_loaded", "edge_first", "cloud_only"
]
POLICY_NAMES: tuple[str, ...] = PolicyName.__args__  # type: ignore[attr-defined]


class ThresholdKnobs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int = Field(default=512, ge=0, description="at or below: edge; above: cloud")


class CircuitKnobs(BaseModel):
    """Per-node circuit breaker (enforced by the gateway's proxy; an open node is excluded)."""

    model_config = ConfigDict(extra="forbid")

    failure_threshold: int = Field(default=5, ge=1, description="consecutive failures to open")
    open_s: float = Field(default=10.0, gt=0, description="how long it stays open")
    half_open_probes: int = Field(default=1, ge=1)


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = "latency"
    objective: Literal["auto", "e2e", "ttft"] = Field(
        default="auto",
        description="what `latency` minimizes; auto: for streams TTFT among the nodes predicted "
        "to finish within 2x the soonest, else e2e",
    )
    interference_weight: float = Field(
        default=0.0,
        ge=0,
        description="what `latency` adds to a node's prediction per ms its prefill would hold "
        "up the requests decoding there; raise it where tiers are separate machines and "
        "long prompts slow other users' answers",
    )
    default_region: str = Field(default="local", description="clients of unknown location")
    gateway_region: str | None = Field(default=None, description="where the gateway runs")
    expected_output: OutputKnobs = Field(default_factory=OutputKnobs)
    threshold: ThresholdKnobs = Field(default_factory=ThresholdKnobs)
    circuit: CircuitKnobs = Field(default_factory=CircuitKnobs)
    regions: RegionKnobs = Field(default_factory=RegionKnobs)
    edge_first_max_load: float = Field(
        default=1.0, gt=0, description="edge_first skips edges at or above this occupancy"
    )

    @property
    def home_region(self) -> str:
        return self.gateway_region or self.default_region


class ConfigError(ValueError):
    """The policy file cannot be read, parsed or validated."""


def parse_config(text: str, source: str = "<string>") -> PolicyConfig:
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return PolicyConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def load_config(path: str | os.PathLike[str]) -> PolicyConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc}") from exc
    return parse_config(text, str(p))


class ConfigSource:
    """The current PolicyConfig, from a file (hot-reloaded) or fixed.

    ``version`` increases on every successful reload; ``on_change`` callbacks get the new config.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        config: PolicyConfig | None = None,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.check_interval_s = check_interval_s
        self._clock = clock
        self._next_check = 0.0
        self._stamp: tuple[int, int] | None = None
        self.version = 0
        self.last_error: str | None = None
        self.reloads = 0
        self._listeners: list[Callable[[PolicyConfig], None]] = []
        if self.path is not None:
            self._stamp = self._stat()
            self._current = load_config(self.path)
        else:
            self._current = config or PolicyConfig()
        self._next_check = clock() + check_interval_s

    @classmethod
    def fixed(cls, config: PolicyConfig | None = None) -> ConfigSource:
        return cls(config=config)

    @property
    def current(self) -> PolicyConfig:
        return self._current

    def on_change(self, callback: Callable[[PolicyConfig], None]) -> None:
        self._listeners.append(callback)

    def set(self, config: PolicyConfig) -> None:
        """Replace the config in memory (the admin API); the file wins again if it changes."""
        self._current = config
        self.version += 1
        for cb in self._listeners:
            cb(config)

    def _stat(self) -> tuple[int, int] | None:
        assert self.path is not None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def check(self, force: bool = False) -> bool:
        """Reload if the file changed; True when a new config took effect."""
        if self.path is None:
            return False
        now = self._clock()
        if not force and now < self._next_check:
            return False
        self._next_check = now + self.check_interval_s
        stamp = self._stat()
        if stamp is None:
            self.last_error = f"{self.path}: missing; keeping the previous config"
            return False
        if stamp == self._stamp and not force:
            return False
        self._stamp = stamp
        try:
            config = load_config(self.path)
        except ConfigError as exc:
            self.last_error = str(exc)
            return False
        self.last_error = None
        self.reloads += 1
        self.set(config)
        return True
