"""Fault suite: property-based fuzzing of every public route of the real gateway and its nodes.

Real parts: the tiny random model served by the real cloud and edge engines behind the real
node app, and the real gateway in front of both, each under uvicorn on loopback. Hypothesis
draws request bodies from mutations of valid ones (every field wrong in every way a client can
get it wrong: types, ranges, NaN, lone surrogates, huge integers, deep nesting, unknown and
unsupported fields, wrong content types, raw bytes) and sends them over one kept-alive
connection. For every case: no 5xx, every error is OpenAI-shaped, every 200 stream ends with
``[DONE]``. After the run: the gateway's concurrency slots, its router's in-flight ledger and
every node's running and waiting counts are back to zero (nothing leaked).

``EDGECLOUD_FUZZ_CASES`` sets the number of cases (2,000 by default; the ``slow`` run: 10,000).
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.nodes import tiny_fleet

CASES = int(os.environ.get("EDGECLOUD_FUZZ_CASES", "2000"))
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/route")


@pytest.fixture(scope="module")
def fleet(tiny_model_path: Path, edge_home: None, one_torch_thread: None) -> Iterator[dict]:
    with tiny_fleet(tiny_model_path, "f", max_in_flight=64) as f:
        yield f


# ---- strategies: what a client can get wrong ----------------------------------------------------

_weird_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "é" * 30, "<|im_end|>", "\u202e", ""]),
)
_weird_int = st.one_of(
    st.integers(-3, 6),
    st.sampled_from([2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**400, -1, 0]),
)
_weird_number = st.one_of(
    _weird_int,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-9, 2.0, 1e308]),
)
_json_leaf = st.one_of(st.none(), st.booleans(), _weird_number, _weird_text)
_any_json = st.recursive(
    _json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_role = st.sampled_from(["user", "system", "assistant", "developer", "tool", "bogus", ""])
_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _weird_text}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "audio", "x"]), "x": _any_json}),
    _any_json,
)
_message = st.one_of(
    st.fixed_dictionaries(
        {"role": _role, "content": st.one_of(_weird_text, st.lists(_part, max_size=3))}
    ),
    st.fixed_dictionaries({"role": _role}),
    _any_json,
)
_prompt = st.one_of(
    _weird_text,
    st.lists(_weird_int, max_size=6),
    st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=2),
    st.lists(_weird_text, max_size=2),
    _any_json,
)
_fields: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": _weird_number,
    "max_completion_tokens": _weird_number,
    "temperature": _weird_number,
    "top_p": _weird_number,
    "top_k": _weird_number,
    "seed": _weird_number,
    "n": _weird_number,
    "stop": st.one_of(_weird_text, st.lists(_weird_text, max_size=5), _any_json),
    "stream": st.one_of(st.booleans(), _json_leaf),
    "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), _json_leaf)}), _any_json
    ),
    "logprobs": st.one_of(st.booleans(), _json_leaf),
    "tools": _any_json,
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])}), _any_json
    ),
    "logit_bias": _any_json,
    "presence_penalty": _weird_number,
    "user": _any_json,
    "unknown_field": _any_json,
}


@st.composite
def _body(draw: st.DrawFn, model: str) -> tuple[str, bytes, str | None]:
    route = draw(st.sampled_from(ROUTES))
    chat = route == "/v1/chat/completions" or (route == "/v1/route" and draw(st.booleans()))
    body: dict[str, Any] = {"model": model, "max_tokens": 2, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": "Say hi"}]
    else:
        body["prompt"] = "Once upon a time"
    for key in draw(st.lists(st.sampled_from(sorted(_fields)), max_size=4, unique=True)):
        body[key] = draw(_fields[key])
    if draw(st.integers(0, 9)) == 0:
        body["model"] = draw(st.one_of(_weird_text, _json_leaf, st.just("auto")))
    if draw(st.integers(0, 5)) == 0:
        if chat:
            body["messages"] = draw(st.one_of(st.lists(_message, max_size=3), _any_json))
        else:
            body["prompt"] = draw(_prompt)
    if draw(st.integers(0, 9)) == 0:
        body.pop(draw(st.sampled_from(sorted(body))), None)
    # valid requests stay cheap: generation is the same code path at 2 tokens as at 2,000
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 8 < v < 2**31:
            body[key] = 8
    mode = draw(st.integers(0, 19))
    ctype: str | None = "application/json"
    if mode == 0:
        raw = draw(st.binary(max_size=64))
    elif mode == 1:
        raw = ("[" * 2000 + "]" * 2000).encode()
    elif mode == 2:
        raw = json.dumps(body).encode()[: draw(st.integers(0, 40))]  # cut short
    else:
        raw = json.dumps(body, allow_nan=True).encode()
    if draw(st.integers(0, 14)) == 0:
        ctype = draw(st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded"]))
    return route, raw, ctype


class Client:
    """One kept-alive connection (reopened when the server closes it)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.c = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def send(
        self, method: str, path: str, raw: bytes | None, ctype: str | None
    ) -> tuple[int, bytes]:
        headers = {} if ctype is None else {"content-type": ctype}
        if raw is not None:
            headers["content-length"] = str(len(raw))
        self.c.request(method, path, body=raw, headers=headers)
        r = self.c.getresponse()
        data = r.read()
        if r.will_close:
            self.c.close()
            self.c = http.client.HTTPConnection(self.host, self.port, timeout=60)
        return r.status, data


def _check(status: int, data: bytes, route: str, stats: Counter[int]) -> None:
    stats[status] += 1
    assert status < 500, (route, status, data[:300])
    if status >= 400:
        err = json.loads(data)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str)
    elif data.startswith(b"data: "):
        assert data.rstrip().endswith(b"data: [DONE]"), data[-200:]
    else:
        json.loads(data)


def _assert_nothing_leaked(fleet: dict) -> None:
    gw = fleet["gateway"]
    deadline = time.monotonic() + 10
    while True:
        loads = [httpx.get(s.url + "/load").json() for k, s in fleet["served"].items() if k != "gw"]
        busy = [
            (n["id"], n["running"], n["waiting"]) for n in loads if n["running"] or n["waiting"]
        ]
        ledger = {n["id"]: gw.router.ledger.in_flight(n["id"]) for n in loads}
        if gw.in_flight == 0 and not busy and not any(ledger.values()):
            return
        assert time.monotonic() < deadline, (gw.in_flight, busy, ledger)
        time.sleep(0.1)


def _fuzz(fleet: dict, cases: int) -> Counter[int]:
    client = Client(fleet["served"]["gw"].url)
    stats: Counter[int] = Counter()

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_body(fleet["model"]))
    def run(case: tuple[str, bytes, str | None]) -> None:
        route, raw, ctype = case
        status, data = client.send("POST", route, raw, ctype)
        _check(status, data, route, stats)

    run()
    return stats


def test_fuzzed_requests_never_get_a_5xx_and_leak_nothing(fleet) -> None:
    stats = _fuzz(fleet, CASES)
    print(f"\nfuzz: {sum(stats.values())} requests, statuses {dict(sorted(stats.items()))}")
    assert sum(stats.values()) >= min(CASES, 2000) * 0.9
    assert stats[200] > 0 and any(400 <= s < 500 for s in stats)  # both kinds were exercised
    _assert_nothing_leaked(fleet)


@pytest.mark.slow
def test_fuzzed_requests_at_scale(fleet) -> None:
    stats = _fuzz(fleet, max(CASES, 10_000))
    print(f"\nfuzz: {sum(stats.values())} requests, statuses {dict(sorted(stats.items()))}")
    _assert_nothing_leaked(fleet)


def test_every_other_public_route_answers_without_a_5xx(fleet) -> None:
    client = Client(fleet["served"]["gw"].url)
    stats: Counter[int] = Counter()
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/admin/nodes"),
        ("GET", "/admin/policy"),
        ("GET", "/nope"),
        ("DELETE", "/v1/chat/completions"),
        ("GET", "/v1/chat/completions"),
        ("POST", "/admin/policy"),
        ("POST", "/v1/models"),
    ]:
        status, data = client.send(method, path, b"{}" if method == "POST" else None, None)
        assert status < 500, (method, path, status, data[:200])
        stats[status] += 1
    assert stats[200] >= 3


def test_the_leak_attack_gives_every_slot_back(fleet) -> None:
    """Streamed requests the node refuses (a token id past the vocabulary) from one client:
    each is a 4xx, and afterwards every concurrency slot and in-flight count is back, so the
    next request of anyone is served (before the fix, 4,083 of them locked every key out)."""
    client = Client(fleet["served"]["gw"].url)
    body = {"model": fleet["model"], "prompt": [1, 2, 10**6], "max_tokens": 2, "stream": True}
    raw = json.dumps(body).encode()
    gw = fleet["gateway"]
    for _ in range(gw.config.max_in_flight + 50):
        status, data = client.send("POST", "/v1/completions", raw, "application/json")
        assert status == 400, (status, data[:200])
        assert json.loads(data)["error"]["param"] == "prompt"
    _assert_nothing_leaked(fleet)
    ok = {"model": fleet["model"], "prompt": "Hello", "max_tokens": 2, "stream": True}
    status, data = client.send(
        "POST", "/v1/completions", json.dumps(ok).encode(), "application/json"
    )
    assert status == 200 and data.rstrip().endswith(b"data: [DONE]")
