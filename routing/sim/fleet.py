"""The fleet file (YAML): regions and RTTs, gateway replicas, nodes and their profiles.

Example (``routing/sim/fleets/embedded_fleet.yaml``)::

    name: embedded-default
    model: default
    push_interval_s: 1.0        # NodeState push period of every node
    event_delay_ms: 5.0         # block events: node -> prefix index
    regions:
      intra_region_ms: 0.2
      rtt_ms: [{a: eu-west, b: eu-central, ms: 25}]
    gateways: [{region: local, replicas: 1, overhead_ms: 1.5}]
    nodes:
      - {id: edge, kind: edge, region: local, profile: ../profiles/cpu_edge.json}
      - {id: cloud, kind: cloud, region: local, profile: ../profiles/cpu_cloud.json, count: 2}

Invariants: profile paths are relative to the fleet file; node ids are unique after expanding
``count`` (``id-0``, ``id-1``, ...); unknown keys are errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from routing.regions import RegionKnobs, RegionTable, RttOverride
from routing.sim.profiles import NodeProfile, load_profile


class RegionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    intra_region_ms: float = Field(default=1.0, gt=0)
    rtt_ms: list[RttOverride] = Field(default_factory=list)
    table: dict[str, tuple[float, float]] = Field(default_factory=dict)


class GatewaySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    region: str
    replicas: int = Field(default=1, ge=1)
    overhead_ms: float = Field(default=1.0, ge=0, description="gateway time per request")


class NodeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    kind: Literal["edge", "cloud"]
    region: str
    profile: str
    count: int = Field(default=1, ge=1)
    prefix_cache: bool = True
    slots: int | None = Field(default=None, ge=1, description="override the profile's")
    kv_blocks: int | None = Field(default=None, ge=1)


class FleetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "fleet"
    model: str = "default"
    model_identity: str = "sim-model"
    push_interval_s: float = Field(default=1.0, gt=0)
    event_delay_ms: float = Field(default=5.0, ge=0)
    regions: RegionSpec = Field(default_factory=RegionSpec)
    gateways: list[GatewaySpec] = Field(min_length=1)
    nodes: list[NodeSpec] = Field(min_length=1)
    base_dir: str = Field(default=".", exclude=True)

    def profile(self, spec: NodeSpec) -> NodeProfile:
        p = Path(spec.profile)
        if not p.is_absolute():
            p = Path(self.base_dir) / p
        prof = load_profile(p)
        upd = {}
        if spec.slots:
            upd["slots"] = spec.slots
        if spec.kv_blocks:
            upd["kv_blocks"] = spec.kv_blocks
        return prof.model_copy(update=upd) if upd else prof

    def expanded(self) -> list[tuple[str, NodeSpec]]:
        out = []
        for n in self.nodes:
            if n.count == 1:
                out.append((n.id, n))
            else:
                out.extend((f"{n.id}-{i}", n) for i in range(n.count))
        ids = [i for i, _ in out]
        if len(set(ids)) != len(ids):
            raise ValueError("node ids are not unique")
        return out

    def region_knobs(self) -> RegionKnobs:
        return RegionKnobs(
            table=dict(self.regions.table),
            rtt_overrides=list(self.regions.rtt_ms),
            intra_region_ms=self.regions.intra_region_ms,
        )

    def rtt_table(self) -> RegionTable:
        """The network's truth (symmetric): overrides, else great-circle estimates."""
        return RegionTable(self.region_knobs())


def load_fleet(path: str | os.PathLike[str]) -> FleetSpec:
    p = Path(path)
    data = yaml.safe_load(p.read_text()) or {}
    spec = FleetSpec.model_validate(data)
    spec.base_dir = str(p.resolve().parent)
    return spec
