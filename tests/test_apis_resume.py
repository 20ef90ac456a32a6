"""A Responses or Messages stream whose node dies mid-stream is resumed like a chat stream:
the same fleet as tests/test_resume.py (a tiny cloud node behind a proxy that cuts its
connections, a second one), the client reads one uninterrupted stream in its API's events with
the unbroken run's text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.test_resume import fleet, gw  # noqa: F401  (the fixtures)

QUESTION = "Tell me a story about a lighthouse keeper."


def _sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for ev in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in ev.strip().splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


BODIES = {
    "/v1/responses": lambda model: {"model": model, "input": QUESTION, "temperature": 0,
                                    "max_output_tokens": 24, "stream": True, "store": False},
    "/v1/messages": lambda model: {"model": model, "max_tokens": 24, "temperature": 0,
                                   "stream": True, "messages": [{"role": "user", "content": QUESTION}]},
}  # fmt: skip


def _text(path: str, events: list[tuple[str, dict[str, Any]]]) -> str:
    if path == "/v1/responses":
        return "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    return "".join(
        d["delta"]["text"] for k, d in events if k == "content_block_delta" and "text" in d["delta"]
    )


@pytest.mark.parametrize("path", list(BODIES))
async def test_a_translated_stream_resumes_with_the_unbroken_answer(gw, fleet, path: str) -> None:  # noqa: F811
    gateway, client = gw
    body = BODIES[path](fleet["model"])
    ref = await client.post(path, json=body)
    assert ref.status_code == 200 and ref.headers["x-edgecloud-node"] == "c1"
    fleet["proxy"].cut_after(5)
    resumed0 = gateway.stream_stats.resumed
    got = await client.post(path, json=body)
    assert got.status_code == 200
    events = _sse(got.text)
    assert gateway.stream_stats.resumed == resumed0 + 1
    assert _text(path, events) == _text(path, _sse(ref.text)) != ""
    last = events[-1][0]
    assert last in ("response.completed", "response.incomplete", "message_stop"), events[-3:]
