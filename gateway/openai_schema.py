"""OpenAI request and response bodies (the subset this gateway serves), validated by pydantic.

The gateway validates every body with these models at its edge, and each node validates it
again with the same models, so a bad request is a 400 naming its field at either, never a 500.

Invariants:
- Wrong types are rejected, never coerced (``"5"`` is not a max_tokens): models are strict.
- Every number has a bound: integers (``max_tokens``, ``max_completion_tokens``, ``n``,
  ``top_k``, ``seed``, token ids, ...) have a sane range, so nothing downstream (the routing
  profile's floats, block hashing's 32-bit ids, the engines' int64 tensors) can overflow;
  floats are finite (NaN and infinities fail their bounds). ``seed`` is a signed 64-bit
  integer, as in OpenAI's API; engines seed with its 64-bit pattern, so a negative seed is an
  ordinary seed (``routing.sampling_limits``).
- No string contains a lone surrogate (``"\\ud800"`` in JSON): such text has no UTF-8 form and
  no tokenization; it is a 400 naming the field, as at OpenAI.
- ``logprobs`` / ``top_logprobs`` (chat, at most 20; ``top_logprobs`` above 0 needs
  ``logprobs: true``), ``logprobs`` (completions, at most 5) with ``echo``, and ``n`` are served.
- ``response_format`` (chat and completions): ``text``, ``json_object`` or ``json_schema``
  (with ``strict``); a schema the grammar library cannot compile is a 400 naming
  ``response_format`` here, before any tokenizing or routing (``routing.grammar``). It is not
  combined with ``min_tokens`` (a grammar may complete before it). ``resumed_tokens`` (an
  extension the gateway's resume sends to ``/v1/completions``): the prompt's last N token ids
  are the reply's own so far, which the grammar consumes first.
- ``tools`` (function tools) with ``tool_choice`` and ``parallel_tool_calls``; assistant
  messages with ``tool_calls`` and ``tool`` messages (``tool_call_id``) in the history
  (``routing.tools``). Not combined with ``min_tokens``.
- Known OpenAI fields we cannot honour (``functions`` and ``function_call``, the deprecated
  form of tools, ``logit_bias``, non-zero penalties, ``best_of`` > 1, ``audio``,
  ``modalities`` other than text, ``prediction``, ``store: true``, ``reasoning_effort``,
  ``web_search_options``, ``service_tier`` other than auto/default, ``suffix``) are
  accepted only with their default, no-op values (``null``, ``false``, ``0``, ``[]``, ``{}``,
  ``"none"``, ...) and otherwise rejected with a 400 naming the field and
  ``code: "unsupported_parameter"``, never silently ignored. ``metadata``, ``user`` and other
  hints that change nothing without storage are accepted.
- Extensions, as in vLLM: ``top_k``, ``ignore_eos`` (the end-of-sequence token does not end
  the completion) and ``min_tokens`` (no stop before that many tokens; at most the budget).
- Unknown fields (none of the above: newer SDKs' additions) are accepted and ignored, as
  OpenAI-compatible servers commonly do, so newer SDKs keep working.
"""

from __future__ import annotations

import functools
import re
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from routing.choices import MAX_CHOICES
from routing.grammar import GrammarSpec, InvalidGrammar, check_spec, spec_from_response_format
from routing.sampling_limits import API_SEED_MAX, API_SEED_MIN, MAX_TOP_K
from routing.tools import InvalidTools, ToolCalling, calling_of, parse_tool_calling

MAX_STOP_SEQUENCES = 4
INT32_MAX = 2**31 - 1
MAX_TOKENS_LIMIT = INT32_MAX  # max_tokens / max_completion_tokens; the node's context decides
MAX_TOKEN_ID = INT32_MAX  # token ids in a prompt; the node checks its model's vocabulary
MAX_N = MAX_CHOICES  # OpenAI's bound on n; a node serves up to its engine's ``max_n``

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(value: str) -> str:
    """``value`` unchanged, or a ValueError if it holds a lone surrogate (no UTF-8 form)."""
    if not value.isascii() and _SURROGATE.search(value) is not None:
        raise ValueError("text must not contain lone surrogates (U+D800 to U+DFFF)")
    return value


Text = Annotated[str, AfterValidator(check_text)]


def unsupported(field: str, what: str) -> PydanticCustomError:
    """The error for a field we cannot honour (code ``unsupported_parameter``)."""
    return PydanticCustomError(
        "unsupported_parameter",
        "'{field}' is not supported: {what}",
        {"field": field, "what": what},
    )


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCall(_Body):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: Text | None = None  # tool: the call this result answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    @field_validator("content")
    @classmethod
    def _text_content(cls, v: str | list[TextPart] | None) -> str | list[TextPart] | None:
        return check_text(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role '{self.role}'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool messages need tool_call_id (the call they answer)")
        return self


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: Annotated[str, Field(min_length=1, max_length=256), AfterValidator(check_text)]
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    # absent: the model's generation_config default, else 1.0 / 1.0 / 0 (off), as in vLLM
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K)  # extension, as in vLLM
    seed: int | None = Field(default=None, ge=API_SEED_MIN, le=API_SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None
    user: Text | None = None
    # before min_tokens: its check reads it
    response_format: dict[str, Any] | None = Field(
        default=None,
        description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name", "schema", "strict"}}: the reply follows it (compact JSON)',
    )
    # extensions, as in vLLM: run past the end-of-sequence token; no stop before min_tokens
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """A format the grammar library compiles (its schema checked here, no tokenizer)."""
        try:
            spec = spec_from_response_format(v)
            if spec is not None:
                check_spec(spec)
        except InvalidGrammar as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("min_tokens")
    @classmethod
    def _no_min_with_grammar(cls, v: int, info: ValidationInfo) -> int:
        rf = info.data.get("response_format")
        if v and spec_from_response_format(rf) is not None:
            raise unsupported("min_tokens", "it is not combined with response_format (use 0)")
        return v

    @functools.cached_property
    def tool_calling(self) -> ToolCalling | None:
        """The tool calling the request asks for (None: no tools), parsed once."""
        return calling_of(self)

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        """The reply's grammar: tool calls (with ``response_format`` as the text in ``auto``
        and ``none``), else the one ``response_format`` asks for (None: plain text)."""
        rf = spec_from_response_format(self.response_format)
        calling = self.tool_calling
        if calling is None:
            return rf
        return calling.grammar_spec(rf if calling.mode in ("auto", "none") else None)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(s == "" for s in items):
            raise ValueError("stop sequences must not be empty")
        for item in items:
            check_text(item)
        return items

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float, info: ValidationInfo) -> float:
        if v:
            raise unsupported(str(info.field_name), "penalties are not applied (use 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v:
            raise unsupported("logit_bias", "logits are not biased (send null or {})")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, v: int, info: ValidationInfo) -> int:
        """min_tokens at most the completion's token budget (declared before it)."""
        for name in ("max_completion_tokens", "max_tokens"):
            budget = info.data.get(name)
            if budget is not None:
                if v > budget:
                    raise ValueError(f"min_tokens ({v}) must not exceed {name} ({budget})")
                break
        return v

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_max_tokens(self) -> int | None:
        """The completion's token budget: ``max_completion_tokens``, else ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


_NO_TOOL_CHOICE = ("none", "auto")  # "auto" without tools calls none
_SERVICE_TIERS = ("auto", "default")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    store: bool | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    service_tier: str | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):  # 0 asks for nothing: accepted alone
            raise ValueError("logprobs must be true when top_logprobs is above 0")
        return v

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, v: Any, info: ValidationInfo) -> Any:
        if v and v not in _NO_TOOL_CHOICE:
            raise unsupported(
                str(info.field_name), "the deprecated functions API is not served (use tools)"
            )
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[Any] | None) -> list[Any] | None:
        """Function tools whose schemas compile (their grammar checked without a tokenizer)."""
        calling = _parse_tools(v, "auto", None)
        if calling is not None:
            try:
                check_spec(calling.grammar_spec(), param="tools")
            except InvalidGrammar as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any, info: ValidationInfo) -> Any:
        """``auto``, ``none``, ``required`` or a named function among the tools."""
        if "tools" in info.data:  # the tools were valid
            _parse_tools(info.data["tools"], v, None)
        return v

    @model_validator(mode="after")
    def _no_min_tokens_with_tools(self) -> ChatCompletionRequest:
        if self.tools and self.min_tokens:
            raise unsupported("min_tokens", "it is not combined with tools (use 0)")
        return self

    @field_validator("audio", "prediction", "web_search_options")
    @classmethod
    def _none_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise unsupported(str(info.field_name), "this gateway serves text completions only")
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _no_reasoning(cls, v: str | None) -> str | None:
        if v is not None:
            raise unsupported("reasoning_effort", "the models served are not reasoning models")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise unsupported("modalities", 'only ["text"] is served')
        return v

    @field_validator("store")
    @classmethod
    def _no_store(cls, v: bool | None) -> bool | None:
        if v:
            raise unsupported("store", "completions are not stored (use false)")
        return v

    @field_validator("service_tier")
    @classmethod
    def _service_tier(cls, v: str | None) -> str | None:
        if v is not None and v not in _SERVICE_TIERS:
            raise unsupported("service_tier", 'one tier is served (use "auto" or "default")')
        return v


def _parse_tools(tools: Any, choice: Any, parallel: bool | None) -> ToolCalling | None:
    try:
        return parse_tool_calling(tools, choice, parallel)
    except InvalidTools as exc:
        raise ValueError(str(exc)) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field()
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1, le=20)
    echo: bool = False
    suffix: Text | None = None
    # extension: the prompt's last N ids are the reply so far (a resumed stream's), which a
    # response_format grammar consumes before the first new token
    resumed_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    # extension, with resumed_tokens set (0 too): the tools of the chat a resumed stream continues
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tools_continue_a_chat(self) -> CompletionRequest:
        if self.tools and "resumed_tokens" not in self.model_fields_set:
            raise unsupported("tools", "tools are served on /v1/chat/completions")
        if self.tools:
            calling = _parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
            assert calling is not None
            try:
                check_spec(calling.grammar_spec(), param="tools")
            except InvalidGrammar as exc:
                raise ValueError(str(exc)) from None
        return self

    @field_validator("prompt")
    @classmethod
    def _one_prompt(
        cls, v: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], list):  # a batch of token id lists
            if len(v) != 1:
                raise ValueError("one prompt per request is supported")
            v = v[0]  # type: ignore[assignment]
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if all(isinstance(x, str) for x in v):
                if len(v) != 1:
                    raise ValueError("one prompt per request is supported")
                if v[0] == "":
                    raise ValueError("prompt must not be empty")
                check_text(v[0])
            elif any(not 0 <= x <= MAX_TOKEN_ID for x in v):  # type: ignore[operator]
                raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]")
        elif v == "":
            raise ValueError("prompt must not be empty")
        else:
            check_text(v)
        return v

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise unsupported(
                "best_of", "candidates are not ranked server-side (use n for several choices)"
            )
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise unsupported("suffix", "insertion is not supported (send null)")
        return v


def resumable(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether a broken stream of ``req`` can be resumed from its token ids on another node
    (``gateway.front.resume``): one choice, no logprobs, no echo."""
    if req.n != 1 or req.logprobs:
        return False
    return not (isinstance(req, CompletionRequest) and (req.echo or req.logprobs is not None))


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached},
    )


def now() -> int:
    return int(time.time())


def model_card(model_id: str, owned_by: str = "edgecloud") -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": owned_by}
