"""Bad inputs at the gateway's and the node's edges, and one bad request inside each engine.

Real parts throughout: the tiny random model served by the real cloud and edge engines behind
the real node app, and the real gateway in front of both, each under uvicorn on loopback (in
threads of this process). Every bad input must be a 4xx whose OpenAI error names the field
(``param``) or the problem (``code``), never a 500, and the kept-alive connection it came on
must serve the next, valid request (a 500 would close it). Inside the engines, a request whose
sampling parameters a sampler cannot honour, submitted straight to the engine (past the
node's validation), fails alone while concurrent greedy streams finish with every token.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from routing.engine import FinishReason, GenerationRequest, SamplingParams
from routing.sampling_limits import InvalidSampling
from tests.nodes import tiny_cloud_engine, tiny_edge_engine, tiny_fleet

VOCAB = 49152  # the tiny model's vocabulary (tests/conftest.py)


class Conn:
    """One kept-alive HTTP/1.1 connection; every answer must leave it open."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.c = http.client.HTTPConnection(host, int(port), timeout=60)
        self.c.connect()
        assert self.c.sock is not None
        self.local = self.c.sock.getsockname()

    def post(
        self, path: str, body: Any, content_type: str | None = "application/json"
    ) -> tuple[int, Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-length": str(len(raw))}
        if content_type is not None:
            headers["content-type"] = content_type
        self.c.request("POST", path, body=raw, headers=headers)
        r = self.c.getresponse()
        data = r.read()
        assert not r.will_close, f"{r.status} closed the connection: {data[:300]!r}"
        assert self.c.sock is not None and self.c.sock.getsockname() == self.local
        try:
            return r.status, json.loads(data)
        except ValueError:
            return r.status, data

    def close(self) -> None:
        self.c.close()


# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tiny_model_path: Path, edge_home: None, one_torch_thread: None) -> Iterator[dict]:
    """A cloud node, an edge node and a gateway in front of both."""
    with tiny_fleet(tiny_model_path, "v", poll_interval_s=1.0) as f:
        yield {**f["served"], "model": f["model"]}


def _chat(model: str, content: Any = "Hello there", **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "temperature": 0,
        **extra,
    }


def _completion(model: str, prompt: Any = "Once upon", **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}


def _raw(body: dict[str, Any], **raw_fields: str) -> bytes:
    """``body`` as JSON with ``raw_fields`` spliced in as raw JSON text (deep nesting,
    escapes json.dumps would not write, NaN)."""
    text = json.dumps(body)[:-1]
    for k, v in raw_fields.items():
        text += f', "{k}": {v}'
    return (text + "}").encode()


def _without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def _surrogate_chat(model: str) -> bytes:
    body = _chat(model)
    return json.dumps(body).replace('"Hello there"', '"Hello \\ud800 there"').encode()


def _surrogate_part(model: str) -> bytes:
    body = _chat(model, content=[{"type": "text", "text": "MARK"}])
    return json.dumps(body).replace('"MARK"', '"\\udfff"').encode()


def _surrogate_prompt(model: str) -> bytes:
    return json.dumps(_completion(model)).replace('"Once upon"', '"Once \\ud83d"').encode()


def _surrogate_stop(model: str) -> bytes:
    return json.dumps(_chat(model, stop=["MARK"])).replace('"MARK"', '"\\ud800"').encode()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BIG = 10**400  # an integer with 401 digits

# (path, body maker taking the model name, content type, status, param, code)
BAD: list[tuple[str, Any, str | None, int, str | None, str | None]] = [
    # seeds beyond int64 (with temperature > 0 they reached the cloud sampler and killed a batch)
    (CHAT, lambda m: _chat(m, temperature=1.0, seed=2**64), "application/json", 400, "seed", None),
    (CHAT, lambda m: _chat(m, temperature=1.0, seed=2**63), "application/json", 400, "seed", None),
    (
        COMPLETIONS,
        lambda m: _completion(m, seed=-(2**63) - 1),
        "application/json",
        400,
        "seed",
        None,
    ),
    # deep nesting: RecursionError in json; orjson's own limit is 1024
    (
        CHAT,
        lambda m: _raw(_chat(m), extra=_nested(1000)),
        "application/json",
        400,
        None,
        "invalid_json",
    ),
    (
        CHAT,
        lambda m: _raw(_chat(m), extra=_nested(100_000)),
        "application/json",
        400,
        None,
        "invalid_json",
    ),
    (
        COMPLETIONS,
        lambda m: _raw(_completion(m), extra=_nested(65)),
        "application/json",
        400,
        None,
        "invalid_json",
    ),
    (CHAT, lambda m: b"[" * 5000, "application/json", 400, None, "invalid_json"),
    # lone surrogates: the tokenizer raised TypeError
    (CHAT, _surrogate_chat, "application/json", 400, "messages.0.content", None),
    (CHAT, _surrogate_part, "application/json", 400, "messages.0.content.0.text", None),
    (COMPLETIONS, _surrogate_prompt, "application/json", 400, "prompt", None),
    (CHAT, _surrogate_stop, "application/json", 400, "stop", None),
    # ignore_eos and min_tokens (extensions, as in vLLM)
    (
        COMPLETIONS,
        lambda m: _completion(m, min_tokens=-1),
        "application/json",
        400,
        "min_tokens",
        None,
    ),
    (CHAT, lambda m: _chat(m, min_tokens=3), "application/json", 400, "min_tokens", None),
    (
        CHAT,
        lambda m: _chat(m, max_completion_tokens=1, max_tokens=5, min_tokens=2),
        "application/json",
        400,
        "min_tokens",
        None,
    ),
    (CHAT, lambda m: _chat(m, min_tokens=1.5), "application/json", 400, "min_tokens", None),
    (
        COMPLETIONS,
        lambda m: _completion(m, ignore_eos="yes"),
        "application/json",
        400,
        "ignore_eos",
        None,
    ),
    # token ids: OverflowError in block hashing; the vocabulary
    (
        COMPLETIONS,
        lambda m: _completion(m, prompt=[1, 2**32]),
        "application/json",
        400,
        "prompt",
        None,
    ),
    (
        COMPLETIONS,
        lambda m: _completion(m, prompt=[1, -1]),
        "application/json",
        400,
        "prompt",
        None,
    ),
    (
        COMPLETIONS,
        lambda m: _completion(m, prompt=[1, 10**30]),
        "application/json",
        400,
        "prompt",
        None,
    ),
    (
        COMPLETIONS,
        lambda m: _completion(m, prompt=[5, VOCAB]),
        "application/json",
        400,
        "prompt",
        None,
    ),
    # unbounded integers: float overflow in the profile
    (CHAT, lambda m: _chat(m, max_tokens=BIG), "application/json", 400, "max_tokens", None),
    (
        CHAT,
        lambda m: {**_chat(m), "max_completion_tokens": BIG},
        "application/json",
        400,
        "max_completion_tokens",
        None,
    ),
    (
        COMPLETIONS,
        lambda m: _completion(m, max_tokens=BIG),
        "application/json",
        400,
        "max_tokens",
        None,
    ),
    (CHAT, lambda m: _chat(m, top_k=BIG), "application/json", 400, "top_k", None),
    (CHAT, lambda m: _chat(m, n=BIG), "application/json", 400, "n", None),
    (CHAT, lambda m: _chat(m, temperature=1.0, seed=BIG), "application/json", 400, "seed", None),
    # max_completion_tokens on completions: validated (it was unvalidated, used for routing)
    (
        COMPLETIONS,
        lambda m: _completion(m, max_completion_tokens="5"),
        "application/json",
        400,
        "max_completion_tokens",
        None,
    ),
    (
        COMPLETIONS,
        lambda m: _completion(m, max_completion_tokens=1.5),
        "application/json",
        400,
        "max_completion_tokens",
        None,
    ),
    (
        COMPLETIONS,
        lambda m: _completion(m, max_completion_tokens=0),
        "application/json",
        400,
        "max_completion_tokens",
        None,
    ),
    # non-finite floats (json reads NaN and Infinity)
    (
        CHAT,
        lambda m: _raw(_without(_chat(m), "temperature"), temperature="NaN"),
        "application/json",
        400,
        "temperature",
        None,
    ),
    (CHAT, lambda m: _raw(_chat(m), top_p="Infinity"), "application/json", 400, "top_p", None),
    # fields we cannot honour
    (
        CHAT,
        lambda m: _chat(m, tools=[{"type": "function", "function": {"name": "no spaces"}}]),
        "application/json",
        400,
        "tools",
        None,
    ),
    (
        CHAT,
        lambda m: _chat(m, tool_choice="required"),
        "application/json",
        400,
        "tool_choice",
        None,
    ),
    (
        CHAT,
        lambda m: _chat(m, functions=[{"name": "f"}]),
        "application/json",
        400,
        "functions",
        "unsupported_parameter",
    ),
    (
        CHAT,
        lambda m: _chat(
            m,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "foo"}},
            },
        ),
        "application/json",
        400,
        "response_format",
        None,
    ),
    (
        CHAT,
        lambda m: _chat(m, logit_bias={"50256": -100}),
        "application/json",
        400,
        "logit_bias",
        "unsupported_parameter",
    ),
    (CHAT, lambda m: _chat(m, top_logprobs=3), "application/json", 400, "top_logprobs", None),
    (
        CHAT,
        lambda m: _chat(m, logprobs=True, top_logprobs=21),
        "application/json",
        400,
        "top_logprobs",
        None,
    ),
    (
        CHAT,
        lambda m: _chat(m, presence_penalty=0.5),
        "application/json",
        400,
        "presence_penalty",
        "unsupported_parameter",
    ),
    (
        CHAT,
        lambda m: _chat(m, frequency_penalty=-1.0),
        "application/json",
        400,
        "frequency_penalty",
        "unsupported_parameter",
    ),
    (
        CHAT,
        lambda m: _chat(m, audio={"voice": "alloy", "format": "wav"}),
        "application/json",
        400,
        "audio",
        "unsupported_parameter",
    ),
    (
        CHAT,
        lambda m: _chat(m, modalities=["text", "audio"]),
        "application/json",
        400,
        "modalities",
        "unsupported_parameter",
    ),
    (
        CHAT,
        lambda m: _chat(m, prediction={"type": "content", "content": "x"}),
        "application/json",
        400,
        "prediction",
        "unsupported_parameter",
    ),
    (COMPLETIONS, lambda m: _completion(m, logprobs=6), "application/json", 400, "logprobs", None),
    (
        COMPLETIONS,
        lambda m: _completion(m, prompt=[[1, 2], [3, 4]]),
        "application/json",
        400,
        "prompt",
        None,
    ),
    (
        COMPLETIONS,
        lambda m: _completion(m, best_of=3),
        "application/json",
        400,
        "best_of",
        "unsupported_parameter",
    ),
    # bodies not declared JSON
    (CHAT, lambda m: _chat(m), "text/plain", 415, None, "unsupported_media_type"),
    (
        COMPLETIONS,
        lambda m: _completion(m),
        "application/x-www-form-urlencoded",
        415,
        None,
        "unsupported_media_type",
    ),
    (CHAT, lambda m: _chat(m), None, 415, None, "unsupported_media_type"),
    (CHAT, lambda m: b"", None, 400, None, "invalid_json"),
]

# accepted: the no-op values of fields we do not honour, and the edges of the ranges
GOOD: list[tuple[str, Any, str | None]] = [
    (
        CHAT,
        lambda m: _chat(
            m,
            tools=[],
            tool_choice="none",
            parallel_tool_calls=True,
            response_format={"type": "text"},
            logprobs=False,
            top_logprobs=0,
            logit_bias={},
            n=1,
            presence_penalty=0,
            frequency_penalty=0.0,
            modalities=["text"],
            store=False,
            metadata={"team": "a"},
            some_future_field={"x": 1},
        ),
        "application/json; charset=utf-8",
    ),
    (CHAT, lambda m: _chat(m, temperature=1.0, seed=-(2**63)), "application/json"),
    (CHAT, lambda m: _chat(m, temperature=1.0, seed=2**63 - 1), "APPLICATION/JSON"),
    (COMPLETIONS, lambda m: _completion(m, prompt=[1, VOCAB - 1], best_of=1), "application/json"),
    (COMPLETIONS, lambda m: _completion(m, max_completion_tokens=3), "application/json"),
    (CHAT, lambda m: _chat(m, logprobs=True, top_logprobs=20, n=2), "application/json"),
    (
        COMPLETIONS,
        lambda m: _completion(m, prompt=[[1, 2]], echo=True, logprobs=5, best_of=1),
        "application/json",
    ),
    (CHAT, lambda m: _chat(m, ignore_eos=True, min_tokens=2), "application/json"),
    (COMPLETIONS, lambda m: _raw(_completion(m), extra=_nested(60)), "application/json"),
    (CHAT, lambda m: _chat(m, content="caf\u00e9 \U0001f600 ok"), "application/json"),
]


def _good(conn: Conn, model: str) -> None:
    status, body = conn.post(COMPLETIONS, _completion(model))
    assert status == 200, body
    assert body["usage"]["completion_tokens"] >= 1


def _check_bad(conn: Conn, model: str, case: tuple, where: str) -> None:
    path, make, ctype, status, param, code = case
    got, body = conn.post(path, make(model), ctype)
    assert got == status, (where, path, got, body)
    err = body["error"]
    assert err["message"] and err["type"] == "invalid_request_error", (where, body)
    if param is not None:
        assert err["param"] == param, (where, err)
    if code is not None:
        assert err["code"] == code, (where, err)
    try:
        _good(conn, model)  # the same kept-alive connection serves the next request
    except AssertionError as exc:
        raise AssertionError(f"after {where} {path} {repr(make(model))[:200]}: {exc}") from None


@pytest.mark.parametrize("kind", ["cloud", "edge"])
def test_node_refuses_bad_inputs_with_4xx_and_keeps_the_connection(fleet, kind) -> None:
    conn = Conn(fleet[kind].url)
    try:
        for case in BAD:
            _check_bad(conn, fleet["model"], case, kind)
        for path, make, ctype in GOOD:
            status, body = conn.post(path, make(fleet["model"]), ctype)
            assert status == 200, (kind, body)
    finally:
        conn.close()


def test_gateway_refuses_bad_inputs_with_4xx_and_keeps_the_connection(fleet) -> None:
    conn = Conn(fleet["gw"].url)
    try:
        for case in BAD:
            _check_bad(conn, fleet["model"], case, "gateway")
        for path, make, ctype in GOOD:
            status, body = conn.post(path, make(fleet["model"]), ctype)
            assert status == 200, ("gateway", body)
    finally:
        conn.close()


def test_gateway_route_validates_like_the_hot_routes(fleet) -> None:
    """``/v1/route`` parses with the same checks: max_completion_tokens on completions,
    content type, depth, surrogates."""
    conn = Conn(fleet["gw"].url)
    model = fleet["model"]
    cases = [
        (
            _completion(model, max_completion_tokens="5"),
            "application/json",
            400,
            "max_completion_tokens",
        ),
        (_chat(model, max_completion_tokens=BIG), "application/json", 400, "max_completion_tokens"),
        (
            _completion(model, max_completion_tokens=2.5),
            "application/json",
            400,
            "max_completion_tokens",
        ),
        (_chat(model), "text/plain", 415, None),
        (_raw(_chat(model), extra=_nested(1000)), "application/json", 400, None),
        (_surrogate_chat(model), "application/json", 400, "messages.0.content"),
    ]
    try:
        for body, ctype, status, param in cases:
            got, err = conn.post("/v1/route", body, ctype)
            assert got == status, err
            assert err["error"]["param"] == param, err
            got, ok = conn.post("/v1/route", _completion(model, max_completion_tokens=7))
            assert got == 200 and ok["node"], ok
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["cloud", "edge"])
def test_negative_seed_samples_reproducibly(fleet, kind) -> None:
    """A negative seed is an ordinary seed (its 64-bit pattern) on both engines: it made the
    edge node answer 500."""
    conn = Conn(fleet[kind].url)
    body = _completion(fleet["model"], max_tokens=8, temperature=1.0, seed=-12345)
    try:
        texts = []
        for _ in range(2):
            status, r = conn.post(COMPLETIONS, body)
            assert status == 200, r
            texts.append(r["choices"][0]["text"])
        assert texts[0] == texts[1]
    finally:
        conn.close()


def test_depth_limit_is_exact_for_both_parsers() -> None:
    """64 levels of arrays and objects parse, 65 do not, with orjson (fastjson) and json."""
    from gateway import json_limits
    from gateway.front import fastjson

    ok = b'{"a": ' + _nested(63).encode() + b"}"  # the object plus 63 arrays: depth 64
    deep = b'{"a": ' + _nested(64).encode() + b"}"
    assert json_limits.loads(ok) and fastjson.loads(ok)[0]
    for raw in (deep, _nested(2000).encode(), b'{"a": ' * 3000):
        with pytest.raises(json_limits.JSONTooDeep):
            json_limits.loads(raw)
        with pytest.raises(ValueError):  # JSONTooDeep, or the decoder's own error
            fastjson.loads(raw)


def test_gateway_parse_json_checks_the_content_type() -> None:
    from gateway.errors import APIError
    from gateway.front.request_path import parse_json
    from gateway.openai_schema import ChatCompletionRequest

    raw = json.dumps(_chat("m")).encode()
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        assert parse_json(raw, ChatCompletionRequest, ctype)[1].model == "m"
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "application/jsonx", None):
        with pytest.raises(APIError) as err:
            parse_json(raw, ChatCompletionRequest, ctype)
        assert err.value.status == 415 and err.value.code == "unsupported_media_type"
    with pytest.raises(APIError) as err:  # no body, no content type: refused as JSON
        parse_json(b"", ChatCompletionRequest, None)
    assert err.value.status == 400 and err.value.code == "invalid_json"


# ---- engine isolation --------------------------------------------------------------------------

GOOD_PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]]
TOKENS = 24


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


# sampling parameters the node refuses, each of which a sampler cannot honour
BAD_SAMPLING = [
    SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=2**64),  # torch: overflow
    SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=-(2**63) - 1),
    SamplingParams(max_tokens=TOKENS, temperature=1.0, top_k=2**70),  # int64 tensor overflow
    SamplingParams(max_tokens=TOKENS, temperature=math.nan, seed=3),  # NaN probabilities
    SamplingParams(max_tokens=TOKENS, temperature=1.0, top_p=math.nan),
]


async def _collect(engine: Any, prompt: list[int], params: SamplingParams) -> tuple[list[int], Any]:
    """(tokens, finish reason), or ([], the exception) if the engine refused the request."""
    tokens: list[int] = []
    try:
        async for ev in engine.generate(GenerationRequest(list(prompt), params)):
            tokens += ev.token_ids
            if ev.finish_reason is not None:
                return tokens, ev.finish_reason
    except Exception as exc:
        return tokens, exc
    raise AssertionError("stream ended without a finish")


async def _isolation(engine: Any) -> tuple[list, list, list]:
    await engine.start()
    try:
        alone = [await _collect(engine, p, _greedy()) for p in GOOD_PROMPTS]

        async def bad_after_start() -> list:
            await asyncio.sleep(0.05)  # the good streams are decoding by now
            return await asyncio.gather(
                *(_collect(engine, [3, 4, 5, 6], sp) for sp in BAD_SAMPLING),
                _collect(engine, [1, VOCAB], _greedy()),  # a token id outside the vocabulary
            )

        together, bad = await asyncio.gather(
            asyncio.gather(*(_collect(engine, p, _greedy()) for p in GOOD_PROMPTS)),
            bad_after_start(),
        )
        after = await _collect(engine, GOOD_PROMPTS[0], _greedy())  # the engine still serves
        return alone, [*together, after], bad
    finally:
        await engine.shutdown()


def _assert_isolated(alone: list, together: list, bad: list) -> None:
    for (tokens, reason), (ref, ref_reason) in zip(together, [*alone, alone[0]], strict=True):
        assert reason is FinishReason.LENGTH and ref_reason is FinishReason.LENGTH
        assert len(tokens) == TOKENS and tokens == ref  # every token, as when run alone
    for tokens, outcome in bad:
        assert tokens == []
        assert outcome is FinishReason.ABORT or isinstance(outcome, Exception), outcome


def test_cloud_engine_fails_a_bad_request_alone(tiny_model_path, one_torch_thread) -> None:
    from cloud_engine.admission import InvalidRequest

    alone, together, bad = asyncio.run(_isolation(tiny_cloud_engine(tiny_model_path)))
    _assert_isolated(alone, together, bad)
    # bad sampling is refused inside the engine's step thread: the request ends with ABORT
    assert [outcome for _, outcome in bad[: len(BAD_SAMPLING)]] == [FinishReason.ABORT] * len(
        BAD_SAMPLING
    )
    assert isinstance(bad[-1][1], InvalidRequest)  # refused before it was queued


def test_edge_engine_fails_a_bad_request_alone(tiny_model_path, edge_home) -> None:
    from edge_runtime.engine import InvalidRequest

    alone, together, bad = asyncio.run(_isolation(tiny_edge_engine(tiny_model_path)))
    _assert_isolated(alone, together, bad)
    # the edge makes a request's sampler when it is submitted: refused there, alone
    assert all(isinstance(outcome, InvalidSampling) for _, outcome in bad[: len(BAD_SAMPLING)])
    assert isinstance(bad[-1][1], InvalidRequest)
