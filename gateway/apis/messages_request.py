"""``POST /v1/messages`` (Anthropic's Messages API) bodies, and their chat translation.

Served: ``system`` (a string or text blocks), ``messages`` with ``text``, ``tool_use`` and
``tool_result`` blocks, ``tools`` (``name``, ``description``, ``input_schema``),
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``, with ``disable_parallel_tool_use``),
``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``stream``.
Hints accepted and ignored: ``cache_control`` on any block (the prefix cache needs no marks),
``metadata``, ``service_tier``, a ``tool_result``'s ``is_error`` (its text says so).

Invariants:
- What we cannot serve is a 400 naming the field (in Anthropic's error shape, by the route),
  never silently dropped: ``thinking`` (other than disabled) and thinking blocks, image,
  document and other non-text blocks, server tools (any ``tools[i].type`` other than custom),
  ``container``, ``mcp_servers``.
- One Anthropic message may become several chat messages: a user turn's ``tool_result``s
  become ``tool`` messages (in order) before its text; an assistant turn's text and
  ``tool_use``s become one assistant message with ``tool_calls``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.apis.responses_request import invalid, refused
from gateway.openai_schema import Text, unsupported


class MessagesRequest(BaseModel):
    """A Messages API request (unknown fields accepted and ignored)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: Text = Field(min_length=1, max_length=256)
    max_tokens: int = Field(ge=1, le=2**31 - 1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: Any = None

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and v.get("type") != "disabled":
            raise unsupported("thinking", "the served models do not think (send disabled)")
        return v

    @field_validator("container", "mcp_servers")
    @classmethod
    def _no_hosted(cls, v: Any, info: Any) -> Any:
        if v:
            raise unsupported(str(info.field_name), "no hosted tools are served")
        return v


class CountTokensRequest(MessagesRequest):
    """``/v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    max_tokens: int = Field(default=1, ge=1, le=2**31 - 1)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(where, "must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise invalid(f"{where}.{j}", "must be a content block")
    return content


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise invalid(f"{where}.text", "must be a string")
    return block["text"]


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    parts = []
    for j, block in enumerate(system):
        if block.get("type") != "text":
            raise refused(f"system.{j}.type", f"{block.get('type')!r} blocks (only text)")
        parts.append(_text(block, f"system.{j}"))
    return "\n".join(parts) or None


def _result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    parts = []
    for j, inner in enumerate(_blocks(content, f"{where}.content")):
        if inner.get("type") != "text":
            raise refused(f"{where}.content.{j}.type", f"{inner.get('type')!r} blocks (only text)")
        parts.append(_text(inner, f"{where}.content.{j}"))
    return "".join(parts)


def _refuse_block(kind: Any, where: str) -> None:
    if kind in ("thinking", "redacted_thinking"):
        raise refused(f"{where}.type", "thinking blocks (the served models do not think)")
    raise refused(f"{where}.type", f"{kind!r} blocks (served: text, tool_use, tool_result)")


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(_blocks(content, where)):
        kind, at = block.get("type"), f"{where}.{j}"
        if kind == "text":
            text.append(_text(block, at))
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(f"{at}.tool_use_id", "must be a string")
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                          "content": _result_text(block, at)})  # fmt: skip
        else:
            _refuse_block(kind, at)
    if text or not tools:
        tools.append({"role": "user", "content": "".join(text)})
    return tools


def _assistant(content: Any, where: str) -> dict[str, Any]:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(content, where)):
        kind, at = block.get("type"), f"{where}.{j}"
        if kind == "text":
            text.append(_text(block, at))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise invalid(at, "tool_use blocks need an id and a name")
            if not isinstance(block.get("input"), dict):
                raise invalid(f"{at}.input", "must be an object")
            args = json.dumps(block["input"], separators=(",", ":"), ensure_ascii=False)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": args}})  # fmt: skip
        else:
            _refuse_block(kind, at)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    system = system_text(req.system)
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        role: Literal["user", "assistant"] | Any = m.get("role")
        if role == "user":
            out += _user(m.get("content"), where + ".content")
        elif role == "assistant":
            out.append(_assistant(m.get("content"), where + ".content"))
        else:
            raise invalid(f"{where}.role", "must be user or assistant")
    return out


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise refused(f"tools.{i}.type", f"{tool.get('type')!r} server tools (only custom)")
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        if fn["parameters"] is None:
            raise invalid(f"tools.{i}.input_schema", "is required")
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice: dict[str, Any]) -> str | dict[str, Any]:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice.type", "must be auto, any, tool (with a name) or none")


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat-completions body for ``req``."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_tokens": req.max_tokens,
    }
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        choice = _choice(req.tool_choice)
        if req.tools or choice != "none":
            body["tool_choice"] = choice
        if req.tool_choice.get("disable_parallel_tool_use") and req.tools:
            body["parallel_tool_calls"] = False
    return body
