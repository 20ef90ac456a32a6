"""The latency model's settings (the ``latency`` section of the policy YAML)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from routing.fleet.state import NodeState
from routing.latency.priors import on_cpu

Switch = Literal["off", "on", "accelerators"]


class LatencyKnobs(BaseModel):
    """Two switches for costs seen on accelerator nodes; everything else is learned."""

    model_config = ConfigDict(extra="forbid")

    prefill_pass: Switch = Field(
        default="accelerators",
        description="charge each prompt chunk the forward pass its node was seen to pay (alone "
        "or beside decode rows); accelerators: on nodes not on a CPU; turn off if GPU TTFTs "
        "come out predicted high",
    )
    busy_wait: Switch = Field(
        default="accelerators",
        description="add the wait a busy node's own reports show beyond the replay's, learned "
        "per load; accelerators: on nodes not on a CPU; turn on if busy CPU nodes' TTFTs come "
        "out predicted low",
    )

    @field_validator("prefill_pass", "busy_wait", mode="before")
    @classmethod
    def _switch_from_bool(cls, value: object) -> object:
        """``true``/``false`` mean on and off."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @staticmethod
    def enabled(switch: Switch, node: NodeState) -> bool:
        """Whether a :data:`Switch` applies to ``node``."""
        return switch == "on" or (switch == "accelerators" and not on_cpu(node.device))
