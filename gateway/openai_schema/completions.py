"""The ``/v1/completions`` request: one prompt (text or token ids) on top of the shared
sampling fields, with ``logprobs`` (at most 5) and ``echo``.

Invariants: one prompt per request, never empty, its token ids in ``[0, MAX_TOKEN_ID]``;
``best_of`` other than 1 and a ``suffix`` are ``unsupported_parameter``. Extensions the
gateway's resume sends: ``resumed_tokens`` (the prompt's last N ids are the reply so far,
which a grammar consumes first) and, only with it, the ``tools`` of the chat it continues.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from gateway.openai_schema.base import INT32_MAX, MAX_TOKENS_LIMIT, Text, check_text, unsupported
from gateway.openai_schema.sampling import SamplingFields, parse_tools
from routing.grammar import InvalidGrammar, check_spec

MAX_TOKEN_ID = INT32_MAX  # token ids in a prompt; the node checks its model's vocabulary


class CompletionRequest(SamplingFields):
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
            calling = parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
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
