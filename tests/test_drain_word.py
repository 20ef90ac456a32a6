"""Drain with a word (issue 49, item 5): a stream cut at the drain deadline of a real SIGINT
ends with its API's error event naming the reason and its end, never a truncated body.

- A server whose streams never end (``tests/endless_sse.py``, under the project's real
  server): SIGINT with three streams open, one per API shape; each reads to a clean end.
- ``edgecloud serve`` (a real gateway with real edge and cloud nodes on the tiny model):
  SIGINT with long streams running; every stream ends with ``[DONE]``, after either its
  finish reason or the drain's error event, and the process exits 0.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import httpx

from gateway.drain_word import DRAIN_CODE, drain_words
from tests.conftest import free_port
from tests.nodes import Proc, cli

PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses")


def _read(url: str, body: dict, first: threading.Event, out: list[list[str]]) -> None:
    """Stream ``url`` to its end (httpx raises on a truncated chunked body), keeping its
    non-empty lines; ``first`` is set once an event arrived."""
    lines: list[str] = []
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                lines.append(line)
                first.set()
    out.append(lines)


def _streams(urls: list[str], body: dict) -> tuple[list[threading.Thread], list[list[str]]]:
    """One reading thread per URL (in order), each started once the previous got an event."""
    out: list[list[str]] = []
    threads = []
    for url in urls:
        first = threading.Event()
        t = threading.Thread(target=_read, args=(url, body, first, out), daemon=True)
        t.start()
        assert first.wait(120), url
        threads.append(t)
    return threads, out


def test_words_start_on_an_event_boundary() -> None:
    words = drain_words("/v1/chat/completions", "why", mid_event=True)
    assert words.startswith(b"\n\ndata: {") and words.endswith(b"data: [DONE]\n\n")
    assert drain_words("/v1/messages", "why").startswith(b"event: error\ndata: ")


def test_sigint_ends_every_endless_stream_with_its_error_event(tmp_path: Path) -> None:
    port = free_port()
    p = Proc([sys.executable, "-m", "tests.endless_sse", str(port), "0.5"], port, tmp_path / "log")
    p.wait_ready(timeout=60)
    threads, out = _streams([p.url + path for path in PATHS], {})
    assert p.stop(signal.SIGINT) == 0, p.tail()
    for t in threads:
        t.join(30)
    assert len(out) == 3  # in the order they ended: find each by its API's shape
    (chat,) = [x for x in out if x[-1] == "data: [DONE]"]
    (messages,) = [x for x in out if "overloaded_error" in x[-1]]
    (responses,) = [x for x in out if f'"code":"{DRAIN_CODE}"' in x[-1]]
    err = json.loads(chat[-2][len("data: ") :])["error"]
    assert chat[-1] == "data: [DONE]" and err["code"] == DRAIN_CODE and "SIGINT" in err["message"]
    assert all(x.startswith('data: {"choices"') for x in chat[:-2])  # nothing glued to it
    assert messages[-2] == "event: error" and "overloaded_error" in messages[-1]
    assert responses[-2] == "event: error" and DRAIN_CODE in responses[-1]
    log = p.log.read_text()
    assert "3 request(s) in flight, 3 cancelled" in log, log
    assert "(3 stream(s) ended with an error event)" in log and "Traceback" not in log, log


def test_sigint_drain_of_a_real_gateway_ends_every_stream(
    tiny_model_path: Path, tiny_home: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    args = cli(
        "serve", "--model", str(tiny_model_path), "--port", str(port),
        "--edge-port", str(free_port()), "--cloud-port", str(free_port()),
        "--edge-variant", "fp32", "--edge-threads", "1", "--cloud-threads", "1",
        "--cloud-device", "cpu", "--drain-timeout", "0.3",
    )  # fmt: skip
    p = Proc(args, port, tmp_path / "serve.log", env=tiny_home).wait_ready(240, "/v1/models")
    body = {"model": "auto", "prompt": "hello", "max_tokens": 1500, "stream": True}
    threads, out = _streams([p.url + "/v1/completions"] * 2, body)
    assert p.stop(signal.SIGINT, timeout=60) == 0, p.tail()
    for t in threads:
        t.join(60)
    assert len(out) == 2
    for lines in out:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2][len("data: ") :])
        if "error" in last:  # cut at the deadline: the word says why
            assert last["error"]["code"] == DRAIN_CODE and "SIGINT" in last["error"]["message"]
        else:
            assert last["choices"][0]["finish_reason"], lines[-3:]
    assert "Traceback" not in p.log.read_text(), p.tail()
