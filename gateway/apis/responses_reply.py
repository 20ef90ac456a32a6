"""Chat replies written as Responses API objects and event streams.

:class:`ResponseWriter` reads :mod:`.chat_events` and builds the response: its ``output``
items (one ``message`` with its ``output_text``, then one ``function_call`` per call, in the
order the model wrote them) and, for a stream, the events that lead to it.

Invariants:
- A stream is ``response.created``, ``response.in_progress``, then per item
  ``response.output_item.added`` ... ``response.output_item.done`` (a message's
  ``content_part.added``, ``output_text.delta``s, ``output_text.done``, ``content_part.done``;
  a call's ``function_call_arguments.delta``s and ``.done``), then one of
  ``response.completed``, ``response.incomplete`` (the token budget ran out:
  ``incomplete_details.reason = max_output_tokens``) or ``response.failed``. Events carry
  increasing ``sequence_number``s; the final event's response equals what ``GET`` returns.
- The deltas of an item add up to its text or arguments in the final response.
- Usage: ``input_tokens`` (cached included, as ``input_tokens_details.cached_tokens``),
  ``output_tokens``, ``total_tokens``, as the node counted them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

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
from gateway.apis.responses_request import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"


def usage_object(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt,
        "input_tokens_details": {"cached_tokens": u.cached},
        "output_tokens": u.completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt + u.completion,
    }


def sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponseWriter:
    """One response, built from a chat reply's events (see the module's docstring)."""

    def __init__(self, req: ResponsesRequest, model: str, response_id: str | None = None) -> None:
        self.req = req
        self.model = model
        self.id = response_id or new_id("resp")
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the message item being written
        self.calls: dict[int, dict[str, Any]] = {}  # chat call index -> its open item
        self.usage: Usage | None = None
        self.finish: str | None = None
        self.error: dict[str, Any] | None = None
        self.seq = 0

    # ---- the response object --------------------------------------------------------------
    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        if self.finish is None:
            return "in_progress"
        return "incomplete" if self.finish == "length" else "completed"

    def response(self) -> dict[str, Any]:
        r = self.req
        status = self.status
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": [dict(item) for item in self.output],
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": r.store,
            "temperature": r.temperature,  # None: the model's default (its generation_config)
            "text": {"format": r.format_name()},
            "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [],
            "top_p": r.top_p,
            "truncation": "disabled",
            "usage": usage_object(self.usage) if self.usage is not None else None,
            "user": r.user,
            "metadata": r.metadata or {},
        }

    # ---- events ---------------------------------------------------------------------------
    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        return [
            self._ev("response.created", response=self.response()),
            self._ev("response.in_progress", response=self.response()),
        ]

    def take(self, ev: ChatEvent) -> list[dict[str, Any]]:
        """The stream events ``ev`` gives (the response object is updated either way)."""
        if isinstance(ev, TextDelta):
            out = self._open_message()
            assert self.message is not None
            self.message["content"][0]["text"] += ev.text
            out.append(self._ev("response.output_text.delta", item_id=self.message["id"],
                                output_index=self._index(self.message), content_index=0,
                                delta=ev.text, logprobs=[]))  # fmt: skip
            return out
        if isinstance(ev, CallStart):
            out = self._close_message()
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": ev.id, "name": ev.name, "arguments": ""}  # fmt: skip
            self.output.append(item)
            self.calls[ev.index] = item
            out.append(self._ev("response.output_item.added", output_index=self._index(item),
                                item=dict(item)))  # fmt: skip
            return out
        if isinstance(ev, CallArgs):
            item = self.calls[ev.index]
            item["arguments"] += ev.text
            return [self._ev("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=self._index(item), delta=ev.text)]  # fmt: skip
        if isinstance(ev, Finish):
            self.finish = ev.reason
            return self._close_all()
        if isinstance(ev, UsageSeen):
            self.usage = ev.usage
            return []
        assert isinstance(ev, StreamFailed)
        out = self._close_all()
        self.error = {"code": "server_error", "message": ev.message}
        return out

    def end(self) -> list[dict[str, Any]]:
        """The final event (the response as stored)."""
        if self.error is None and self.finish is None:
            self.error = {"code": "server_error", "message": "the reply ended before it finished"}
        kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(
            self.status, "response.completed"
        )
        return [self._ev(kind, response=self.response())]

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, x in enumerate(self.output) if x is item)

    def _open_message(self) -> list[dict[str, Any]]:
        if self.message is not None:
            return []
        self.message = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []}  # fmt: skip
        self.output.append(self.message)
        i = self._index(self.message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out = [self._ev("response.output_item.added", output_index=i,
                        item={**self.message, "content": []})]  # fmt: skip
        self.message["content"].append(part)
        out.append(self._ev("response.content_part.added", item_id=self.message["id"],
                            output_index=i, content_index=0, part=dict(part)))  # fmt: skip
        return out

    def _close_message(self) -> list[dict[str, Any]]:
        m = self.message
        if m is None or m["status"] != "in_progress":
            return []
        m["status"] = "completed"
        i, part = self._index(m), m["content"][0]
        return [
            self._ev("response.output_text.done", item_id=m["id"], output_index=i,
                     content_index=0, text=part["text"], logprobs=[]),
            self._ev("response.content_part.done", item_id=m["id"], output_index=i,
                     content_index=0, part=dict(part)),
            self._ev("response.output_item.done", output_index=i,
                     item={**m, "content": [dict(part)]}),
        ]  # fmt: skip

    def _close_all(self) -> list[dict[str, Any]]:
        out = self._close_message()
        for item in self.calls.values():
            if item["status"] != "in_progress":
                continue
            item["status"] = "completed"
            i = self._index(item)
            out.append(self._ev("response.function_call_arguments.done", item_id=item["id"],
                                output_index=i, name=item["name"],
                                arguments=item["arguments"]))  # fmt: skip
            out.append(self._ev("response.output_item.done", output_index=i, item=dict(item)))
        return out
