"""Chat replies written as Anthropic Messages objects and event streams, and errors in
Anthropic's shape.

Invariants:
- A stream is ``message_start`` (usage: the prompt as the gateway counted it), then per content
  block ``content_block_start`` / ``content_block_delta``s (``text_delta``,
  ``input_json_delta``) / ``content_block_stop`` in index order, then ``message_delta`` (the
  ``stop_reason`` and the final usage) and ``message_stop``; a stream that breaks ends with an
  ``error`` event instead. The deltas of a block add up to it in the whole message.
- Usage as Anthropic counts it: ``input_tokens`` excludes the prompt tokens read from the
  prefix cache, which are ``cache_read_input_tokens``; nothing is ever written to a cache
  by request (``cache_creation_input_tokens`` is 0).
- Stop reasons: ``end_turn`` (the model stopped, or hit a stop sequence: nodes do not say
  which), ``max_tokens``, ``tool_use``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from gateway.apis.chat_events import (
    CallArgs,
    CallStart,
    ChatEvent,
    Finish,
    StreamFailed,
    TextDelta,
    Usage,
    UsageSeen,
)
from gateway.apis.responses_reply import new_id
from gateway.errors import APIError

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(exc: APIError) -> JSONResponse:
    """``exc`` in Anthropic's error shape, with its status and headers."""
    message = exc.message if exc.param is None else f"{exc.param}: {exc.message}"
    return JSONResponse(error_body(exc.status, message), exc.status, headers=exc.headers)


def usage_object(u: Usage, completion: int | None = None) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt - u.cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached,
        "output_tokens": u.completion if completion is None else completion,
    }


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its ``input``; a call cut short by ``max_tokens`` (not JSON yet)
    is ``{}`` (the stop reason says it was cut)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def sse(kind: str, data: dict[str, Any]) -> bytes:
    text = json.dumps({"type": kind, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {text}\n\n".encode()


class MessageWriter:
    """One message, built from a chat reply's events."""

    def __init__(self, model: str) -> None:
        self.id = new_id("msg")
        self.model = model
        self.content: list[dict[str, Any]] = []
        self.open: int | None = None  # the index of the block being streamed
        self.calls: dict[int, int] = {}  # chat call index -> block index
        self.args: dict[int, str] = {}  # block index -> its input's JSON text so far
        self.finish: str | None = None
        self.usage = Usage(0, 0, 0)
        self.failed: str | None = None

    def message(self) -> dict[str, Any]:
        content = [
            {**b, "input": _input(self.args[i])} if b["type"] == "tool_use" else b
            for i, b in enumerate(self.content)
        ]
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": STOP_REASONS.get(self.finish or "stop", "end_turn"),
            "stop_sequence": None,
            "usage": usage_object(self.usage),
        }

    # ---- streaming ------------------------------------------------------------------------
    def start(self, prompt_tokens: int, cached: int) -> list[bytes]:
        head = {**self.message(), "content": [], "stop_reason": None}
        head["usage"] = usage_object(Usage(prompt_tokens, 0, cached))
        return [sse("message_start", {"message": head})]

    def take(self, ev: ChatEvent) -> list[bytes]:
        if isinstance(ev, TextDelta):
            out = []
            if self.open is None or self.content[self.open]["type"] != "text":
                out += self._open({"type": "text", "text": ""})
            assert self.open is not None
            self.content[self.open]["text"] += ev.text
            delta = {"type": "text_delta", "text": ev.text}
            return [*out, sse("content_block_delta", {"index": self.open, "delta": delta})]
        if isinstance(ev, CallStart):
            block = {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}}
            out = self._open(block)
            assert self.open is not None
            self.calls[ev.index] = self.open
            self.args[self.open] = ""
            return out
        if isinstance(ev, CallArgs):
            i = self.calls[ev.index]
            self.args[i] += ev.text
            delta = {"type": "input_json_delta", "partial_json": ev.text}
            return [sse("content_block_delta", {"index": i, "delta": delta})]
        if isinstance(ev, Finish):
            self.finish = ev.reason
            return self._close()
        if isinstance(ev, UsageSeen):
            self.usage = ev.usage
            return []
        assert isinstance(ev, StreamFailed)
        self.failed = ev.message
        return []

    def end(self) -> list[bytes]:
        if self.failed is not None or self.finish is None:
            message = self.failed or "the reply ended before it finished"
            return [sse("error", error_body(500, message))]
        delta = {"stop_reason": STOP_REASONS.get(self.finish, "end_turn"), "stop_sequence": None}
        return [
            sse("message_delta", {"delta": delta, "usage": usage_object(self.usage)}),
            sse("message_stop", {}),
        ]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.content.append(block)
        self.open = len(self.content) - 1
        return [*out, sse("content_block_start", {"index": self.open, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        i, self.open = self.open, None
        return [sse("content_block_stop", {"index": i})]
