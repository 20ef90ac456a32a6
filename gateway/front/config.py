"""The front gateway's configuration (one YAML file; the routing policy has its own)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from gateway.auth import AuthConfig
from gateway.geo import GeoConfig
from routing.fleet.memory_store import OpenAINodeConfig


class GatewayConfig(BaseModel):
    """Example::

    host: 0.0.0.0
    port: 8000
    redis_url: redis://127.0.0.1:6379/0      # omit for the in-process fleet store
    nodes: [http://10.0.0.5:8001]            # polled over /load (in-process store only)
    openai_nodes: [{id: vllm-1, url: http://10.0.0.9:8000, region: eu-west, models: [m]}]
    policy_file: policy.yaml                 # routing knobs, hot-reloaded
    virtual_models: {auto: smollm2-135m-instruct}
    geo: {database: GeoLite2-City.mmdb, default_region: eu-west, countries: {FR: eu-west}}
    """

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    redis_url: str | None = None
    nodes: list[str] = Field(default_factory=list)
    openai_nodes: list[OpenAINodeConfig] = Field(default_factory=list)
    policy_file: Path | None = None
    virtual_models: dict[str, str] = Field(
        default_factory=lambda: {"auto": "smollm2-135m-instruct"}
    )
    geo: GeoConfig = Field(default_factory=GeoConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    max_in_flight: int = Field(default=4096, gt=0, description="over this: 429 with Retry-After")
    max_attempts: int = Field(default=3, ge=1, description="nodes tried before the first byte")
    connect_timeout_s: float = Field(default=2.0, gt=0)
    read_timeout_s: float = Field(default=600.0, gt=0)
    poll_interval_s: float = Field(default=1.0, gt=0)
    log_prompts: bool = False
    tune_gc: bool = Field(
        default=True, description="freeze start-up objects and collect garbage less often"
    )


def load_gateway_config(path: str | Path) -> GatewayConfig:
    data = yaml.safe_load(Path(path).read_text()) or {}
    return GatewayConfig.model_validate(data)
