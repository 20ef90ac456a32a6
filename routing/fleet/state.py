"""NodeState: the one schema every node pushes and every gateway reads.

A state older than its ``ttl_s`` counts as down (see :meth:`NodeState.is_fresh`).
"""

from __future__ import annotations

import enum
import time

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1


class NodeKind(enum.StrEnum):
    EDGE = "edge"
    CLOUD = "cloud"
    OPENAI = "openai"  # an external OpenAI-compatible server; its state is inferred


class NodeState(BaseModel):
    model_config = ConfigDict(frozen=False, extra="ignore")

    id: str
    kind: NodeKind
    region: str
    url: str
    models: list[str]  # served model names (the first is the primary)
    model_identities: dict[str, str] = Field(default_factory=dict)  # name -> identity
    max_context: int
    device: str  # execution provider (edge) or torch device (cloud)
    max_batch: int  # slots (edge) or max running sequences (cloud)
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefill_tokens_per_s: float = 0.0  # EWMA from the node's own timings
    decode_ms_per_token: float = 0.0  # EWMA from the node's own timings
    prefix_hit_rate: float = 0.0
    prefix_cache: bool = False  # it keeps a prefix cache and publishes its block events
    tp: int = 1  # tensor-parallel ranks of its engine
    pp: int = 1  # pipeline stages of its engine
    devices: list[str] = Field(default_factory=list)  # one per rank (empty: just ``device``)
    # prompt tokens its engine prefills per step with nothing decoding, and while rows decode
    # (``routing.prefill_budget``); 0: not reported, the kind's default is assumed
    prefill_chunk: int = 0
    prefill_chunk_decoding: int = 0
    timestamp: float = Field(default_factory=time.time)  # wall-clock time it was taken
    ttl_s: float = 5.0
    version: int = SCHEMA_VERSION

    def is_fresh(self, now: float | None = None) -> bool:
        return ((now if now is not None else time.time()) - self.timestamp) <= self.ttl_s

    @property
    def load(self) -> float:
        """Occupancy in [0, inf): (running + waiting) / max_batch."""
        return (self.running + self.waiting) / max(1, self.max_batch)
