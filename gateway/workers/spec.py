"""What a gateway worker is told by its parent, and what it knows of itself."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from gateway.front.config import GatewayConfig
from gateway.server_limits import ServerLimits


@dataclass(frozen=True)
class WorkerInfo:
    """Which worker of how many this process is; ``shared_redis_url``: the private Redis the
    workers share when the config names none (None: the config's ``redis_url`` is used)."""

    index: int
    count: int
    shared_redis_url: str | None = field(default=None, repr=False)  # holds a password

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "of": self.count, "pid": os.getpid()}


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to serve: sent by the parent down a pipe, never on a command
    line or in the environment (the config holds secrets)."""

    config: GatewayConfig
    host: str
    port: int
    limits: ServerLimits
    info: WorkerInfo
