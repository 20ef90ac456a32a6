"""The fields and checks chat and completions requests share: model, token budget, sampling,
stop, streaming, ``n``, ``response_format``, the vLLM extensions, and the parsed tool calling
and grammar both serve from.

Invariants: every number has a bound (integers a sane range, so nothing downstream, the
routing profile's floats, block hashing's 32-bit ids, the engines' int64 tensors, can
overflow; floats finite, NaN and infinities failing their bounds); ``seed`` is a signed 64-bit
integer, as in OpenAI's API, whose 64-bit pattern seeds the engines (``routing.sampling_limits``);
a ``response_format`` (``text``, ``json_object`` or ``json_schema`` with ``strict``) the
grammar library cannot compile is a 400 naming it, before any tokenizing or routing
(``routing.grammar``), and is not combined with ``min_tokens``; ``min_tokens`` is at most the
token budget; penalties and ``logit_bias`` are accepted only as no-ops.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from pydantic import AfterValidator, Field, ValidationInfo, field_validator

from gateway.openai_schema.base import MAX_TOKENS_LIMIT, StrictBody, Text, check_text, unsupported
from routing.choices import MAX_CHOICES
from routing.grammar import GrammarSpec, InvalidGrammar, check_spec, spec_from_response_format
from routing.sampling_limits import API_SEED_MAX, API_SEED_MIN, MAX_TOP_K
from routing.tools import InvalidTools, ToolCalling, calling_of, parse_tool_calling

MAX_STOP_SEQUENCES = 4
MAX_N = MAX_CHOICES  # OpenAI's bound on n; a node serves up to its engine's ``max_n``


class StreamOptions(StrictBody):
    include_usage: bool = False


class SamplingFields(StrictBody):
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


def parse_tools(tools: Any, choice: Any, parallel: bool | None) -> ToolCalling | None:
    try:
        return parse_tool_calling(tools, choice, parallel)
    except InvalidTools as exc:
        raise ValueError(str(exc)) from None
