"""A request's routing profile: :class:`RequestProfile`, what the router knows about one
OpenAI request, built from its body by :func:`build_profile`, and :func:`prompt_key`. Its block
hashes are the ones the cloud engine's prefix cache publishes, seeded by the model's identity
and the caller's cache scope (``cache_salt``, see :mod:`routing.blocks`), so the same prompt of
two scopes shares no hash; ``expected_output_tokens`` is in ``[1, max_tokens]`` (when set).
Building one is CPU work (tokenizing; the gateway runs long prompts off its event loop) and
raises only what :mod:`routing.request_body` raises for a bad request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from routing.blocks import BLOCK_SIZE, block_hashes, model_seed, reusable_blocks, scope_seed
from routing.fleet.state import Capability, NodeKind
from routing.output_length import OutputLengthEstimator
from routing.prompt import PromptFormatter
from routing.request_body import (
    Route,
    body_field,
    last_message_key,
    needed_capabilities,
    prompt_token_ids,
    requested_choices,
    requested_max_tokens,
)


@dataclass(frozen=True, slots=True)
class RequestProfile:
    """Everything the router knows about one request."""

    model: str  # the concrete model name nodes serve
    model_identity: str
    route: Route
    prompt_token_ids: Sequence[int]
    block_hashes: Sequence[int]
    max_tokens: int | None  # None: the node fills up to its context
    expected_output_tokens: float
    stream: bool
    client_region: str
    api_key: str | None = None  # an id for the caller (a key's hash or name), never a secret
    prompt_key: int | None = None  # names the whole prompt (see :func:`prompt_key`)
    last_message_key: int | None = None  # names its last message (see :func:`last_message_key`)
    # node kind -> expected output there, where it differs from ``expected_output_tokens``
    # (an engine that answered this very prompt: :class:`OutputLengthEstimator`)
    expected_output_by_kind: Mapping[str, float] = field(default_factory=dict)
    choices: int = 1  # n: rows it decodes at once (its choices share the prompt)
    # what a node must advertise to serve it (``routing.fleet.state.Capability`` names in
    # ``NodeState.capabilities``): a grammar for response_format, logprobs, prompt logprobs
    needs: frozenset[str] = frozenset()
    tools: bool = False  # chat ``tools`` ask for the grammar (the field a 400 names)

    @property
    def prompt_logprobs(self) -> bool:
        """It asks for its prompt's logprobs (every position computed, no prefix reuse)."""
        return Capability.PROMPT_LOGPROBS in self.needs

    def expected_output_on(self, kind: str) -> float:
        """The expected completion tokens on a node of ``kind``."""
        return self.expected_output_by_kind.get(kind, self.expected_output_tokens)

    @property
    def first_block(self) -> int | None:
        return self.block_hashes[0] if self.block_hashes else None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def reusable_hashes(self) -> Sequence[int]:
        """The hashes of the leading blocks an engine may reuse (``blocks.reusable_blocks``)."""
        return self.block_hashes[: reusable_blocks(self.prompt_tokens)]

    @property
    def context_needed(self) -> int:
        """Context a node must have: prompt plus max_tokens (plus one token if unspecified)."""
        return self.prompt_tokens + (self.max_tokens if self.max_tokens is not None else 1)


_SEEDS: dict[str, int] = {}  # model identity -> model_seed(identity), a pure function


def _seed(model_identity: str, cache_salt: str = "") -> int:
    seed = _SEEDS.get(model_identity)
    if seed is None:
        if len(_SEEDS) >= 1024:
            _SEEDS.clear()
        seed = _SEEDS[model_identity] = model_seed(model_identity)
    return scope_seed(seed, cache_salt) if cache_salt else seed


def build_profile(
    body: Any,
    formatter: PromptFormatter,
    *,
    model: str,
    model_identity: str,
    route: Route,
    client_region: str,
    outputs: OutputLengthEstimator | None = None,
    api_key: str | None = None,
    cache_salt: str = "",
) -> RequestProfile:
    """Profile an OpenAI chat or completion body (a validated dict or pydantic model);
    its block hashes are those of cache scope ``cache_salt``."""
    ids = prompt_token_ids(body, formatter, route)
    max_tokens = requested_max_tokens(body)
    estimator = outputs if outputs is not None else OutputLengthEstimator()
    hashes = block_hashes(ids, _seed(model_identity, cache_salt))
    first = hashes[0] if hashes else None
    whole = prompt_key(ids, hashes)
    last = last_message_key(body) if route == "chat" else None
    expected = estimator.expected(api_key, route, max_tokens, first, whole, None, last, len(ids))
    by_kind = {
        kind: on_kind
        for kind in NodeKind
        if (
            on_kind := estimator.expected(
                api_key, route, max_tokens, first, whole, kind, last, len(ids)
            )
        )
        != expected
    }
    return RequestProfile(
        model=model,
        model_identity=model_identity,
        route=route,
        prompt_token_ids=ids,
        block_hashes=hashes,
        max_tokens=max_tokens,
        expected_output_tokens=expected,
        stream=bool(body_field(body, "stream", False)),
        client_region=client_region,
        api_key=api_key,
        prompt_key=whole,
        last_message_key=last,
        expected_output_by_kind=by_kind,
        choices=requested_choices(body),
        needs=needed_capabilities(body, route),
        tools=route == "chat" and bool(body_field(body, "tools")),
    )


def prompt_key(ids: Sequence[int], hashes: Sequence[int]) -> int:
    """A key for the whole prompt: its last block hash (which chains every full block before
    it) and the tokens of the partial block after it. O(block) beyond the hashing done anyway."""
    tail = tuple(ids[len(hashes) * BLOCK_SIZE :])
    return hash((hashes[-1] if hashes else 0, len(ids), tail))
