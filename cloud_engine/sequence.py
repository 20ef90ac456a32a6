"""One request's state inside the engine.

Invariants:
- ``token_ids`` is the prompt followed by every token generated so far; it only grows (a
  preempted sequence keeps its output and recomputes its KV from the whole of it).
- ``num_computed`` tokens of ``token_ids`` have their KV in the blocks of ``block_table``
  (``len(block_table) * block_size >= num_computed``); it is 0 whenever ``block_table`` is empty.
- ``prompt_logprobs`` (a request that asks for them) holds the entries of prompt tokens
  ``0..len - 1`` (None for token 0); it only grows, so a recompute adds none twice.
- ``hashes[i]`` is the chained ``routing.blocks`` hash of full block ``i`` of ``token_ids``;
  the first ``num_registered`` blocks of ``block_table`` are published in the prefix cache (or
  were found there).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from routing.blocks import BLOCK_SIZE, hash_block, scope_seed
from routing.engine import FinishReason, GenerationRequest, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from routing.grammar import GrammarState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    request: GenerationRequest
    order: int  # engine-wide arrival counter: FCFS among equal priorities
    max_context: int
    token_ids: list[int] = field(default_factory=list)
    num_prompt: int = 0
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    num_registered: int = 0
    num_cached: int = -1  # prompt tokens found in the prefix cache at first admission
    counted: bool = False  # included in the engine's prompt/cached token totals
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    preemptions: int = 0
    row: int = -1  # the runner's block-table row while running (-1: none)
    generator: object | None = None  # the runner's per-request RNG (seeded sampling)
    in_flight: bool = False  # in a launched, not yet collected batch (pipeline parallelism)
    prefill_ms: float = 0.0  # its share of the steps that computed its prompt (step_stats)
    # n > 1: the sibling whose prompt this one waits for and then reuses (one prefill)
    leader: Sequence | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    # its grammar's state (routing.grammar), advanced by the core with each committed token
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)
            self.num_prompt = len(self.token_ids)
        if self.request.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and has not all of them yet (no prefix reuse then)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt

    @property
    def waits_for_leader(self) -> bool:
        """Its leader is still to compute the prompt they share."""
        lead = self.leader
        return (
            lead is not None
            and lead.status is not SeqStatus.FINISHED
            and lead.num_computed < lead.num_prompt
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def max_output(self) -> int:
        """Tokens this request may generate: max_tokens, capped by the context."""
        return min(self.sampling.max_tokens, self.max_context - self.num_prompt)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority, then arrival."""
        return (self.request.priority, self.order)

    def extend_hashes(self, seed: int, block_size: int = BLOCK_SIZE) -> None:
        """Hash every full block of ``token_ids`` not hashed yet, in the request's cache
        scope (``seed``: the model's; ``request.cache_salt`` re-seeds it)."""
        n_full = len(self.token_ids) // block_size
        if n_full <= len(self.hashes):
            return
        parent = self.hashes[-1] if self.hashes else scope_seed(seed, self.request.cache_salt)
        for i in range(len(self.hashes), n_full):
            parent = hash_block(parent, self.token_ids[i * block_size : (i + 1) * block_size])
            self.hashes.append(parent)
