"""``ignore_eos`` and ``min_tokens`` on both real engines and through the real HTTP API.

The tiny random model rarely samples its own end-of-sequence ids, so each test makes one: the
stop token is a token the greedy run reaches at position ``K`` (its first occurrence there).
Without either setting the reply stops before it; with ``ignore_eos`` the reply has exactly
``max_tokens`` tokens, the greedy run's; with ``min_tokens`` no stop token is sampled before
that many tokens (``min_tokens <= K`` changes nothing). Through HTTP the stop token is the
model's end-of-sequence id (a copy of the tiny model whose generation_config names it), served
by the real cloud and edge nodes behind the real gateway, asked with the official openai SDK.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.node.textstream import TextStreamer
from routing.engine import FinishReason, GenerationRequest, SamplingParams
from routing.prompt import PromptFormatter
from tests.nodes import tiny_cloud_engine, tiny_edge_engine, tiny_fleet

PROMPT = [1, 2, 3, 4, 5]
MAX = 12


def _stop_position(tokens: list[int]) -> int:
    """The first position >= 2 whose token did not come earlier (its first occurrence)."""
    return next(k for k in range(2, len(tokens)) if tokens[k] not in tokens[:k])


async def _collect(engine: Any, params: SamplingParams) -> tuple[list[int], FinishReason]:
    tokens: list[int] = []
    async for ev in engine.generate(GenerationRequest(list(PROMPT), params)):
        tokens += ev.token_ids
        if ev.finish_reason is not None:
            return tokens, ev.finish_reason
    raise AssertionError("stream ended without a finish")


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=MAX, temperature=0.0, **kw)


async def _engine_cases(engine: Any) -> None:
    await engine.start()
    try:
        free, reason = await _collect(engine, greedy())  # no stop ids: the whole greedy run
        assert reason is FinishReason.LENGTH and len(free) == MAX
        k = _stop_position(free)
        stop = (free[k],)

        tokens, reason = await _collect(engine, greedy(stop_token_ids=stop))
        assert (tokens, reason) == (free[:k], FinishReason.STOP)

        tokens, reason = await _collect(engine, greedy(stop_token_ids=stop, ignore_eos=True))
        assert (tokens, reason) == (free, FinishReason.LENGTH)  # past the stop, to max_tokens

        tokens, reason = await _collect(engine, greedy(stop_token_ids=stop, min_tokens=k))
        assert (tokens, reason) == (free[:k], FinishReason.STOP)  # k tokens: the stop may come

        tokens, reason = await _collect(engine, greedy(stop_token_ids=stop, min_tokens=k + 1))
        assert tokens[:k] == free[:k] and len(tokens) >= k + 1, tokens
        assert stop[0] not in tokens  # not sampled at k (banned), and never sent as output
        assert reason is (FinishReason.LENGTH if len(tokens) == MAX else FinishReason.STOP)

        # sampled rows (seeded and not): every token a seeded run chose is a stop id, and
        # banned for the whole reply, so none of them comes
        sampled = SamplingParams(max_tokens=MAX, temperature=1.0, top_k=3, seed=5)
        chosen, _ = await _collect(engine, sampled)
        for seed in (5, None):
            params = SamplingParams(
                max_tokens=MAX,
                temperature=1.0,
                top_k=3,
                seed=seed,
                stop_token_ids=tuple(set(chosen)),
                min_tokens=MAX,
            )
            tokens, reason = await _collect(engine, params)
            assert reason is FinishReason.LENGTH and len(tokens) == MAX
            assert not set(tokens) & set(chosen), (tokens, chosen)
        # ignore_eos with min_tokens: nothing is banned, stop ids just do not end the reply
        params = greedy(stop_token_ids=stop, ignore_eos=True, min_tokens=MAX)
        assert await _collect(engine, params) == (free, FinishReason.LENGTH)
    finally:
        await engine.shutdown()


def test_cloud_engine_honours_ignore_eos_and_min_tokens(tiny_model_path, one_torch_thread) -> None:
    asyncio.run(_engine_cases(tiny_cloud_engine(tiny_model_path)))


def test_edge_engine_honours_ignore_eos_and_min_tokens(tiny_model_path, edge_home) -> None:
    asyncio.run(_engine_cases(tiny_edge_engine(tiny_model_path)))


def test_stop_strings_do_not_match_the_first_min_tokens(default_model_path: Path) -> None:
    tok = PromptFormatter.from_folder(default_model_path).tokenizer
    ids = tok.encode("ab STOP cd STOP ef").ids
    first = next(m for m in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:m]))
    # the first STOP is complete at token `first`: it ends the text from min_tokens <= first on
    for min_tokens, text in [(0, "ab "), (first, "ab "), (first + 1, "ab STOP cd ")]:
        one = TextStreamer(tok, ["STOP"], min_tokens=min_tokens)
        out = "".join(one.push([t]) for t in ids) + one.flush()
        assert (out, one.stopped, one.text) == (text, True, text), min_tokens
        every = TextStreamer(tok, ["STOP"], min_tokens=min_tokens)
        assert every.push(ids) + every.flush() == text, min_tokens  # all ids in one push


# ---- through HTTP ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A copy of the tiny model whose end-of-sequence id is the greedy run's token at K."""

    async def free_run() -> list[int]:
        engine = tiny_cloud_engine(tiny_model_path)
        await engine.start()
        try:
            return (await _collect(engine, greedy()))[0]
        finally:
            await engine.shutdown()

    free = asyncio.run(free_run())
    k = _stop_position(free)
    folder = tmp_path_factory.mktemp("tiny-eos") / "tiny-eos"
    shutil.copytree(tiny_model_path, folder)
    gen = folder / "generation_config.json"
    cfg = json.loads(gen.read_text()) if gen.is_file() else {}
    gen.write_text(json.dumps({**cfg, "eos_token_id": [free[k]]}))
    assert free[k] in PromptFormatter.from_folder(folder).stop_token_ids
    return {"path": folder, "free": free, "k": k}


@pytest.fixture(scope="module")
def fleet(eos_model: dict[str, Any], edge_home: None, one_torch_thread: None) -> Iterator[dict]:
    with tiny_fleet(eos_model["path"], "eos", poll_interval_s=1.0) as f:
        yield {**f["served"], "model": f["model"]}


def _sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _complete(client: openai.OpenAI, model: str, **extra: Any) -> tuple[int, str]:
    """(completion tokens, finish reason) of a greedy completion of PROMPT."""
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX, temperature=0, extra_body=extra or None
    )
    assert r.usage is not None
    return r.usage.completion_tokens, r.choices[0].finish_reason


@pytest.mark.parametrize("where", ["cloud", "edge", "gw"])
def test_http_ignore_eos_and_min_tokens(fleet: dict, eos_model: dict, where: str) -> None:
    client, model, k = _sdk(fleet[where].url), fleet["model"], eos_model["k"]
    assert _complete(client, model) == (k, "stop")  # the end-of-sequence id comes at K
    assert _complete(client, model, ignore_eos=True) == (MAX, "length")
    assert _complete(client, model, min_tokens=k) == (k, "stop")
    n, reason = _complete(client, model, min_tokens=k + 1)
    assert n >= k + 1 and reason == ("length" if n == MAX else "stop")


def test_http_streamed_ignore_eos_through_the_gateway(fleet: dict) -> None:
    client = _sdk(fleet["gw"].url)
    stream = client.completions.create(
        model=fleet["model"],
        prompt=PROMPT,  # the end-of-sequence id comes at K without ignore_eos
        max_tokens=MAX,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    finish, usage = None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    assert finish == "length" and usage is not None and usage.completion_tokens == MAX


def test_http_min_tokens_above_max_tokens_is_a_400(fleet: dict) -> None:
    client = _sdk(fleet["gw"].url)
    with pytest.raises(openai.BadRequestError) as err:
        _complete(client, fleet["model"], min_tokens=MAX + 1)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "min_tokens", body
    assert f"min_tokens ({MAX + 1}) must not exceed max_tokens ({MAX})" in body["message"]
