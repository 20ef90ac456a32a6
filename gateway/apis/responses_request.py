"""``POST /v1/responses`` bodies, and their translation into chat-completions bodies.

Served: ``input`` (a string, or items: messages with text parts, ``function_call``,
``function_call_output``), ``instructions``, function ``tools`` with ``tool_choice`` and
``parallel_tool_calls``, ``text.format`` (text, json_object, json_schema),
``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``store``,
``previous_response_id``, ``metadata``. Hints accepted and ignored: ``user``,
``safety_identifier``, ``prompt_cache_key``, ``service_tier``, ``text.verbosity``,
``stream_options``, ``reasoning`` items in ``input`` (we never produce them), and
``include: ["reasoning.encrypted_content"]`` (no reasoning is produced to include).

Invariants:
- What we cannot serve is a 400 naming the field (``code: unsupported_parameter``), never
  silently dropped: image, file and audio parts, non-function tools (web search, file search,
  computer use, custom, MCP, ...), ``item_reference`` and other hosted-tool items,
  ``reasoning.effort`` other than none, ``background``, ``conversation``, ``prompt``
  templates, ``truncation: auto``, ``top_logprobs``, ``max_tool_calls``, other ``include``s.
- ``function_call`` items join the assistant message before them (as the model wrote them:
  text, then calls), so a chained conversation renders to the prompt its previous turn's
  prompt and reply were, and the prefix cache holds it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.errors import APIError
from gateway.openai_schema import Text, unsupported

ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_INCLUDES = ("reasoning.encrypted_content",)


def refused(param: str, what: str) -> APIError:
    """The 400 for a field we do not serve."""
    return APIError(
        400, f"'{param}' is not supported: {what}", param=param, code="unsupported_parameter"
    )


def invalid(param: str, what: str) -> APIError:
    return APIError(400, f"Invalid value for '{param}': {what}", param=param, code="invalid_value")


class ResponsesRequest(BaseModel):
    """A Responses API request (unknown fields are accepted and ignored, as for chat)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: Text = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]]
    instructions: Text | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and v.get("effort") not in (None, "none"):
            raise unsupported("reasoning.effort", "the served models do not reason (send none)")
        return v

    @field_validator("include")
    @classmethod
    def _includes(cls, v: list[str] | None) -> list[str] | None:
        for item in v or ():
            if item not in _INCLUDES:
                raise unsupported("include", f"{item!r} is not produced")
        return v

    @field_validator("truncation")
    @classmethod
    def _no_auto_truncation(cls, v: str | None) -> str | None:
        if v == "auto":
            raise unsupported("truncation", "inputs are never truncated (use disabled)")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool | None) -> bool | None:
        if v:
            raise unsupported("background", "responses run while the request is open")
        return v

    @field_validator("conversation", "prompt")
    @classmethod
    def _no_server_objects(cls, v: Any, info: Any) -> Any:
        if v is not None:
            what = "use previous_response_id" if info.field_name == "conversation" else "no"
            raise unsupported(str(info.field_name), f"{what} stored prompt objects")
        return v

    @field_validator("max_tool_calls", "top_logprobs")
    @classmethod
    def _no_limits(cls, v: int | None, info: Any) -> int | None:
        if v:
            raise unsupported(str(info.field_name), "not served (send null)")
        return v

    def format_name(self) -> dict[str, Any]:
        """``text.format`` as the response echoes it."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        return dict(fmt)


# ---- input items -> chat messages ----------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise refused(f"{where}.{j}.type", f"{kind!r} parts (only text is served)")
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise invalid(f"{where}.{j}.text", "must be a string")
        out.append(text)
    return "".join(out)


def _call_of(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise invalid(f"{where}.{key}", "must be a string")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (see the module's docstring)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}")
            msgs.append(
                {"role": role, "content": _text_of(item.get("content"), where + ".content")}
            )
        elif kind == "function_call":
            call = _call_of(item, where)
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last["content"] == "":
                    last["content"] = None
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"{where}.call_id", "must be a string")
            output = _text_of(item.get("output"), f"{where}.output")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # the model's notes: we never produce them, so none come back to render
        else:
            raise refused(f"{where}.type", f"{kind!r} items (served: message, function_call, "
                          "function_call_output)")  # fmt: skip
    return msgs


# ---- tools, format -> chat fields ----------------------------------------------------------
def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise refused(f"tools.{i}.type", f"{tool.get('type')!r} tools (only function tools)")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        if fn.get("strict") is None:
            fn.pop("strict", None)
        if fn.get("parameters") is None:
            fn.pop("parameters", None)
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid("tool_choice", "must be auto, none, required or a function")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise refused("tool_choice", f"{choice.get('type')!r} choices (only function tools)")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid("text.format.type", "must be text, json_object or json_schema")


def chat_body(
    req: ResponsesRequest, history: list[dict[str, Any]], new: list[dict[str, Any]]
) -> dict[str, Any]:
    """The chat-completions body for ``req``: its instructions, the stored ``history`` (a
    previous response's conversation) and its ``new`` input messages."""
    msgs = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": req.model, "messages": [*msgs, *history, *new]}
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    fmt = response_format(req.text)
    if fmt is not None:
        body["response_format"] = fmt
    return body


def _complete(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the one chat assistant message they were, less any call
    the token budget cut short (its arguments not JSON yet: it cannot be rendered or run)."""
    text = "".join(
        part.get("text", "")
        for item in output
        if item["type"] == "message"
        for part in item.get("content", ())
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call" and _complete(item["arguments"])
    ]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg
