"""The Responses and Messages APIs end to end: the official openai and anthropic SDKs -> a real
gateway -> a real CPU cloud node (the default model, with its prefix cache) on loopback.

Text, streams, a function-tool round trip per API, a ``previous_response_id`` chain whose later
turns hit the prefix cache, ``text.format`` json_schema parsed by the SDK, ``count_tokens``
against the node's count, stored responses private to their key, errors as each SDK's own
exception types, and the same greedy text from chat completions, Responses and Messages."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.nodes import Served, serve_node
from tests.test_tools import ADD, WEATHER

# the anthropic SDK (2.x) has no temperature argument; the Messages API still takes it
GREEDY = {"temperature": 0}
ADMIN = "sk-admin-0123456789abcdef"
KEYS = {"alice": "sk-alice-0123456789abcdef", "bob": "sk-bob-0123456789abcdef0"}
WEATHER_R = {"type": "function", **WEATHER["function"]}  # the Responses API's flat tool
WEATHER_A = {  # Anthropic's
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
ADD_A = {
    "name": "add",
    "description": ADD["function"]["description"],
    "input_schema": ADD["function"]["parameters"],
}
# long enough that its blocks are worth caching (a block is 16 tokens)
INSTRUCTIONS = (
    "You are a terse assistant for a weather station. Answer in one short sentence. Never "
    "invent numbers you were not given; say that you do not know instead. Prefer metric units."
)


@pytest.fixture(scope="module")
def fleet(default_model_path: Path) -> Iterator[dict[str, Any]]:
    from cloud_engine.config import EngineConfig
    from cloud_engine.engine import CloudEngine
    from gateway.auth import hash_key
    from routing.model_store import resolve

    salt = "apis-test-salt-0123456789"
    auth = {
        "salt": salt,
        "keys": [{"name": n, "key_hash": hash_key(k, salt)} for n, k in KEYS.items()],
        "admin_keys": [{"name": "admin", "key_hash": hash_key(ADMIN, salt)}],
    }
    model = resolve(default_model_path).name
    served: list[Served] = []
    try:
        cloud = CloudEngine.from_model(
            default_model_path, "cpu", config=EngineConfig(device="cpu", kv_memory_bytes=96 << 20)
        )
        served.append(serve_node(cloud, default_model_path, "cloud-apis"))
        from gateway.front.app import create_gateway_app
        from gateway.front.config import GatewayConfig

        gw = Served(create_gateway_app(GatewayConfig(
            nodes=[served[0].url], poll_interval_s=1.0, auth=auth,
            model_aliases={"claude-*": model, "gpt-*": "auto"}, virtual_models={"auto": model},
        )))  # fmt: skip
        admin = {"authorization": f"Bearer {ADMIN}"}
        deadline = time.monotonic() + 30
        while not httpx.get(gw.url + "/admin/nodes", headers=admin).json()["nodes"]:
            assert time.monotonic() < deadline, "the gateway never saw its node"
            time.sleep(0.05)
        served.append(gw)
        yield {"model": model, "gw": gw.url}
    finally:
        for s in reversed(served):
            s.stop()


def _oai(fleet: dict, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=fleet["gw"] + "/v1", api_key=KEYS[who], max_retries=0, timeout=300
    )


def _ant(fleet: dict, who: str = "alice") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fleet["gw"], api_key=KEYS[who], max_retries=0, timeout=300)


# ---- Responses ------------------------------------------------------------------------------
def test_responses_text_and_stream_agree(fleet: dict) -> None:
    client = _oai(fleet)
    kw: dict[str, Any] = {"model": "gpt-4o", "input": "Say hello in three words.",
                          "temperature": 0, "max_output_tokens": 40}  # fmt: skip
    whole = client.responses.create(**kw)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.model == fleet["model"]
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == (
        "response.completed" if whole.status == "completed" else "response.incomplete"
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(**kw) as stream:  # the SDK's own accumulator
        final = stream.get_final_response()
    assert final.output_text == whole.output_text


def test_responses_function_call_round_trip(fleet: dict) -> None:
    client = _oai(fleet)
    first = client.responses.create(
        model="gpt-4o", input="What is the weather in Paris?", tools=[WEATHER_R],
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_output_tokens=60,
    )  # fmt: skip
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    # the stream's argument deltas add up to the same call
    events = list(client.responses.create(
        model="gpt-4o", input="What is the weather in Paris?", tools=[WEATHER_R],
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_output_tokens=60,
        stream=True,
    ))  # fmt: skip
    items = [e.item.id for e in events if e.type == "response.output_item.added"]
    args = [
        "".join(
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.item_id == item
        )
        for item in items
    ]
    assert args == [c.arguments for c in calls]
    # the result goes back as a function_call_output chained on the stored response
    final = client.responses.create(
        model="gpt-4o", previous_response_id=first.id, tools=[WEATHER_R], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temp_c": 18, "sky": "cloudy"}'}],
        temperature=0, max_output_tokens=20,
    )  # fmt: skip
    assert final.output_text and not [o for o in final.output if o.type == "function_call"]
    assert final.usage.input_tokens > first.usage.input_tokens


def test_responses_chain_hits_the_prefix_cache(fleet: dict) -> None:
    client = _oai(fleet)
    prev = None
    cached = []
    for question in ("Is it cold at 2 degrees?", "And at 30 degrees?", "And at 15?"):
        r = client.responses.create(
            model="gpt-4o", instructions=INSTRUCTIONS, input=question, previous_response_id=prev,
            temperature=0, max_output_tokens=16,
        )  # fmt: skip
        prev = r.id
        cached.append(r.usage.input_tokens_details.cached_tokens)
    assert cached[1] > 0 and cached[2] > cached[1], cached
    got = client.responses.retrieve(prev)
    assert got.id == prev and got.output_text == r.output_text


def test_stored_responses_belong_to_their_key(fleet: dict) -> None:
    mine = _oai(fleet).responses.create(model="gpt-4o", input="Hi", max_output_tokens=4)
    theirs = _oai(fleet, "bob")
    for call in (
        lambda: theirs.responses.retrieve(mine.id),
        lambda: theirs.responses.delete(mine.id),
        lambda: theirs.responses.create(model="gpt-4o", input="Hi", previous_response_id=mine.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    _oai(fleet).responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        _oai(fleet).responses.retrieve(mine.id)
    unstored = _oai(fleet).responses.create(
        model="gpt-4o", input="Hi", max_output_tokens=4, store=False
    )
    with pytest.raises(openai.NotFoundError):
        _oai(fleet).responses.retrieve(unstored.id)


class Weather(pydantic.BaseModel):
    city: str
    temp_c: int


def test_responses_text_format_json_schema_parsed(fleet: dict) -> None:
    parsed = _oai(fleet).responses.parse(
        model="gpt-4o", input="Paris is at 18 degrees. Give the city and temperature as JSON.",
        text_format=Weather, temperature=0, max_output_tokens=60,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, Weather)


def test_responses_errors(fleet: dict) -> None:
    client = _oai(fleet)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="gpt-4o", input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools.0.type"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model="gpt-4o",
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        )
    assert e.value.body["param"] == "input.0.content.0.type"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="gpt-4o", input="x", reasoning={"effort": "high"})
    assert e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=fleet["gw"] + "/v1", api_key="sk-wrong-key-000000000",
                      max_retries=0).responses.create(model="gpt-4o", input="x")  # fmt: skip
    r = httpx.post(fleet["gw"] + "/v1/responses", content=b"{", headers={
        "authorization": f"Bearer {KEYS['alice']}", "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


# ---- Messages -------------------------------------------------------------------------------
def test_messages_text_and_stream_agree(fleet: dict) -> None:
    client = _ant(fleet)
    kw: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 12, "extra_body": GREEDY,
                          "system": [{"type": "text", "text": "Be brief.",
                                      "cache_control": {"type": "ephemeral"}}],
                          "messages": [{"role": "user", "content": "Say hello."}]}  # fmt: skip
    whole = client.messages.create(**kw)
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_messages_tool_use_round_trip_with_any(fleet: dict) -> None:
    client = _ant(fleet)
    question = {"role": "user", "content": "What is the weather in Paris?"}
    kw: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 60, "extra_body": GREEDY,
                          "tools": [WEATHER_A, ADD_A]}  # fmt: skip
    first = client.messages.create(messages=[question], tool_choice={"type": "any"}, **kw)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses
    tool = {"get_weather": WEATHER_A, "add": ADD_A}[uses[0].name]
    jsonschema.validate(uses[0].input, tool["input_schema"])
    with client.messages.stream(messages=[question], tool_choice={"type": "any"}, **kw) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in uses
    ]
    history = [
        question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": '{"temp_c": 18, "sky": "cloudy"}'}]},
    ]  # fmt: skip
    final = client.messages.create(messages=history, tool_choice={"type": "none"}, **kw)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.content[0].type == "text" and final.content[0].text


def test_count_tokens_is_the_nodes_prompt_count(fleet: dict) -> None:
    client = _ant(fleet)
    kw: dict[str, Any] = {"model": "claude-haiku-4-5", "system": "Be brief.",
                          "messages": [{"role": "user", "content": "What is 2 + 2?"}],
                          "tools": [ADD_A]}  # fmt: skip
    counted = client.messages.count_tokens(**kw).input_tokens
    done = client.messages.create(max_tokens=2, **kw)
    assert counted == done.usage.input_tokens + done.usage.cache_read_input_tokens


def test_messages_errors_are_the_sdks_types(fleet: dict) -> None:
    client = _ant(fleet)
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="claude-x", max_tokens=8, messages=msgs,
                               thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    assert e.value.body["type"] == "error" and "thinking" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="claude-x", max_tokens=8, messages=[{"role": "user",
            "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}])  # fmt: skip
    assert "messages.0.content.0.type" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="claude-x", max_tokens=8, messages=msgs,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])  # fmt: skip
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=8, messages=msgs)
    assert e.value.body["error"]["type"] == "not_found_error"
    said = e.value.body["error"]["message"]  # what would have been accepted, and how to map
    assert f"served here: auto, {fleet['model']}" in said and "model_aliases" in said
    with pytest.raises(anthropic.AuthenticationError):
        _ant_key(fleet, "sk-wrong-key-000000000").messages.create(
            model="claude-x", max_tokens=8, messages=msgs
        )
    r = httpx.post(fleet["gw"] + "/v1/messages", json={"model": "claude-x", "messages": msgs},
                   headers={"x-api-key": KEYS["alice"], "anthropic-version": "2023-06-01"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


def _ant_key(fleet: dict, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fleet["gw"], api_key=key, max_retries=0)


# ---- one answer whatever the API ------------------------------------------------------------
CONVERSATIONS = [
    ("Be brief.", "Name a color."),
    ("You answer in French.", "How are you?"),
    ("You count.", "Count from one to five."),
]


@pytest.mark.parametrize("system,question", CONVERSATIONS)
def test_same_greedy_text_through_the_three_apis(fleet: dict, system: str, question: str) -> None:
    chat = _oai(fleet).chat.completions.create(
        model=fleet["model"], temperature=0, max_tokens=16,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    ).choices[0].message.content  # fmt: skip
    resp = _oai(fleet).responses.create(
        model="gpt-4o", instructions=system, input=question, temperature=0, max_output_tokens=16,
        store=False,
    ).output_text  # fmt: skip
    msg = _ant(fleet).messages.create(
        model="claude-sonnet-4-5", system=system, extra_body=GREEDY, max_tokens=16,
        messages=[{"role": "user", "content": question}],
    ).content[0].text  # fmt: skip
    assert chat == resp == msg


def test_decision_headers_and_docs(fleet: dict) -> None:
    raw = _oai(fleet).responses.with_raw_response.create(
        model="gpt-4o", input="Hi", max_output_tokens=2, store=False
    )
    assert raw.headers.get("x-edgecloud-node") == "cloud-apis"
    raw = _ant(fleet).messages.with_raw_response.create(
        model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
    )
    assert raw.headers.get("x-edgecloud-node") == "cloud-apis"
    paths = httpx.get(fleet["gw"] + "/openapi.json").json()["paths"]
    for p in ("/v1/responses", "/v1/responses/{response_id}", "/v1/messages",
              "/v1/messages/count_tokens"):  # fmt: skip
        assert p in paths
    assert "input" in json.dumps(paths["/v1/responses"]["post"]["requestBody"])
