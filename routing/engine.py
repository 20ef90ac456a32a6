"""The one engine interface both tiers implement, and the types that cross it.

The node app (``gateway.node``) drives any engine through :class:`Engine` only; tests and
benchmarks do the same. Engines deal in token ids: detokenization and stop *strings* are handled
above them by :class:`gateway.node.textstream.TextStreamer`, which aborts the engine request when
a stop string matches. Engines handle stop *token ids* and ``max_tokens`` themselves.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from routing.blocks import BlockEvents
from routing.fleet.state import EngineTraits, StepCost

if TYPE_CHECKING:
    from routing.grammar import Grammar


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy; ``top_k == 0`` means off."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # stop token ids do not end the request (it runs to max_tokens)
    min_tokens: int = 0  # stop token ids cannot be sampled before this many tokens were generated
    # log-probabilities (of the raw logits, before temperature, top-k/top-p, bans and a
    # grammar's mask): None returns none; k >= 0 returns each sampled token's and the k most
    # likely at its position
    logprobs: int | None = None
    # the same for every prompt token after the first (None: none); an engine computes them
    # for each prompt position, so it does not serve them from a prefix cache
    prompt_logprobs: int | None = None
    # the output follows this grammar: its mask is applied before sampling (routing.grammar)
    grammar: Grammar | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def banned_stops(self, generated: int) -> tuple[int, ...]:
        """The stop token ids the next token may not be, ``generated`` tokens in: all of them
        before ``min_tokens`` (unless ``ignore_eos``: then none ends the request anyway)."""
        if generated < self.min_tokens and not self.ignore_eos:
            return self.stop_token_ids
        return ()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the raw logits at its position, and the ``top`` most
    likely ``(token id, log-probability)`` pairs there, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class GenerationRequest:
    """A request as an engine sees it: prompt token ids and sampling, nothing textual.

    ``prefill_with``: the id of a request submitted just before with the same prompt (another
    choice of one ``n > 1`` request); an engine with a prefix cache may hold this one back
    until that one's prompt is computed, and then reuse its blocks (one prefill).

    ``cache_salt``: the request's cache scope (:func:`routing.blocks.scope_seed`); an engine
    with a prefix cache hashes its blocks in that scope only, so requests of two scopes never
    share cached KV."""

    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    priority: int = 0  # lower value is served first; ties FCFS by arrival_time
    arrival_time: float = field(default_factory=time.monotonic)
    prefill_with: str | None = None
    cache_salt: str = ""


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token id (or, above the engine, a stop string)
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the node


@dataclass(slots=True)
class TokenEvent:
    """New tokens of one request. The last event of a stream has ``finish_reason`` set.

    ``prompt_tokens`` and ``cached_tokens`` (prompt tokens served from a prefix cache) are valid
    from the first event on; ``completion_tokens`` counts all tokens generated so far.
    ``prefill_ms``, from an engine that measures it, is the compute time of the request's own
    prompt chunks (not its wait, nor other requests' work between them), valid from the first
    event on (the cloud engine's: the request's token share of what each step that ran its
    chunks took beyond the step's decode rows); None from an engine that does not measure it.
    ``logprobs`` (when the request asks, ``SamplingParams.logprobs``): one entry per id of
    ``token_ids``. ``prompt_logprobs`` (``SamplingParams.prompt_logprobs``): on the request's
    first event only, one entry per prompt token, None for the first.
    """

    request_id: str
    token_ids: list[int]
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    prefill_ms: float | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineError(Exception):
    """Base class for errors an engine raises at submission time."""


class RequestTooLong(EngineError):
    """Prompt plus max_tokens can never fit this engine's context (maps to HTTP 400)."""


class QueueFull(EngineError):
    """Every slot is busy and the wait queue is full (maps to HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class EngineStats:
    """What an engine reports about itself: its traits and its load now. The node app turns
    it into a NodeState (:meth:`node_fields`)."""

    traits: EngineTraits
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefill_tokens_per_s: float  # EWMA of the engine's own measurements
    decode_ms_per_token: float  # EWMA, per sequence at the current batch
    prefix_hit_rate: float = 0.0  # cached prompt tokens / prompt tokens, since start
    step_cost: StepCost | None = None  # its step time fitted on its own steps (routing.step_cost)

    def node_fields(self) -> dict[str, object]:
        """Its traits and load as NodeState's keyword arguments (the same names)."""
        load = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "traits"}
        return {**self.traits.model_dump(), **load}


@runtime_checkable
class Engine(Protocol):
    """An async generation engine. All methods are called from the node's event loop.

    Invariants: ``generate`` raises :class:`RequestTooLong` or :class:`QueueFull` before
    yielding anything, or yields events until one with ``finish_reason`` set. Leaving the
    iterator early (``aclose``, client gone) frees the request's slot or blocks at once.
    """

    model_id: str  # the model's identity (see routing.model_store)
    max_context: int
    kind: str  # "edge" or "cloud"

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def check(self, request: GenerationRequest) -> None:
        """Raise RequestTooLong or QueueFull if ``request`` cannot be admitted now.

        Cheap and synchronous, so the node app answers 400/429 before it commits to a 200.
        """
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...


@runtime_checkable
class PrefixCacheEngine(Protocol):
    """An engine that keeps a prefix cache keyed by ``routing.blocks`` hashes and reports it.

    Invariants: ``drain_block_events`` returns each change once (thread-safe); applying every
    drained batch in order to ``held_blocks()`` taken at any earlier moment gives what the cache
    holds. ``TokenEvent.cached_tokens`` counts exactly the leading held blocks a request reused
    (whole blocks, at most ``(prompt tokens - 1) // BLOCK_SIZE`` of them), so a fleet index
    fed these events credits a node with what it will then report.
    """

    def drain_block_events(self) -> BlockEvents: ...

    def held_blocks(self) -> list[int]: ...
