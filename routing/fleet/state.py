"""NodeState: the one schema every node pushes and every gateway reads.

A state older than its ``ttl_s`` counts as down (see :meth:`NodeState.is_fresh`).
"""

from __future__ import annotations

import enum
import time

from pydantic import BaseModel, ConfigDict, Field

from routing.blocks import BLOCK_SIZE

SCHEMA_VERSION = 1
# The Node API a node speaks (MAJOR.MINOR): a minor step only adds to it; a gateway routes only
# to nodes of its own major (``api_compatible``), and says which it skips.
NODE_API_VERSION = "1.0"


def api_major(version: str) -> int | None:
    """The major number of a ``MAJOR.MINOR`` Node API version; None if it is not one."""
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def api_compatible(version: str) -> bool:
    """True when a node speaking ``version`` can serve this gateway (same major)."""
    return api_major(version) == api_major(NODE_API_VERSION)


class NodeKind(enum.StrEnum):
    EDGE = "edge"
    CLOUD = "cloud"
    OPENAI = "openai"  # an external OpenAI-compatible server; its state is inferred


class StepCost(BaseModel):
    """One engine step's time as the node fitted it over its own recent steps (least squares,
    ``routing.step_cost``)::

        ms = pass_ms + ms_per_row * decode rows + ms_per_prompt_token * prompt tokens
             + ms_per_context_token * tokens of KV the step reads

    A step is one forward pass, whatever it holds: a prompt's chunk beside decode rows adds its
    tokens, not another pass. Every term is non-negative; ``steps`` is how many steps it was
    fitted over.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    pass_ms: float = Field(ge=0)
    ms_per_row: float = Field(ge=0)
    ms_per_prompt_token: float = Field(ge=0)
    ms_per_context_token: float = Field(ge=0)
    steps: int = Field(ge=0)

    def step_ms(self, rows: float, prompt_tokens: float, context: float) -> float:
        return (
            self.pass_ms
            + self.ms_per_row * rows
            + self.ms_per_prompt_token * prompt_tokens
            + self.ms_per_context_token * context
        )


class EngineTraits(BaseModel):
    """What an engine says about how it runs, beside its load: where, how wide, how its prefix
    cache and prompt chunks behave. Engines report it in ``EngineStats.traits``; a NodeState
    carries the same fields at its top level."""

    model_config = ConfigDict(frozen=False, extra="ignore")

    device: str  # execution provider (edge) or torch device (cloud)
    max_batch: int  # slots (edge) or max running sequences (cloud)
    prefix_cache: bool = False  # it keeps a prefix cache and publishes its block events
    # before each prompt chunk it copies the prompt's leading blocks another slot (busy, or
    # free and kept) holds beyond its own (the edge's catch-up): a request sharing a prefix
    # with an earlier one in hand reuses it wherever it stands in the queue
    prefix_catch_up: bool = False
    # its prefix cache is the KV its slots keep, one prompt each (the edge): a request that
    # takes a free slot overwrites what that slot kept beyond their common leading blocks
    prefix_in_slots: bool = False
    # its weights and how they were chosen (the edge: its variant and the quality gate's verdict)
    weights: str = ""
    # what its KV cache stores ("bf16", "fp8", "int8", ...; "": not reported): a compressed
    # cache holds more tokens in the same memory, which ``kv_blocks_total`` already counts
    kv_dtype: str = ""
    tp: int = 1  # tensor-parallel ranks of its engine
    pp: int = 1  # pipeline stages of its engine
    devices: list[str] = Field(default_factory=list)  # one per rank (empty: just ``device``)
    # prompt tokens its engine prefills per step with nothing decoding, and while rows decode
    # (``routing.prefill_budget``; the latter follows its measured rates); 0: not reported,
    # the kind's default is assumed (for the latter: as prefill_chunk)
    prefill_chunk: int = 0
    prefill_chunk_decoding: int = 0
    # what it serves beyond plain sampling (``Capability``: grammars, logprobs), and the most
    # choices (``n``) one request may ask for; the router sends a request that needs one only
    # to nodes that list it, and a node that reports none is sent no such request
    capabilities: list[str] = Field(default_factory=list)
    max_n: int = 1


class Capability:
    """The names of what a node may advertise in ``EngineTraits.capabilities``."""

    GRAMMAR = "grammar"  # response_format: a grammar's mask before sampling (routing.grammar)
    LOGPROBS = "logprobs"  # sampled tokens' log-probabilities, top alternatives up to 20
    PROMPT_LOGPROBS = "prompt_logprobs"  # the prompt's too (completions with echo)
    LOGPROB_KINDS = (LOGPROBS, PROMPT_LOGPROBS)
    ALL = (GRAMMAR, LOGPROBS, PROMPT_LOGPROBS)


class NodeState(EngineTraits):
    """A node's identity, its engine's traits and its load at ``timestamp``."""

    model_config = ConfigDict(frozen=False, extra="ignore")

    id: str
    kind: NodeKind
    region: str
    url: str
    models: list[str]  # served model names (the first is the primary)
    model_identities: dict[str, str] = Field(default_factory=dict)  # name -> identity
    max_context: int
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefill_tokens_per_s: float = 0.0  # EWMA from the node's own timings
    decode_ms_per_token: float = 0.0  # EWMA from the node's own timings
    prefix_hit_rate: float = 0.0
    # its engine's step time fitted on its own steps (None: it fits none, or not yet)
    step_cost: StepCost | None = None
    # power (routing.power; reporting only): watts at idle and under load (None: unknown),
    # joules per finished request (EWMA) and where they come from ("rapl", "configured", "")
    watts_idle: float | None = None
    watts_load: float | None = None
    joules_per_request: float | None = None
    power_source: str = ""
    timestamp: float = Field(default_factory=time.time)  # wall-clock time it was taken
    ttl_s: float = 5.0
    version: int = SCHEMA_VERSION
    # the Node API it speaks; nodes from before this field spoke 1.0
    api_version: str = NODE_API_VERSION

    def is_fresh(self, now: float | None = None) -> bool:
        return ((now if now is not None else time.time()) - self.timestamp) <= self.ttl_s

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens its KV pool holds (0: not reported): ``kv_blocks_total`` blocks of
        ``routing.blocks.BLOCK_SIZE`` tokens, whatever the pool stores per token."""
        return self.kv_blocks_total * BLOCK_SIZE

    @property
    def load(self) -> float:
        """Occupancy in [0, inf): (running + waiting) / max_batch."""
        return (self.running + self.waiting) / max(1, self.max_batch)
