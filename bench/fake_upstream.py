"""A fast fake OpenAI-compatible node, for benchmarks of what sits in front of one.

It answers instantly with a fixed reply, so that whatever is measured through it is the cost of
the relay in front, not of this server. A raw asyncio protocol on uvloop with the httptools
parser (keep-alive, pipelining, no framework); every reply but ``/load`` is prebuilt bytes.

Routes (the Node API subset a gateway needs):

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: a JSON completion, or with
  ``"stream": true`` an SSE stream of ``--chunks`` content chunks, a usage chunk when
  ``stream_options.include_usage`` is true, then ``data: [DONE]``; each event is its own
  write (as a node streaming tokens does) unless ``--one-write``.
- ``GET /load``: a NodeState (fresh timestamp), ``GET /tokenizer/{model}``: the model's tokenizer
  files, ``GET /v1/models``, ``GET /health``.

    python bench/fake_upstream.py --port 9100 --chunks 64 [--model smollm2-135m-instruct]
        [--reuse-port]   # start it K times on one port: one node on K cores

Prints ``READY <url>`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httptools

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from routing.fleet.state import NodeState
from routing.model_store import DEFAULT_MODEL, resolve
from routing.prompt import TOKENIZER_FILES

try:
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover - json is fine, only slower
    _loads = json.loads

ANSWER = "Hello from the fake upstream."
PROMPT_TOKENS = 16
CREATED = 1_700_000_000


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _response(status: str, ctype: str, body: bytes, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def _json(obj: Any, status: str = "200 OK") -> bytes:
    return _response(status, "application/json", _dumps(obj))


def _error(status: str, message: str) -> bytes:
    return _json(
        {"error": {"message": message, "type": "invalid_request_error", "param": None}}, status
    )


class Replies:
    """Every reply, prebuilt; ``/load`` is the only one rendered per request."""

    def __init__(
        self,
        model: str,
        identity: str,
        files: dict[str, str],
        state: dict,
        chunks: int,
        one_write: bool = False,
    ):
        self.model = model
        self.one_write = one_write
        self.state = state
        usage = {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": chunks,
            "total_tokens": PROMPT_TOKENS + chunks,
        }
        self.tokenizer = _json({"model": model, "identity": identity, "files": files})
        self.models = _json(
            {
                "object": "list",
                "data": [{"id": model, "object": "model", "created": CREATED, "owned_by": "fake"}],
            }
        )
        self.health = _json({"status": "ok", "node": state["id"], "model": model})
        self.not_found = _error("404 Not Found", "no such route")
        self.bad_json = _error("400 Bad Request", "the body is not a JSON object")
        self.full: dict[str, bytes] = {}
        self.stream: dict[tuple[str, bool], list[bytes]] = {}  # one piece per SSE event
        for route, obj, text_of in (
            (
                "chat",
                "chat.completion",
                lambda t, fin: {"index": 0, "delta": {"content": t}, "finish_reason": fin},
            ),
            (
                "completion",
                "text_completion",
                lambda t, fin: {"index": 0, "text": t, "finish_reason": fin},
            ),
        ):
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": ANSWER}}
                if route == "chat"
                else {"index": 0, "text": ANSWER}
            )
            choice["finish_reason"] = "stop"
            self.full[route] = _json(
                {
                    "id": "fake-0",
                    "object": obj,
                    "created": CREATED,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                }
            )
            chunk_obj = obj + ".chunk" if route == "chat" else obj
            events = []
            for i in range(chunks):
                fin = "stop" if i == chunks - 1 else None
                ev = {
                    "id": "fake-0",
                    "object": chunk_obj,
                    "created": CREATED,
                    "model": model,
                    "choices": [text_of(f"t{i} ", fin)],
                }
                events.append(b"data: " + _dumps(ev) + b"\n\n")
            usage_ev = {
                "id": "fake-0",
                "object": chunk_obj,
                "created": CREATED,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            done = b"data: [DONE]\n\n"
            head = (
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for with_usage in (False, True):
                evs = [*events, b"data: " + _dumps(usage_ev) + b"\n\n"] if with_usage else events
                pieces = [b"%x\r\n%s\r\n" % (len(e), e) for e in [*evs, done]]
                pieces[0] = head + pieces[0]
                pieces[-1] += b"0\r\n\r\n"
                self.stream[(route, with_usage)] = pieces

    def load(self) -> bytes:
        return _json({**self.state, "timestamp": time.time()})

    def get(self, path: bytes) -> bytes:
        if path == b"/load":
            return self.load()
        if path == b"/health":
            return self.health
        if path == b"/v1/models":
            return self.models
        if path.startswith(b"/tokenizer/"):
            if path[len(b"/tokenizer/") :].decode() == self.model:
                return self.tokenizer
            return _error("404 Not Found", "this node does not serve that model")
        return self.not_found

    def post(self, path: bytes, body: bytes) -> bytes | list[bytes]:
        if path == b"/v1/chat/completions":
            route = "chat"
        elif path == b"/v1/completions":
            route = "completion"
        else:
            return self.not_found
        if b'"stream"' not in body:  # the common fast path: no need to parse at all
            return self.full[route]
        try:
            req = _loads(body)
        except ValueError:
            return self.bad_json
        if not isinstance(req, dict):
            return self.bad_json
        if not req.get("stream"):
            return self.full[route]
        opts = req.get("stream_options") or {}
        return self.stream[(route, bool(opts.get("include_usage")))]


class Conn(asyncio.Protocol):
    """One client connection: parse requests as they arrive, answer each in order."""

    __slots__ = ("body", "parser", "replies", "transport", "url")

    def __init__(self, replies: Replies) -> None:
        self.replies = replies
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(self.replies.bad_json)
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        path = self.url.split(b"?", 1)[0]
        method = self.parser.get_method()
        if method == b"POST":
            out = self.replies.post(path, b"".join(self.body))
        elif method == b"GET":
            out = self.replies.get(path)
        else:
            out = self.replies.not_found
        if isinstance(out, list):  # a stream: one write per event, or all at once
            if self.replies.one_write:
                self.transport.write(b"".join(out))
            else:
                for piece in out:
                    self.transport.write(piece)
        else:
            self.transport.write(out)
        if not self.parser.should_keep_alive():
            self.transport.close()


def build_replies(args: argparse.Namespace, url: str) -> Replies:
    info = resolve(args.model)
    files = {f: (info.path / f).read_text() for f in TOKENIZER_FILES if (info.path / f).is_file()}
    state = NodeState(
        id=args.node_id,
        kind=args.kind,
        region=args.region,
        url=url,
        models=[info.name],
        model_identities={info.name: info.identity},
        max_context=args.max_context,
        device="fake",
        max_batch=args.max_batch,
        prefill_tokens_per_s=50_000.0,
        decode_ms_per_token=1.0,
        ttl_s=5.0,
    ).model_dump(mode="json")
    return Replies(info.name, info.identity, files, state, args.chunks, args.one_write)


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    url = f"http://{args.host}:{args.port}"
    replies = build_replies(args, url)
    server = await loop.create_server(
        lambda: Conn(replies),
        args.host,
        args.port,
        reuse_address=True,
        reuse_port=args.reuse_port or None,
        backlog=4096,
    )
    print(f"READY {url}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9100)
    ap.add_argument("--chunks", type=int, default=64, help="content chunks per streamed reply")
    ap.add_argument(
        "--one-write", action="store_true", help="send a stream in one write, not one per event"
    )
    ap.add_argument("--model", default=DEFAULT_MODEL, help="store name or HF folder")
    ap.add_argument("--node-id", default="fake-1")
    ap.add_argument("--kind", default="edge", choices=["edge", "cloud", "openai"])
    ap.add_argument("--region", default="local")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument(
        "--reuse-port",
        action="store_true",
        help="join an SO_REUSEPORT group: several processes on one port serve as one node",
    )
    args = ap.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - plain asyncio works, slower
        asyncio.run(serve(args))
    else:
        uvloop.run(serve(args))


if __name__ == "__main__":
    main()
