"""``SlotRequest``: one request as the edge's slot loop tracks it, from submission to finish."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from edge_runtime.sampler import Sampler
from routing.engine import FinishReason, GenerationRequest, TokenEvent, TokenLogprob


@dataclass
class SlotRequest:
    """One request's state in the loop; every field changes under the scheduler's lock.

    Invariant: ``filled`` positions of its slot hold its KV (the prompt, then the generated
    tokens fed back); ``cached <= filled`` of them were reused, not computed."""

    request: GenerationRequest
    emit: Callable[[TokenEvent], None]  # thread-safe; delivers to the request's consumer
    budget: int  # tokens it may still generate in total
    sampler: Sampler = field(init=False)
    stops: frozenset[int] = field(init=False)
    slot: int = -1
    filled: int = 0  # positions of this sequence in the slot's KV cache
    generated: int = 0
    last_token: int = -1  # sampled, fed at the next decode step
    hashes: list[int] = field(default_factory=list)  # block hashes of the prompt (prefix reuse)
    cached: int = 0  # leading prompt tokens whose KV the slot already held (whole blocks)
    prefill_ms: float = 0.0  # compute time of its own prompt chunks
    output: list[int] = field(default_factory=list)  # generated tokens (no stop token)
    passed: int = 0  # times a later request was admitted before it (prefix first)
    # prompt logprobs (when asked): entries of prompt tokens 0..len-1, None for token 0; sent
    # with the request's first event
    prompt_logprobs: list[TokenLogprob | None] | None = None
    sent_first: bool = False

    def __post_init__(self) -> None:
        params = self.request.sampling
        self.sampler = Sampler(params)
        self.stops = frozenset() if params.ignore_eos else frozenset(params.stop_token_ids)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.filled < self.prompt_len

    def written(self) -> list[int]:
        """The tokens whose KV is in the slot: the prompt, then the generated tokens fed back
        (the last sampled one is not, until the next decode step)."""
        return (self.request.prompt_token_ids + self.output)[: self.filled]

    def sort_key(self) -> tuple[int, float]:
        """Queue order: priority (lower first), then arrival."""
        return (self.request.priority, self.request.arrival_time)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs: its prompt is computed whole, no kept KV reused."""
        return self.prompt_logprobs is not None

    def event(
        self,
        tokens: list[int],
        reason: FinishReason | None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> TokenEvent:
        """An event carrying ``tokens``, with the request's counts so far; the first one
        carries its prompt logprobs."""
        prompt_lps = None if self.sent_first else self.prompt_logprobs
        self.sent_first = True
        return TokenEvent(
            request_id=self.request.request_id,
            token_ids=tokens,
            completion_tokens=self.generated,
            prompt_tokens=self.prompt_len,
            cached_tokens=self.cached,
            finish_reason=reason,
            prefill_ms=self.prefill_ms,
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
        )
