"""The ``/v1/chat/completions`` request: its messages (text parts, assistant tool calls, tool
results) and the chat-only fields on top of the shared sampling fields.

Invariants: a message has content unless it is an assistant's, only assistant messages carry
``tool_calls`` and ``tool`` messages name the call they answer (``tool_call_id``);
``top_logprobs`` (at most 20) above 0 needs ``logprobs: true``; ``tools`` are function tools
whose grammar compiles and ``tool_choice`` names one of them, not combined with
``min_tokens`` (``routing.tools``); ``functions`` / ``function_call`` (the deprecated form of
tools), ``audio``, ``modalities`` other than text, ``prediction``, ``store: true``,
``reasoning_effort``, ``web_search_options`` and ``service_tier`` other than auto/default are
accepted only with their no-op values, else ``unsupported_parameter``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from gateway.openai_schema.base import StrictBody, Text, check_text, unsupported
from gateway.openai_schema.sampling import SamplingFields, parse_tools
from routing.grammar import InvalidGrammar, check_spec


class TextPart(StrictBody):
    type: Literal["text"]
    text: Text


class FunctionCall(StrictBody):
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(StrictBody):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictBody):
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


_NO_TOOL_CHOICE = ("none", "auto")  # "auto" without tools calls none
_SERVICE_TIERS = ("auto", "default")


class ChatCompletionRequest(SamplingFields):
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
        calling = parse_tools(v, "auto", None)
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
            parse_tools(info.data["tools"], v, None)
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
