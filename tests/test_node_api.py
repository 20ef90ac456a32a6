"""The Node API over real HTTP on loopback, with the official openai SDK, for both engines.

Each engine serves the tiny random model (fast, shares the default model's tokenizer); the
default model is served for real text.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.node_headers import HEADERS_AT_FIRST_TOKEN
from tests.conftest import free_port
from tests.nodes import Proc, cli

KINDS = ["edge", "cloud"]


def _node_args(kind: str, model: Path, port: int, extra: list[str]) -> list[str]:
    base = [
        "--model",
        str(model),
        "--port",
        str(port),
        "--region",
        "test",
        "--threads",
        "1",
        "--node-id",
        f"{kind}-test-{port}",
    ]
    if kind == "edge":
        return cli("edge", "serve", *base, "--variant", "fp32", *extra)
    return cli("cloud", "serve", *base, "--device", "cpu", *extra)


@pytest.fixture(scope="module", params=KINDS)
def tiny_node(request, tiny_model_path: Path, tiny_home: dict[str, str], tmp_path_factory):
    kind = request.param
    port = free_port()
    extra = ["--max-waiting", "16"]
    log = tmp_path_factory.mktemp("logs") / f"{kind}.log"
    args = _node_args(kind, tiny_model_path, port, extra)
    p = Proc(args, port, log, env=tiny_home).wait_ready()
    yield kind, p
    assert p.stop() == 0, p.tail()


@pytest.fixture(scope="module")
def client(tiny_node) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_node[1].url + "/v1", api_key="unused", max_retries=0)


MODEL = "tiny"  # replaced by the served name in tests below


def served_model(node: Proc) -> str:
    return httpx.get(node.url + "/v1/models").json()["data"][0]["id"]


def test_models_health_load(tiny_node) -> None:
    kind, node = tiny_node
    models = httpx.get(node.url + "/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    load = httpx.get(node.url + "/load").json()
    assert load["kind"] == kind and load["region"] == "test" and load["running"] == 0
    assert load["max_context"] == 2048 and load["max_batch"] >= 1
    assert load["device"].lower() == "cpu" and load["prefill_chunk"] > 0  # the engine's traits
    assert load["models"] == [models["data"][0]["id"]]
    tok = httpx.get(node.url + f"/tokenizer/{models['data'][0]['id']}").json()
    assert (
        "tokenizer.json" in tok["files"]
        and tok["identity"] == load["model_identities"][tok["model"]]
    )


def test_chat_stream_equals_non_stream(tiny_node, client) -> None:
    model = served_model(tiny_node[1])
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 10
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completions_max_tokens_and_token_prompt(tiny_node, client) -> None:
    model = served_model(tiny_node[1])
    r = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=5, temperature=0
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r2 = client.completions.create(model=model, prompt=[1, 2, 3, 4, 5], max_tokens=3, temperature=0)
    assert r2.usage.prompt_tokens == 5 and r2.usage.completion_tokens == 3


def test_stop_string(tiny_node, client) -> None:
    model = served_model(tiny_node[1])
    base = client.completions.create(
        model=model, prompt="The weather", max_tokens=20, temperature=0
    )
    text = base.choices[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = client.completions.create(
        model=model, prompt="The weather", max_tokens=20, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(tiny_node, client) -> None:
    model = served_model(tiny_node[1])
    kw = dict(model=model, prompt="Numbers:", max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


BAD = [
    ({"model": "M"}, 400, "messages"),
    ({"model": "M", "messages": []}, 400, "messages"),
    ({"model": "M", "messages": "hi"}, 400, "messages"),
    (
        {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        400,
        "max_tokens",
    ),
    (
        {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
        400,
        "max_tokens",
    ),
    (
        {"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        400,
        "temperature",
    ),
    (
        {"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": 5},
        400,
        "temperature",
    ),
    ({"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ({"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 200}, 400, "n"),
    (
        {"model": "M", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5},
        400,
        "stop",
    ),
    (
        {"model": "M", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
        400,
        "stream",
    ),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    (
        {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
        400,
        "max_tokens",
    ),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_inputs_are_4xx(tiny_node, body, status, param) -> None:
    node = tiny_node[1]
    body = {k: (served_model(node) if (k == "model" and v == "M") else v) for k, v in body.items()}
    r = httpx.post(node.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert param in (err["param"] or "")


def test_invalid_json_huge_prompt_and_oversized_body(tiny_node) -> None:
    node = tiny_node[1]
    model = served_model(node)
    r = httpx.post(
        node.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    long = "hello " * 3000  # about 3000 tokens > 2048 context
    r = httpx.post(
        node.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": long}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(
        node.url + "/v1/completions",
        content=json.dumps({"model": model, "prompt": "x" * (5 * 1024 * 1024)}),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(node.url + "/v1/completions", json={"model": model, "prompt": [1, 10**9]})
    assert r.status_code == 400


def test_sdk_raises_typed_errors(client, tiny_node) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=served_model(tiny_node[1]), messages=[], max_tokens=2)


def test_concurrent_streams_all_complete(tiny_node) -> None:
    node = tiny_node[1]
    model = served_model(node)
    aclient = openai.AsyncOpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    prompts = [f"Story number {i} begins" for i in range(8)]

    async def one(p: str, stream: bool) -> str:
        if not stream:
            r = await aclient.completions.create(
                model=model, prompt=p, max_tokens=16, temperature=0
            )
            return r.choices[0].text
        out = []
        async for c in await aclient.completions.create(
            model=model, prompt=p, max_tokens=16, temperature=0, stream=True
        ):
            out.append(c.choices[0].text if c.choices else "")
        return "".join(out)

    async def main() -> tuple[list[str], list[str]]:
        alone = [await one(p, False) for p in prompts]
        together = await asyncio.gather(*(one(p, True) for p in prompts))
        await aclient.close()
        return alone, list(together)

    alone, together = asyncio.run(main())
    assert together == alone  # batched slots give each request its own greedy text


def wait_idle(node: Proc, timeout_s: float = 10.0) -> dict:
    """The node's /load once it runs and queues nothing (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = httpx.get(node.url + "/load").json()
        if (load["running"] == 0 and load["waiting"] == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def test_disconnect_frees_the_slot(tiny_node) -> None:
    node = tiny_node[1]
    model = served_model(node)
    body = {
        "model": model,
        "prompt": "Go on forever:",
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", node.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        it = r.iter_lines()
        got = [next(it) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        busy = httpx.get(node.url + "/load").json()
        assert busy["running"] == 1
        if tiny_node[0] == "cloud":
            assert busy["kv_blocks_used"] >= 1
    load = wait_idle(node)
    assert load["running"] == 0 and load["waiting"] == 0
    assert load["kv_blocks_used"] == 0  # every block it held is back (free or cached)


def test_a_whole_reply_sends_its_headers_at_the_first_token(tiny_node) -> None:
    """The headers come while the answer is still being generated (marked for the gateway);
    a client that leaves then frees the slot, as a stream's does."""
    node = tiny_node[1]
    body = {"model": served_model(node), "prompt": "Go on forever:", "max_tokens": 1500,
            "temperature": 0}  # fmt: skip
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", node.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert r.headers[HEADERS_AT_FIRST_TOKEN] == "1"
        assert r.headers["content-type"].startswith("application/json")
        assert float(r.headers["x-edgecloud-measured-ttft-ms"]) > 0
        assert httpx.get(node.url + "/load").json()["running"] == 1  # still generating
    load = wait_idle(node)
    assert load["running"] == 0 and load["waiting"] == 0
    # read to the end, the same request is one whole completion
    done = httpx.post(node.url + "/v1/completions", json={**body, "max_tokens": 12}, timeout=60)
    assert done.status_code == 200 and 1 <= done.json()["usage"]["completion_tokens"] <= 12
    assert done.json()["object"] == "text_completion"


@pytest.mark.parametrize("kind", KINDS)
def test_full_queue_gives_429_with_retry_after(kind, tiny_model_path, tiny_home, tmp_path) -> None:
    port = free_port()
    cap = ["--slots", "1"] if kind == "edge" else ["--max-running", "1"]
    p = Proc(
        _node_args(kind, tiny_model_path, port, [*cap, "--max-waiting", "1"]),
        port,
        tmp_path / "n.log",
        env=tiny_home,
    ).wait_ready()
    try:
        model = served_model(p)
        body = {
            "model": model,
            "prompt": "Keep going:",
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
        }

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as c:

                async def one() -> httpx.Response:
                    async with c.stream("POST", p.url + "/v1/completions", json=body) as r:
                        await r.aread()
                        return r

                return await asyncio.gather(*(one() for _ in range(4)))

        results = asyncio.run(main())
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) >= 2 and 429 in codes, codes
        limited = next(r for r in results if r.status_code == 429)
        assert int(limited.headers["retry-after"]) >= 1
        assert json.loads(limited.content)["error"]["type"] == "rate_limit_error"
    finally:
        assert p.stop() == 0, p.tail()


@pytest.mark.parametrize("kind", KINDS)
def test_node_state_in_redis_with_ttl(
    kind, tiny_model_path, tiny_home, redis_url, tmp_path
) -> None:
    import redis

    port = free_port()
    node_id = f"{kind}-test-{port}"
    args = _node_args(kind, tiny_model_path, port, ["--redis", redis_url])
    p = Proc(args, port, tmp_path / "n.log", env=tiny_home)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        p.wait_ready()
        key = f"edgecloud:v1:node:{node_id}"
        deadline = time.monotonic() + 5
        while not r.exists(key) and time.monotonic() < deadline:
            time.sleep(0.1)
        state = json.loads(r.get(key))
        assert state["id"] == node_id and state["kind"] == kind and state["url"] == p.url
        assert 0 < r.ttl(key) <= 5
    finally:
        assert p.stop() == 0, p.tail()
    assert not r.exists(f"edgecloud:v1:node:{node_id}")
    r.close()


@pytest.fixture(scope="module")
def default_cloud_node(default_model_path: Path, tmp_path_factory):
    port = free_port()
    p = Proc(
        _node_args("cloud", default_model_path, port, []),
        port,
        tmp_path_factory.mktemp("logs") / "cloud-default.log",
    ).wait_ready()
    yield p
    p.stop()


def test_default_model_answers_paris(default_cloud_node) -> None:
    c = openai.OpenAI(base_url=default_cloud_node.url + "/v1", api_key="unused", max_retries=0)
    r = c.chat.completions.create(
        model="smollm2-135m-instruct",
        temperature=0,
        max_tokens=30,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
