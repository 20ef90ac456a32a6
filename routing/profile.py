"""A request's routing profile: what the router needs to know about one OpenAI request.

Invariants:
- The prompt is rendered with the target model's own chat template and tokenized with its own
  tokenizer exactly as the node does (``template_messages`` flattening, no BOS of our own), so
  the block hashes here are the hashes the cloud engine's prefix cache publishes.
- ``block_hashes`` are seeded by the model's identity and the caller's cache scope
  (``cache_salt``, see :mod:`routing.blocks`): the same prompt of two scopes shares no hash.
- ``expected_output_tokens`` is in ``[1, max_tokens]`` (when ``max_tokens`` is set): learned per
  (API key, route) as an EWMA of observed completion tokens, else the configured default.
- Building a profile is CPU work (tokenizing): the gateway runs long prompts off its event loop.
- Whatever the body holds, building a profile raises :class:`ProfileError` (a ``ValueError``)
  or :class:`routing.prompt.TemplateError` for a bad request, nothing else: token ids outside
  ``[0, MAX_TOKEN_ID]``, text with lone surrogates, a max_tokens that is not an integer in
  ``[1, MAX_TOKENS]`` (the gateway's schema refuses them first, with the field's name).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from routing.blocks import BLOCK_SIZE, block_hashes, model_seed, reusable_blocks, scope_seed
from routing.choices import MAX_CHOICES
from routing.fleet.state import Capability, NodeKind
from routing.prompt import PromptFormatter, UnencodableText
from routing.tools import InvalidTools, calling_of, template_inputs

Route = Literal["chat", "completions"]

MAX_TOKEN_ID = 2**31 - 1  # block hashing packs ids in 32 bits; vocabularies are far smaller
MAX_TOKENS = 2**31 - 1  # max_tokens / max_completion_tokens


class ProfileError(ValueError):
    """The request cannot be profiled (no prompt, more than one prompt, bad token ids)."""


class OutputKnobs(BaseModel):
    """Expected-output-length knobs (one section of the policy YAML)."""

    model_config = ConfigDict(extra="forbid")

    default_tokens: float = Field(default=128.0, gt=0)
    alpha: float = Field(default=0.2, gt=0, le=1)
    min_samples: int = Field(default=1, ge=1, description="samples before the EWMA is used")
    max_keys: int = Field(default=10_000, ge=1, description="LRU bound on (key, route) pairs")
    whole_prompt: bool = Field(
        default=True, description="a prompt sent again is predicted by its own answers first"
    )
    last_message: bool = Field(
        default=True,
        description="next, requests of one app (first prompt block) and cap whose last message "
        "is the same (a question asked in many chats, or with other histories) are predicted by "
        "each other's answers",
    )
    length_bucket: bool = Field(
        default=True,
        description="next, requests of one app and cap with prompts of like length (within a "
        "power of two) are predicted by each other's answers: a document to summarize and a "
        "one-line question under one app answer at other lengths",
    )


class OutputLengthEstimator:
    """EWMA of the logarithm of completion tokens (their geometric mean) per (API key, route,
    whole prompt, node kind), per (API key, route, whole prompt), per (API key, route,
    max_tokens, first prompt block) and its last message, and its prompt length's power of two,
    per (API key, route, max_tokens, first prompt block), per (API key, route, max_tokens) and
    per (API key, route), LRU-bounded; a default until learned.

    A prompt sent again (an automation's fixed request, a retried question) is best predicted
    by its own earlier answers: under greedy decoding the length repeats, so that statistic
    answers after one sample, whatever ``max_tokens`` the request sets. It repeats on one
    engine: the edge's int8 ONNX graph and the cloud's torch model can answer the same prompt
    at other lengths (the same words, then one token apart), so the whole prompt's statistic is
    kept per node kind first, and across kinds for a kind that has not answered it yet. It
    keeps answers that ended on their own (fewer tokens than their ``max_tokens``) apart from
    answers cut at their cap, which only say the natural length is at least that cap: a prompt
    that stopped at 7 tokens under a cap of 16 is predicted at 7 under a cap of 32, and one cut
    at 16 is predicted at 16 or more, until the prompt ends on its own again there (the same
    prompt's greedy answer can change with the numerics of its run: the edge answered one
    question at 16 tokens cold and at 7 with its prefix reused, and a bound kept for good
    predicted 16 for every later 7). Otherwise apps send one ``max_tokens`` per feature (a
    one-line answer, a summary, code) and one system prompt per feature, whose first block
    hash names it; requests alike in both are the best guide to each other. Within one app
    the same last message (a question asked in many chats) and then a like prompt length (a
    document to summarize against a one-line question) tell requests apart further: a template
    that adds a default system prompt gives every request without one the same first block,
    and the benchmark's mix then pooled one-word answers, 16-token chat turns and summaries
    the int8 edge ends at once. The most specific statistic with enough samples answers
    (``min_samples`` for all but the whole prompt).
    """

    _ANY = -1  # the max_tokens or prefix slot of a coarser statistic

    def __init__(self, knobs: OutputKnobs | None = None) -> None:
        self.knobs = knobs or OutputKnobs()
        self._stats: OrderedDict[tuple[str, str, int, int], tuple[float, int]] = OrderedDict()

    def configure(self, knobs: OutputKnobs) -> None:
        self.knobs = knobs
        self._trim()

    @staticmethod
    def _to_stat(tokens: float) -> float:
        return math.log(max(1.0, tokens))

    @staticmethod
    def _from_stat(value: float) -> float:
        # rounded: a length seen once (or always the same) comes back as that whole number
        return round(math.exp(value), 6)

    def _used(
        self, prompt: int | None, last: int | None, prompt_tokens: int | None
    ) -> tuple[int | None, int | None, int | None]:
        """The whole prompt's key, the last message's and the prompt's length, where the knobs
        use them."""
        k = self.knobs
        return (
            prompt if k.whole_prompt else None,
            last if k.last_message else None,
            prompt_tokens if k.length_bucket else None,
        )

    def _trim(self) -> None:
        while len(self._stats) > self.knobs.max_keys:
            self._stats.popitem(last=False)

    @classmethod
    def _prompt_keys(
        cls, key: str, route: str, prompt: int, kind: str | None, suffix: str = ""
    ) -> list[tuple[str, str, int, int]]:
        """The whole prompt's statistics (``suffix`` "-cut": its cut answers), the node
        kind's first; they live in the prefix slot under routes of their own."""
        out = [(key, f"{route}#prompt{suffix}@{kind}", cls._ANY, prompt)] if kind else []
        return [*out, (key, f"{route}#prompt{suffix}", cls._ANY, prompt)]

    @classmethod
    def _keys(
        cls,
        api_key: str | None,
        route: str,
        max_tokens: int | None,
        prefix: int | None,
        prompt: int | None = None,
        kind: str | None = None,
        last: int | None = None,
        prompt_tokens: int | None = None,
    ) -> tuple[int, list[tuple[str, str, int, int]]]:
        """The statistics a request belongs to, most specific first, and how many of them
        (first) are the whole prompt's. ``last`` names its last message, ``prompt_tokens``
        its length for the app's statistic by length (None: not used)."""
        key, any_ = api_key or "", cls._ANY
        cap = max_tokens if max_tokens is not None and 0 < max_tokens <= MAX_TOKENS else any_
        out = [] if prompt is None else cls._prompt_keys(key, route, prompt, kind)
        whole = len(out)
        if cap != any_ and prefix is not None:
            if last is not None:
                out.append((key, f"{route}#last", cap, hash((prefix, last))))
            if prompt_tokens is not None and prompt_tokens > 0:
                out.append((key, f"{route}#len{prompt_tokens.bit_length()}", cap, prefix))
            out.append((key, route, cap, prefix))
        if cap != any_:
            out.append((key, route, cap, any_))
        out.append((key, route, any_, any_))
        return whole, out

    def expected(
        self,
        api_key: str | None,
        route: str,
        max_tokens: int | None = None,
        prefix: int | None = None,
        prompt: int | None = None,
        kind: str | None = None,
        last: int | None = None,
        prompt_tokens: int | None = None,
    ) -> float:
        """The expected completion tokens on a node of ``kind`` (None: any kind).

        The whole prompt's answers on this kind, else on any kind, come first (their own
        length, and at least the longest cap they were cut at); the first of the two levels
        that has seen the prompt decides, then the coarser statistics."""
        value = self.knobs.default_tokens
        prompt, last, prompt_tokens = self._used(prompt, last, prompt_tokens)
        whole, keys = self._keys(
            api_key, route, max_tokens, prefix, prompt, kind, last, prompt_tokens
        )
        cuts = (
            [] if prompt is None else self._prompt_keys(api_key or "", route, prompt, kind, "-cut")
        )
        at_least, known = 0.0, False  # the longest cap this prompt's answers were cut at
        for natural, cut in zip(keys[:whole], cuts, strict=True):
            stat, bound = self._stats.get(natural), self._stats.get(cut)
            if stat is None and bound is None:
                continue
            at_least = bound[0] if bound is not None else 0.0
            if stat is not None:
                value, known = self._from_stat(stat[0]), True
            break
        if not known:
            for k in keys[whole:]:
                stat = self._stats.get(k)
                if stat is not None and stat[1] >= self.knobs.min_samples:
                    value = self._from_stat(stat[0])
                    break
        value = max(value, at_least)
        if max_tokens is not None and max_tokens < value:  # int vs float: exact, never overflows
            value = float(max_tokens)
        return max(1.0, value)

    def observe(
        self,
        api_key: str | None,
        route: str,
        completion_tokens: int,
        max_tokens: int | None = None,
        prefix: int | None = None,
        prompt: int | None = None,
        kind: str | None = None,
        last: int | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """Learn one answer of ``completion_tokens`` given by a node of ``kind``."""
        x = float(completion_tokens)
        prompt, last, prompt_tokens = self._used(prompt, last, prompt_tokens)
        whole, keys = self._keys(
            api_key, route, max_tokens, prefix, prompt, kind, last, prompt_tokens
        )
        cuts = (
            [] if prompt is None else self._prompt_keys(api_key or "", route, prompt, kind, "-cut")
        )
        cut_off = max_tokens is not None and completion_tokens >= max_tokens
        if cut_off:  # a bound, not a length of its question
            keys = [k for k in keys if "#last" not in k[1]]
        if cuts and cut_off:
            keys = keys[whole:]  # cut at its cap: not its own length, only a bound on it
            for cut in cuts:
                prev_cut = self._stats.pop(cut, None)
                self._stats[cut] = (max(x, prev_cut[0]) if prev_cut else x, 1)
        else:
            for cut in cuts:  # it ended on its own: an earlier cut bounds it no more
                self._stats.pop(cut, None)
        v = self._to_stat(x)
        for k in keys:
            prev = self._stats.pop(k, None)
            if prev is None:
                self._stats[k] = (v, 1)
            else:
                self._stats[k] = (prev[0] + self.knobs.alpha * (v - prev[0]), prev[1] + 1)
        self._trim()

    def __len__(self) -> int:
        return len(self._stats)


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


def _get(body: Any, name: str, default: Any = None) -> Any:
    if type(body) is dict or isinstance(body, Mapping):  # a plain dict: skip the ABC check
        return body.get(name, default)
    return getattr(body, name, default)


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        parts.append(p.get("text", "") if isinstance(p, Mapping) else getattr(p, "text", ""))
    return "".join(parts)


def chat_prompt(
    body: Any, formatter: PromptFormatter
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A chat body's messages and template variables (its tools), as the node renders them."""
    messages = _get(body, "messages") or []
    if not messages:
        raise ProfileError("messages must not be empty")
    try:
        return template_inputs(messages, calling_of(body), formatter.chat_template)
    except InvalidTools as exc:
        raise ProfileError(str(exc)) from exc


def prompt_token_ids(body: Any, formatter: PromptFormatter, route: Route) -> list[int]:
    """The prompt's token ids, as the node will compute them."""
    try:
        if route == "chat":
            messages, extra = chat_prompt(body, formatter)
            return formatter.encode_chat(messages, **extra)
        prompt = _get(body, "prompt")
        if isinstance(prompt, str):
            ids = formatter.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = list(prompt)
            if min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
                raise ProfileError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]")
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            ids = formatter.encode(prompt[0])
        elif (
            isinstance(prompt, list)
            and len(prompt) == 1
            and isinstance(prompt[0], list)
            and prompt[0]
            and all(type(t) is int for t in prompt[0])
        ):  # one prompt of token ids in a batch of one (evaluation harnesses send these)
            ids = list(prompt[0])
            if min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
                raise ProfileError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]")
        else:
            raise ProfileError("prompt must be a string, one string in a list, or token ids")
    except UnencodableText as exc:
        raise ProfileError(str(exc)) from exc
    if not ids:
        raise ProfileError("prompt is empty after tokenization")
    return ids


def requested_max_tokens(body: Any) -> int | None:
    """``max_completion_tokens``, else ``max_tokens`` (as the node reads them), else None."""
    value = _get(body, "max_completion_tokens")
    name = "max_completion_tokens"
    if value is None:
        value, name = _get(body, "max_tokens"), "max_tokens"
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= MAX_TOKENS:
        raise ProfileError(f"{name} must be an integer in [1, {MAX_TOKENS}]")
    return value


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
        stream=bool(_get(body, "stream", False)),
        client_region=client_region,
        api_key=api_key,
        prompt_key=whole,
        last_message_key=last,
        expected_output_by_kind=by_kind,
        choices=_choices(body),
        needs=needed_capabilities(body, route),
        tools=route == "chat" and bool(_get(body, "tools")),
    )


def _choices(body: Any) -> int:
    n = _get(body, "n", 1)
    return n if type(n) is int and 1 <= n <= MAX_CHOICES else 1


def needed_capabilities(body: Any, route: Route) -> frozenset[str]:
    """What a node must list in ``NodeState.capabilities`` to serve ``body``: a grammar
    (``response_format`` json_object or json_schema, or chat ``tools``), logprobs (chat ``logprobs: true``,
    completions ``logprobs`` set), and prompt logprobs (completions with ``echo`` too)."""
    needs: set[str] = set()
    rf = _get(body, "response_format", None)
    kind = rf.get("type") if isinstance(rf, Mapping) else None
    if kind in ("json_object", "json_schema") or (route == "chat" and _get(body, "tools")):
        needs.add(Capability.GRAMMAR)
    if route == "chat":
        if _get(body, "logprobs"):
            needs.add(Capability.LOGPROBS)
    elif _get(body, "logprobs") is not None:
        needs.add(Capability.LOGPROBS)
        if _get(body, "echo"):
            needs.add(Capability.PROMPT_LOGPROBS)
    return frozenset(needs)


def last_message_key(body: Any) -> int | None:
    """A key for a chat's last message: its role and text (None: no messages). Hashed in
    this process only, as :func:`prompt_key` is: output statistics are the gateway's own."""
    messages = _get(body, "messages") or []
    if not messages:
        return None
    last = messages[-1]
    return hash((_get(last, "role"), _message_text(_get(last, "content"))))


def prompt_key(ids: Sequence[int], hashes: Sequence[int]) -> int:
    """A key for the whole prompt: its last block hash (which chains every full block before
    it) and the tokens of the partial block after it. O(block) beyond the hashing done anyway."""
    tail = tuple(ids[len(hashes) * BLOCK_SIZE :])
    return hash((hashes[-1] if hashes else 0, len(ids), tail))
