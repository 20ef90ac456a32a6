"""Tool calling end to end on the default model: the official openai SDK -> a real gateway -> a
real edge node or CPU cloud node on loopback. A call round trip (required, the tool's result,
then an answer with tool_choice none) on both tiers; a named choice; streamed calls that the
SDK reassembles into the whole reply's; auto; and the 400s for bad tools, before any node."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.nodes import Served, default_model_tiers, gateway_over
from tests.test_tools import ADD, TOOLS, WEATHER

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiers(default_model_path: Path) -> Iterator[dict[str, Any]]:
    with default_model_tiers(default_model_path, "tools") as t:
        yield t


def _sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def _create(tiers: dict, tier: str, **kw: Any) -> Any:
    args: dict[str, Any] = {"messages": QUESTION, "tools": TOOLS, "temperature": 0}
    args.update(kw)
    return _sdk(tiers["gw"][tier]).chat.completions.create(model=tiers["model"], **args)


def _valid(call: Any) -> None:
    tool = {"get_weather": WEATHER, "add": ADD}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


@pytest.mark.parametrize("tier", ["edge", "cloud"])
def test_call_round_trip(tiers: dict, tier: str) -> None:
    first = _create(tiers, tier, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _valid(call)
    history = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "cloudy"}'},
    ]
    final = _create(tiers, tier, messages=history, tool_choice="none", max_tokens=24)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    assert "<tool_call>" not in answer.message.content
    # the history with the call renders into a longer prompt that starts like the first one
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_named_choice_calls_that_function_once(tiers: dict) -> None:
    done = _create(
        tiers, "edge", tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60
    )
    (call,) = done.choices[0].message.tool_calls
    assert call.function.name == "add"
    _valid(call)


def test_streamed_calls_reassemble_to_the_whole_reply(tiers: dict) -> None:
    whole = _create(tiers, "edge", tool_choice="required", max_tokens=80)
    client = _sdk(tiers["gw"]["edge"])
    with client.chat.completions.stream(
        model=tiers["model"], messages=QUESTION, tools=TOOLS, tool_choice="required",
        temperature=0, max_tokens=80,
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    got, want = final.choices[0], whole.choices[0]
    assert got.finish_reason == want.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in want.message.tool_calls
    ]
    # the raw chunks: a call's first delta names it (id, type, name); its arguments add up
    body = {
        "model": tiers["model"], "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
        "temperature": 0, "max_tokens": 80, "stream": True,
    }  # fmt: skip
    deltas = []
    with httpx.stream("POST", tiers["gw"]["edge"] + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    deltas += c["delta"].get("tool_calls") or []
    firsts = [d for d in deltas if "id" in d]
    assert [d["function"]["name"] for d in firsts] == [
        c.function.name for c in want.message.tool_calls
    ]
    assert all(d["type"] == "function" for d in firsts)
    assert all(set(d) == {"index", "function"} for d in deltas if "id" not in d)
    for i, call in enumerate(want.message.tool_calls):
        args = "".join(d["function"]["arguments"] for d in deltas if d["index"] == i)
        assert args == call.function.arguments


def test_an_openai_kind_node_gets_the_tools_as_sent(
    tiers: dict, default_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An external OpenAI-compatible upstream (here the edge node itself, fronted as an
    ``openai`` node, its tokenizer placed in the gateway's home as an operator does) is sent
    the tools and returns its own tool_calls through the gateway."""
    from routing.fleet.memory_store import OpenAINodeConfig
    from routing.prompt import TOKENIZER_FILES

    monkeypatch.setenv("EDGECLOUD_HOME", str(tmp_path))
    folder = tmp_path / "tokenizers" / tiers["model"]
    folder.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (default_model_path / name).is_file():
            shutil.copy(default_model_path / name, folder / name)
    upstream = OpenAINodeConfig(
        id="upstream", url=tiers["node"]["edge"], region="test", models=[tiers["model"]]
    )
    gw = gateway_over(None, openai_nodes=[upstream])
    try:
        done = _create({**tiers, "gw": {"up": gw.url}}, "up", tool_choice="required", max_tokens=60)
        assert done.choices[0].finish_reason == "tool_calls"
        for call in done.choices[0].message.tool_calls:
            _valid(call)
    finally:
        gw.stop()


def test_auto_and_none(tiers: dict) -> None:
    for choice in ("auto", "none"):
        done = _create(tiers, "edge", tool_choice=choice, max_tokens=16)
        msg = done.choices[0].message
        for call in msg.tool_calls or []:
            _valid(call)
        if choice == "none":
            assert msg.tool_calls is None and msg.content
        if not msg.tool_calls:
            assert done.choices[0].finish_reason in ("stop", "length")


_BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
      "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": TOOLS, "messages": [{"role": "tool", "content": "5"}]}, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), _BAD)
def test_bad_tools_are_a_400_before_any_node(extra: dict, param: str) -> None:
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    gw = Served(create_gateway_app(GatewayConfig(nodes=[])))
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err
        good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=good)
        assert r.status_code == 503  # good tools go on to routing: no node here
    finally:
        gw.stop()


def test_a_history_call_with_arguments_that_are_not_json_is_a_400(tiers: dict) -> None:
    bad_call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a:"}}
    messages = [*QUESTION, {"role": "assistant", "tool_calls": [bad_call]}]
    with pytest.raises(openai.BadRequestError) as err:
        _create(tiers, "edge", messages=messages, max_tokens=4)
    assert err.value.body["param"] == "messages"  # type: ignore[index]
