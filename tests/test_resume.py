"""Mid-stream resume (issue 15.5): a node that dies during a stream does not end it.

Two real tiny cloud nodes; the first (tried first by the test policy) sits behind a TCP proxy
that drops every connection at once after a given number of SSE content events, and then
refuses new ones, as a node process that died would (tests/inproc.py ``CutProxy``). The
gateway re-sends the prompt's token ids plus the streamed completion's to the second node and
continues the same SSE stream. Compared with an unbroken greedy run: the same text, the same
completion token count (``max_tokens`` honoured across both nodes), one stream; the final usage
chunk (or, without one, an SSE comment) says it was resumed and from where to where.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.inproc import CutProxy, assert_idle, started_gateway
from tests.nodes import Served, tiny_cloud_engine

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def fleet(tiny_model_path: Path, one_torch_thread: None) -> Iterator[dict]:
    from gateway.node.app import create_node_app
    from gateway.node.server import build_service
    from routing.model_store import resolve
    from tests.conftest import free_port

    info = resolve(tiny_model_path)
    served: list[Served] = []
    proxy: CutProxy | None = None
    try:
        port1, port2 = free_port(), free_port()
        proxy = CutProxy(port1)
        s1 = build_service(
            tiny_cloud_engine(tiny_model_path),
            info,
            region="test",
            host="127.0.0.1",
            port=port1,
            node_id="c1",
            public_url=proxy.url,  # the gateway reaches c1 through the proxy only
        )
        served.append(Served(create_node_app(s1), port1))
        s2 = build_service(
            tiny_cloud_engine(tiny_model_path),
            info,
            region="test",
            host="127.0.0.1",
            port=port2,
            node_id="c2",
        )
        served.append(Served(create_node_app(s2), port2))
        yield {"proxy": proxy, "c2": served[1], "model": info.name}
    finally:
        if proxy is not None:
            proxy.stop()
        for s in served:
            s.stop()


@pytest.fixture
async def gw(fleet: dict) -> AsyncIterator[tuple[Any, Any]]:
    from gateway.front.config import GatewayConfig

    fleet["proxy"].revive()
    config = GatewayConfig(nodes=[fleet["proxy"].url, fleet["c2"].url], poll_interval_s=1.0)
    _, gateway, client = await started_gateway(config, nodes=2)
    gateway.policy_override = "by_id"
    try:
        yield gateway, client
    finally:
        await client.aclose()
        await gateway.close()


def _events(text: str) -> list[Any]:
    """The stream's events: parsed JSON objects, "[DONE]", or comment lines as str."""
    out: list[Any] = []
    for ev in text.split("\n\n"):
        ev = ev.strip()
        if not ev:
            continue
        if ev.startswith(":"):
            out.append(ev)
        elif ev == "data: [DONE]":
            out.append("[DONE]")
        else:
            assert ev.startswith("data: "), ev
            out.append(json.loads(ev[6:]))
    return out


def _text(events: list[Any], chat: bool) -> str:
    parts = []
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            parts.append((c["delta"].get("content") or "") if chat else c["text"])
    return "".join(parts)


def _usage(events: list[Any]) -> dict[str, Any] | None:
    return next((e for e in events if isinstance(e, dict) and e.get("usage")), None)


async def _stream(client: Any, path: str, body: dict[str, Any]) -> tuple[Any, list[Any]]:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r, _events(r.text)


def _chat_body(model: str, include_usage: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.mark.parametrize("cut_after", [3, 9])
async def test_chat_stream_resumes_with_the_unbroken_answer(gw, fleet, cut_after: int) -> None:
    gateway, client = gw
    body = _chat_body(fleet["model"])
    r0, ref = await _stream(client, "/v1/chat/completions", body)  # unbroken, on c1
    assert r0.headers["x-edgecloud-node"] == "c1"
    ref_usage = _usage(ref)
    assert ref_usage is not None and "edgecloud" not in ref_usage
    assert ref_usage["usage"]["completion_tokens"] >= cut_after + 2, "the answer is too short"

    fleet["proxy"].cut_after(cut_after)  # c1 dies after this many content events
    broken0, resumed0 = gateway.stream_stats.broken, gateway.stream_stats.resumed
    r1, got = await _stream(client, "/v1/chat/completions", body)
    assert r1.headers["x-edgecloud-node"] == "c1"  # the headers went out before it died
    assert got[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in got)
    assert _text(got, chat=True) == _text(ref, chat=True)
    ids = {e["id"] for e in got if isinstance(e, dict)}
    assert ids == {got[0]["id"]}, "one stream: every chunk carries the first node's id"
    usage = _usage(got)
    assert usage is not None
    assert usage["usage"]["completion_tokens"] == ref_usage["usage"]["completion_tokens"]
    assert usage["usage"]["prompt_tokens"] == ref_usage["usage"]["prompt_tokens"]
    assert usage["edgecloud"]["resumed"] == 1
    assert (usage["edgecloud"]["from"], usage["edgecloud"]["to"]) == ("c1", "c2")
    finishes = [
        e["choices"][0]["finish_reason"] for e in got if isinstance(e, dict) and e["choices"]
    ]
    assert (
        finishes[-1] == [f for f in finishes if f][-1] and finishes.count(None) == len(finishes) - 1
    )
    assert gateway.stream_stats.broken - broken0 == 1
    assert gateway.stream_stats.resumed - resumed0 == 1
    assert gateway.breakers._nodes["c1"].failures == 1
    assert_idle(gateway, ["c1", "c2"])


@pytest.mark.parametrize("route", ["chat", "completion"])
async def test_a_grammar_stream_resumes_with_its_state_rebuilt(gw, fleet, route: str) -> None:
    """With response_format, the next node's grammar state is rebuilt from the tokens already
    streamed (``resumed_tokens``): the answer is the unbroken one, not a second object."""
    gateway, client = gw
    note = {"type": "object", "properties": {"note": {"type": "string", "minLength": 300}}}
    rf = {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {**note, "required": ["note"]}},
    }
    chat = route == "chat"
    body = _chat_body(fleet["model"]) if chat else {
        "model": fleet["model"], "prompt": "A note:", "max_tokens": MAX_TOKENS,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    body["response_format"] = rf
    path = "/v1/chat/completions" if chat else "/v1/completions"
    _, ref = await _stream(client, path, body)
    assert _text(ref, chat).startswith('{"note":"')
    fleet["proxy"].cut_after(5)
    _, got = await _stream(client, path, body)
    assert _usage(got)["edgecloud"]["resumed"] == 1  # type: ignore[index]
    assert _text(got, chat) == _text(ref, chat)
    assert_idle(gateway, ["c1", "c2"])


def _calls(events: list[Any]) -> list[tuple[str, str]]:
    """The stream's tool calls, reassembled: (name, arguments) by index."""
    calls: dict[int, list[str]] = {}
    for e in events:
        for c in e.get("choices", []) if isinstance(e, dict) else []:
            for d in c["delta"].get("tool_calls") or []:
                entry = calls.setdefault(d["index"], ["", ""])
                entry[0] += d["function"].get("name", "")
                entry[1] += d["function"].get("arguments", "")
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))]


def _finish(events: list[Any]) -> str | None:
    return next(
        (c["finish_reason"] for e in events if isinstance(e, dict)
         for c in e.get("choices", []) if c.get("finish_reason")),
        None,
    )  # fmt: skip


@pytest.mark.parametrize("cut_after", [1, 4, 8])
async def test_a_tool_call_stream_resumes_where_its_call_was_cut(gw, fleet, cut_after: int) -> None:
    """The next node continues the call under the tools' grammar (rebuilt from the tokens
    already streamed) and the gateway parses its text with a parser primed by what the client
    has: the same calls, arguments and finish as an unbroken run, each call started once."""
    from tests.test_tools import ADD, WEATHER

    gateway, client = gw
    body = _chat_body(fleet["model"])
    body.update(tools=[WEATHER, ADD], tool_choice="required", max_tokens=80)
    _, ref = await _stream(client, "/v1/chat/completions", body)
    want = _calls(ref)
    assert want and all(json.loads(args) is not None for _, args in want), want
    assert _finish(ref) == "tool_calls"
    fleet["proxy"].cut_after(cut_after)
    _, got = await _stream(client, "/v1/chat/completions", body)
    assert _usage(got)["edgecloud"]["resumed"] == 1, got  # type: ignore[index]
    assert _calls(got) == want and _finish(got) == "tool_calls"
    ids = [d["id"] for e in got if isinstance(e, dict) for c in e.get("choices", [])
           for d in c["delta"].get("tool_calls") or [] if "id" in d]  # fmt: skip
    assert len(ids) == len(want) == len(set(ids))
    assert _text(got, True) == _text(ref, True)
    assert_idle(gateway, ["c1", "c2"])


async def test_completion_stream_without_usage_says_so_in_a_comment(gw, fleet) -> None:
    gateway, client = gw
    body = {
        "model": fleet["model"],
        "prompt": "The lighthouse keeper opened the door and",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    _, ref = await _stream(client, "/v1/completions", body)
    fleet["proxy"].cut_after(5)
    _, got = await _stream(client, "/v1/completions", body)
    assert _text(got, chat=False) == _text(ref, chat=False)
    assert _usage(got) is None  # the client did not ask for it
    comments = [e for e in got if isinstance(e, str) and e.startswith(":")]
    assert len(comments) == 1 and comments[0].startswith(": edgecloud ")
    tag = json.loads(comments[0][len(": edgecloud ") :])
    assert tag["resumed"] == 1 and tag["from"] == "c1" and tag["to"] == "c2"
    assert got[-1] == "[DONE]"
    assert_idle(gateway, ["c1", "c2"])


async def test_without_token_ids_a_broken_stream_ends_with_an_error(gw, fleet) -> None:
    """Nodes not asked for token ids (as an openai node would never send them): no resume,
    an SSE error and [DONE], never a silent truncation; the dispatch still ends."""
    gateway, client = gw
    gateway.resume_streams = False
    fleet["proxy"].cut_after(3)
    _, got = await _stream(client, "/v1/chat/completions", _chat_body(fleet["model"]))
    assert got[-1] == "[DONE]"
    assert "error" in got[-2]
    assert gateway.stream_stats.resumed == 0 and gateway.stream_stats.broken == 1
    assert_idle(gateway, ["c1", "c2"])


async def test_a_whole_reply_whose_node_dies_mid_body_is_sent_again(gw, fleet) -> None:
    """A reply sent whole: c1's headers came (at its first token), then it died before its
    body. Nothing reached the client yet, so the gateway sends the request to c2; the client
    reads one whole answer, the same greedy text, with c2's failover headers."""
    import asyncio

    gateway, client = gw
    body = {k: v for k, v in _chat_body(fleet["model"]).items() if k not in ("stream",
            "stream_options")}  # fmt: skip
    body["max_tokens"] = 400  # long enough to be cut mid-body
    ledger = gateway.router.ledger
    task = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    # the headers arrived once the ledger knows the first token of the request on c1
    for _ in range(3000):
        if any(e.first_token_at is not None for e in list(ledger._entries.values())):
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError("c1's headers never came")
    fleet["proxy"].kill()
    r = await task
    assert r.status_code == 200, r.text
    assert r.headers["x-edgecloud-node"] == "c2" and r.headers["x-edgecloud-reason"] == "failover"
    got = r.json()["choices"][0]["message"]["content"]
    fleet["proxy"].revive()
    want = (await client.post("/v1/chat/completions", json=body)).json()
    assert got == want["choices"][0]["message"]["content"]  # greedy: the same answer
    assert_idle(gateway, ["c1", "c2"])
