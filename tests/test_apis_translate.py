"""The translation layer alone (no model): Responses and Messages bodies into chat bodies,
chat replies back into each API's objects and events, model aliases, and the 400s naming the
field for what is not served."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.apis import messages_request, responses_request
from gateway.apis.chat_events import ChatStreamReader, whole_events
from gateway.apis.messages_reply import MessageWriter
from gateway.apis.messages_request import MessagesRequest
from gateway.apis.responses_reply import ResponseWriter
from gateway.apis.responses_request import ResponsesRequest, assistant_message, input_messages
from gateway.apis.routes import RESPONSES_PARAMS, renamed
from gateway.errors import APIError
from gateway.front.request_path import ModelAliases

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}


def test_input_items_become_chat_messages() -> None:
    items: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "input_text", "text": "hi "}, {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a":1}'},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": "2"},
    ]  # fmt: skip
    assert input_messages(items) == [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "ok", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ]
    assert input_messages("hey") == [{"role": "user", "content": "hey"}]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0.type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools.0.type"),
        ({"input": "x", "tools": [], "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ],
)  # fmt: skip
def test_what_responses_refuse_names_the_field(body: dict[str, Any], param: str) -> None:
    req = ResponsesRequest.model_validate({"model": "m", **body})
    with pytest.raises(APIError) as e:
        responses_request.chat_body(req, [], input_messages(req.input))
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize(
    "field", ["background", "truncation", "reasoning", "include", "conversation", "prompt"]
)
def test_responses_fields_not_served_are_refused(field: str) -> None:
    from pydantic import ValidationError

    value = {"background": True, "truncation": "auto", "reasoning": {"effort": "high"},
             "include": ["message.output_text.logprobs"], "conversation": "c",
             "prompt": {"id": "p"}}[field]  # fmt: skip
    with pytest.raises(ValidationError) as e:
        ResponsesRequest.model_validate({"model": "m", "input": "x", field: value})
    assert e.value.errors()[0]["type"] == "unsupported_parameter"


def test_responses_body_maps_its_fields() -> None:
    req = ResponsesRequest.model_validate({
        "model": "gpt-5", "input": "q", "instructions": "be brief", "max_output_tokens": 9,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        "stream": True, "temperature": 0.5,
    })  # fmt: skip
    body = responses_request.chat_body(req, [{"role": "user", "content": "before"}], [])
    assert body["messages"][:2] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "before"},
    ]
    assert body["max_tokens"] == 9 and body["temperature"] == 0.5
    assert body["tools"][0]["function"]["name"] == "f"
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"]["json_schema"]["name"] == "n"
    assert body["stream_options"] == {"include_usage": True}


def _chat_sse(*chunks: dict[str, Any]) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    )


STREAM = _chat_sse(
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "Let me "}}]},
    {"choices": [{"index": 0, "delta": {"content": "check."}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32}}},
)  # fmt: skip
WHOLE = {
    "choices": [{"index": 0, "finish_reason": "tool_calls",
                 "message": {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]}}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32}},
}  # fmt: skip


def test_a_streamed_reply_gives_the_whole_replys_events() -> None:
    reader = ChatStreamReader()
    events = []
    for i in range(0, len(STREAM), 7):  # any cut of the bytes
        events += reader.feed(STREAM[i : i + 7])
    events += reader.close()
    text = "".join(e.text for e in events if type(e).__name__ == "TextDelta")
    args = "".join(e.text for e in events if type(e).__name__ == "CallArgs")
    whole = whole_events(WHOLE)
    assert text == "Let me check." and args == '{"a":1}'
    assert [type(e).__name__ for e in events][-2:] == [type(e).__name__ for e in whole][-2:]


def test_responses_writer_stream_and_object_agree() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    w = ResponseWriter(req, "m")
    out = w.start()
    reader = ChatStreamReader()
    for ev in [*reader.feed(STREAM), *reader.close()]:
        out += w.take(ev)
    out += w.end()
    assert out[-1]["type"] == "response.completed"
    final = out[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 32
    added = [e["output_index"] for e in out if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in out if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1]
    assert assistant_message(final["output"]) == WHOLE["choices"][0]["message"]


def test_messages_writer_whole_and_stream() -> None:
    w = MessageWriter("m")
    for ev in whole_events(WHOLE):
        w.take(ev)
    msg = w.message()
    assert msg["stop_reason"] == "tool_use"
    assert msg["content"] == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
    ]
    assert msg["usage"]["input_tokens"] == 8 and msg["usage"]["cache_read_input_tokens"] == 32
    s = MessageWriter("m")
    out = s.start(40, 32)
    reader = ChatStreamReader()
    for ev in [*reader.feed(STREAM), *reader.close()]:
        out += s.take(ev)
    out += s.end()
    kinds = [b.split(b"\n")[0].decode() for b in out]
    assert kinds == ["event: message_start", "event: content_block_start",
                     "event: content_block_delta", "event: content_block_delta",
                     "event: content_block_stop", "event: content_block_start",
                     "event: content_block_delta", "event: content_block_delta",
                     "event: content_block_stop", "event: message_delta", "event: message_stop"]  # fmt: skip


def test_a_broken_stream_ends_in_each_apis_error() -> None:
    reader = ChatStreamReader()
    events = reader.feed(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
    events += reader.close()  # no [DONE]
    r = ResponseWriter(ResponsesRequest.model_validate({"model": "m", "input": "x"}), "m")
    m = MessageWriter("m")
    for ev in events:
        r.take(ev)
        m.take(ev)
    assert r.end()[-1]["type"] == "response.failed"
    assert m.end()[-1].startswith(b"event: error")


def test_messages_become_chat_messages() -> None:
    req = MessagesRequest.model_validate({
        "model": "claude-x", "max_tokens": 5,
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "t"},
                                              {"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": [{"type": "text", "text": "2"}]},
                                         {"type": "text", "text": "thanks"}]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
    })  # fmt: skip
    body = messages_request.chat_body(req)
    assert body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "t", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "2"},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["stop"] == ["END"] and body["max_tokens"] == 5


@pytest.mark.parametrize(
    "change,param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]}]}, "messages.0.content.0.type"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
        ({"system": [{"type": "image"}]}, "system.0.type"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ],
)  # fmt: skip
def test_what_messages_refuse_names_the_field(change: dict[str, Any], param: str) -> None:
    base = {"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "q"}]}
    req = MessagesRequest.model_validate({**base, **change})
    with pytest.raises(APIError) as e:
        messages_request.chat_body(req)
    assert e.value.status == 400 and e.value.param == param


def test_chat_params_are_renamed_to_the_clients() -> None:
    exc = renamed(
        APIError(400, "Invalid value for 'max_tokens': big", param="max_tokens"), RESPONSES_PARAMS
    )
    assert exc.param == "max_output_tokens" and "'max_output_tokens'" in exc.message


def test_model_aliases() -> None:
    aliases = ModelAliases({"claude-*": "auto", "gpt-4o": "b", "gpt-*": "c"})
    assert aliases.target("claude-sonnet-4-5") == "auto"
    assert aliases.target("gpt-4o") == "b" and aliases.target("gpt-5") == "c"
    assert aliases.target("llama") is None
