"""Structured outputs end to end on the default model: the official openai SDK -> a real
gateway -> a real edge node or cloud node on loopback. ``chat.completions.parse`` with a
pydantic model on both tiers, ``json_object`` on completions, ``length`` when max_tokens cuts a
reply, generated schemas (tests/json_schemas.py) whose replies end on their own and validate
(jsonschema), and the 400s for bad formats, before any node is asked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.json_schemas import prompt, schema
from tests.nodes import Served, default_model_tiers


class Pet(BaseModel):
    name: str = Field(max_length=20)
    kind: Literal["cat", "dog", "fish"]


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    pets: list[Pet] = Field(max_length=3)


@pytest.fixture(scope="module")
def tiers(default_model_path: Path) -> Iterator[dict[str, Any]]:
    """An edge node and a cloud node on the default model, each behind its own gateway."""
    with default_model_tiers(default_model_path, "so") as t:
        yield t


def _sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("tier", ["edge", "cloud"])
def test_parse_returns_the_pydantic_object(tiers: dict, tier: str) -> None:
    load = httpx.get(tiers["node"][tier] + "/load").json()
    assert "grammar" in load["capabilities"]  # what the router reads
    client = _sdk(tiers["gw"][tier])
    completion = client.chat.completions.parse(
        model=tiers["model"],
        messages=[{"role": "user", "content": "Describe a person with two pets."}],
        response_format=Person,
        max_tokens=200,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person), choice.message.content
    assert Person.model_validate_json(choice.message.content or "") == choice.message.parsed


@pytest.mark.parametrize("tier", ["edge", "cloud"])
def test_json_object_on_completions_and_length_when_cut(tiers: dict, tier: str) -> None:
    client = _sdk(tiers["gw"][tier])
    done = client.completions.create(
        model=tiers["model"],
        prompt="A JSON object describing a red car: ",
        max_tokens=120,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].text), dict)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=tiers["model"],
            messages=[{"role": "user", "content": "Describe a person."}],
            response_format=Person,
            max_tokens=3,
            temperature=0,
        )


def _suite(base: str, model: str, n: int) -> tuple[int, int, list[str]]:
    """``n`` generated schemas through one node (four at a time): replies that ended on
    their own, how many of those validate, and what each failure was."""
    client = _sdk(base)

    def one(i: int) -> tuple[bool, bool, str]:
        s = schema(i)
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt(s)}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": s, "strict": True},
            },
            max_tokens=256,
            temperature=0,
        )
        c = r.choices[0]
        if c.finish_reason != "stop":
            return False, False, f"{i}: {c.finish_reason}"
        try:
            jsonschema.validate(json.loads(c.message.content or ""), s)
        except (ValueError, jsonschema.ValidationError) as exc:
            return True, False, f"{i}: {exc}"
        return True, True, ""

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(n)))
    ended = sum(e for e, _, _ in results)
    valid = sum(v for _, v, _ in results)
    return ended, valid, [why for _, _, why in results if why]


def test_forty_generated_schemas_on_the_edge(tiers: dict) -> None:
    ended, valid, why = _suite(tiers["node"]["edge"], tiers["model"], 40)
    assert ended >= 36, why
    assert valid == ended, why


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["edge", "cloud"])
def test_two_hundred_generated_schemas(tiers: dict, tier: str) -> None:
    ended, valid, why = _suite(tiers["node"][tier], tiers["model"], 200)
    assert ended >= 180, why
    assert valid == ended, why


_BAD = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/defs/x"}}}, "does not exist"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}, "Unsatisfiable"),
    ({"type": "yaml"}, "response_format.type"),
]  # fmt: skip


@pytest.mark.parametrize(("rf", "says"), _BAD)
def test_bad_response_format_is_a_400_before_any_node(rf: dict, says: str) -> None:
    """A gateway with no node at all still answers 400 (not 503): the schema is refused before
    tokenizing or routing."""
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    gw = Served(create_gateway_app(GatewayConfig(nodes=[])))
    try:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": rf,
        }
        for route in ("chat/completions", "completions"):
            if route == "completions":
                body = {"model": "m", "prompt": "hi", "response_format": rf}
            r = httpx.post(f"{gw.url}/v1/{route}", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "response_format" and err["type"] == "invalid_request_error"
            assert says in err["message"]
        ok = {"type": "json_object"}
        r = httpx.post(f"{gw.url}/v1/completions", json={**body, "response_format": ok})
        assert r.status_code == 503  # a good format goes on to routing: no node here
    finally:
        gw.stop()


def test_bad_response_format_is_a_400_at_the_node_too(tiers: dict) -> None:
    client = _sdk(tiers["node"]["edge"])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=tiers["model"],
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
        )  # fmt: skip
    assert err.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=tiers["model"],
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_object"},
            extra_body={"min_tokens": 4},
        )
    assert err.value.body["param"] == "min_tokens"  # type: ignore[index]
