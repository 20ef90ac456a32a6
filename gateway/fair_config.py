"""The ``fair_share`` section of the gateway config, and the ``auth.teams`` entries.

Invariants:
- Fair share is on when ``enabled`` says so, or (unset) exactly when authentication is on:
  without keys the embedded default is one tenant and nothing is counted or queued.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TeamEntry(BaseModel):
    """A team's fair-share terms (``auth.teams.<name>``): its keys together hold at most
    ``max_concurrent`` slots, and the team takes its share of the fleet by ``weight``."""

    model_config = ConfigDict(extra="forbid")

    weight: float = Field(default=1.0, gt=0, le=1_000_000)
    max_concurrent: int | None = Field(default=None, ge=1)


class FairShareConfig(BaseModel):
    """How the gateway shares the fleet's slots between keys (``gateway.fair_queue``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = Field(
        default=None, description="unset: on exactly when authentication is on"
    )
    fleet_slots: int | None = Field(
        default=None,
        ge=1,
        description="requests the fleet runs at once (unset: the sum of its nodes' max_batch); "
        "past it requests wait at the gateway, admitted by weighted fair share across keys",
    )
    queue_timeout_s: float = Field(
        default=60.0, gt=0, description="a request waiting longer for a slot gets 429"
    )
    max_queued_per_key: int = Field(
        default=256, ge=1, description="requests of one key waiting at a gateway; past it 429"
    )
    poll_s: float = Field(
        default=0.05,
        gt=0,
        description="how often waiting requests try again for a slot freed elsewhere (another "
        "gateway, or nodes joining)",
    )
    lease_s: float = Field(
        default=15.0,
        gt=0,
        description="Redis: a gateway silent this long has its held slots freed",
    )
