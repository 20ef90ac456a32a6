"""Logprobs, prompt logprobs (echo) and ``n`` choices on both engines, over real HTTP on
loopback with the official openai SDK: a tiny cloud node, a tiny edge node and a gateway in
front of both (``tests.nodes.tiny_fleet``).

Every value is checked against a torch reference forward of the same tiny model (the dense
reference, ``cloud_engine.model.dense``): the engines' logprobs are the log-softmax of their
raw logits, the cloud's in torch on the paged engine, the edge's in numpy on what ONNX Runtime
returns for the fp32 export.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from cloud_engine.model.dense import DenseKVCache
from cloud_engine.model.llama import LlamaForCausalLM
from cloud_engine.model.loader import load_model
from gateway.node.logprob_format import TokenTexts
from routing.prompt import PromptFormatter
from tests.nodes import tiny_fleet

KINDS = ["cloud", "edge"]
TOL = {"cloud": 1e-4, "edge": 2e-3}  # the edge's ONNX graph is not op-for-op torch's
PROMPT = [1, 504, 3458, 282, 4077, 28, 314, 1789, 2632, 30, 216, 1536, 415, 563, 253, 1167]


@pytest.fixture(scope="module")
def fleet(tiny_model_path: Path, edge_home: None, one_torch_thread: None) -> Iterator[dict]:
    with tiny_fleet(tiny_model_path, "lp") as f:
        yield f


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> LlamaForCausalLM:
    return load_model(tiny_model_path).eval()


@pytest.fixture(scope="module")
def formatter(tiny_model_path: Path) -> PromptFormatter:
    return PromptFormatter.from_folder(tiny_model_path)


def _client(fleet: dict, where: str) -> openai.OpenAI:
    url = fleet["served"][where].url + "/v1"
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


@torch.inference_mode()
def ref_logprobs(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]``: the log-softmax of the reference logits after each position."""
    cache = DenseKVCache(model, 1, len(ids))
    logits = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), cache)[0]
    return torch.log_softmax(logits.float(), dim=-1)


def ref_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(ref_logprobs(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def assert_same_entries(a: list[Any], b: list[Any]) -> None:
    """The same tokens with the same logprobs (to float rounding: a step's batch, which
    differs between two runs of a request, changes the last bits of a matrix product)."""
    assert [e.token for e in a] == [e.token for e in b]
    assert [e.logprob for e in a] == pytest.approx([e.logprob for e in b], abs=1e-5)
    for x, y in zip(a, b, strict=True):
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
        tops = [t.logprob for t in x.top_logprobs]
        assert tops == pytest.approx([t.logprob for t in y.top_logprobs], abs=1e-5)


def _ids_of(content: list[Any], texts: TokenTexts, candidates: list[int]) -> list[int]:
    """The token ids behind chat logprob entries, matched by bytes against ``candidates``."""
    out = []
    for entry, tid in zip(content, candidates, strict=False):
        assert entry.bytes == texts.get(tid)[1], (entry.token, tid)
        out.append(tid)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_chat_logprobs_equal_reference_log_softmax(
    fleet: dict, reference: LlamaForCausalLM, formatter: PromptFormatter, kind: str
) -> None:
    """Greedy chat with logprobs: each token's logprob is the reference log-softmax of the
    chosen token; top_logprobs are sorted, hold top_logprobs entries and start with the
    chosen token; the streamed entries equal the whole reply's."""
    client = _client(fleet, kind)
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    kw: dict[str, Any] = dict(
        model=fleet["model"], messages=messages, temperature=0, max_tokens=8, logprobs=True,
        top_logprobs=5, extra_body={"ignore_eos": True},
    )  # fmt: skip
    reply = client.chat.completions.create(**kw)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8
    prompt = formatter.encode_chat(messages)
    texts = TokenTexts(formatter.tokenizer)
    out = _ids_of(content, texts, ref_greedy(reference, prompt, 8))
    ref = ref_logprobs(reference, prompt + out)
    for j, (entry, tid) in enumerate(zip(content, out, strict=True)):
        row = ref[len(prompt) + j - 1]
        assert entry.logprob == pytest.approx(float(row[tid]), abs=TOL[kind])
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].bytes == entry.bytes  # greedy: the chosen token is first
        assert entry.top_logprobs[0].logprob == entry.logprob
        want = row.topk(5).values.tolist()
        assert tops == pytest.approx(want, abs=TOL[kind])
    assert "".join(e.token for e in content) == reply.choices[0].message.content

    streamed: list[Any] = []
    text = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed += c.logprobs.content
            text += c.delta.content or ""
    assert text == reply.choices[0].message.content
    assert_same_entries(streamed, content)


@pytest.mark.parametrize("kind", KINDS)
def test_completion_echo_gives_prompt_logprobs(
    fleet: dict, reference: LlamaForCausalLM, kind: str
) -> None:
    """``echo`` with ``logprobs`` on completions: the prompt's tokens come first, the first
    with a null logprob, each other the reference log-softmax of that token after the ones
    before it; the same after the prompt's blocks are cached (the cloud recomputes them)."""
    client = _client(fleet, kind)
    prompt = PROMPT * 3  # 48 tokens: three full blocks a prefix cache may hold
    client.completions.create(model=fleet["model"], prompt=prompt, max_tokens=2, temperature=0)
    ref = ref_logprobs(reference, prompt)
    for stream in (False, True):
        kw: dict[str, Any] = dict(
            model=fleet["model"], prompt=prompt, max_tokens=2, temperature=0, echo=True,
            logprobs=3, extra_body={"ignore_eos": True},
        )  # fmt: skip
        if stream:
            tokens, lps, tops, text = [], [], [], ""
            for chunk in client.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    text += c.text
                    if c.logprobs is not None:
                        tokens += c.logprobs.tokens
                        lps += c.logprobs.token_logprobs
                        tops += c.logprobs.top_logprobs
        else:
            reply = client.completions.create(**kw)
            lp = reply.choices[0].logprobs
            tokens, lps, tops, text = (
                lp.tokens,
                lp.token_logprobs,
                lp.top_logprobs,
                reply.choices[0].text,
            )
        assert len(lps) == len(prompt) + 2
        assert lps[0] is None and tops[0] is None
        got = torch.tensor(lps[1 : len(prompt)])
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(got, want, atol=TOL[kind]), (got - want).abs().max()
        for j in range(1, len(lps)):  # the chosen token is always in the dict, at most 3 + 1
            assert tokens[j] in tops[j] and len(tops[j]) <= 4
        assert text.startswith("".join(tokens[: len(prompt)]))


@pytest.mark.parametrize("kind", KINDS)
def test_n_with_seed_gives_reproducible_distinct_choices(fleet: dict, kind: str) -> None:
    """``n=3`` with a seed at temperature 1: three choices, the same three again for the same
    seed; they differ from each other; usage counts the prompt once."""
    client = _client(fleet, kind)
    kw: dict[str, Any] = dict(
        model=fleet["model"], prompt=PROMPT * 2, max_tokens=12, temperature=1.0, n=3, seed=42,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3
    assert a.usage.prompt_tokens == 32
    assert a.usage.completion_tokens == 36
    single = client.completions.create(**{**kw, "n": 1})  # choice 0 keeps the request's seed
    assert single.choices[0].text == texts[0]

    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts


@pytest.mark.parametrize("kind", KINDS)
def test_chat_choices_stream_as_their_whole_reply(fleet: dict, kind: str) -> None:
    """Chat with ``n=2``, a seed and logprobs: the streamed chunks, gathered by ``index``,
    give each choice's whole text and logprobs; each choice ends with its own finish."""
    client = _client(fleet, kind)
    kw: dict[str, Any] = dict(
        model=fleet["model"], messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=10, temperature=1.0, seed=5, n=2, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    whole = client.chat.completions.create(**kw)
    texts: dict[int, str] = {}
    lps: dict[int, list[Any]] = {}
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None and c.logprobs.content:
                lps.setdefault(c.index, []).extend(c.logprobs.content)
            if c.finish_reason is not None:
                assert c.index not in finishes
                finishes[c.index] = c.finish_reason
    for c in whole.choices:
        assert texts[c.index] == c.message.content
        assert_same_entries(lps[c.index], c.logprobs.content)
        assert finishes[c.index] == c.finish_reason
    assert sorted(finishes) == [0, 1]
    assert whole.usage.completion_tokens == sum(len(c.logprobs.content) for c in whole.choices)


@pytest.mark.parametrize("kind", KINDS)
def test_grammar_choices_report_raw_logit_logprobs(
    fleet: dict, reference: LlamaForCausalLM, formatter: PromptFormatter, kind: str
) -> None:
    """``response_format`` with logprobs and ``n=2``: each choice follows the grammar (a JSON
    object when it ends) and has its own logprobs, which are the reference log-softmax of the
    raw logits, before the grammar's mask (docs/structured-outputs.md): where the mask took
    the model's favourite away, the chosen token's logprob is below the top alternative's."""
    client = _client(fleet, kind)
    messages = [{"role": "user", "content": "Describe a cat as JSON."}]
    reply = client.chat.completions.create(
        model=fleet["model"], messages=messages, temperature=0, max_tokens=10, n=2,
        logprobs=True, top_logprobs=3, response_format={"type": "json_object"},
    )  # fmt: skip
    prompt = formatter.encode_chat(messages)
    texts = TokenTexts(formatter.tokenizer)
    by_bytes: dict[bytes, list[int]] = {}
    for tid in range(formatter.vocab_size):
        by_bytes.setdefault(bytes(texts.get(tid)[1]), []).append(tid)
    assert len(reply.choices) == 2
    assert reply.choices[0].message.content == reply.choices[1].message.content  # greedy
    below_top = 0
    for choice in reply.choices:
        text = choice.message.content or ""
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        content = choice.logprobs.content
        assert "".join(e.token for e in content) == text
        ids: list[int] = []
        for entry in content:
            row = ref_logprobs(reference, prompt + ids)[-1]
            same = by_bytes[bytes(entry.bytes)]
            match = [t for t in same if abs(float(row[t]) - entry.logprob) <= TOL[kind]]
            assert match, (entry.token, entry.logprob, [float(row[t]) for t in same])
            ids.append(match[0])
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == pytest.approx(row.topk(3).values.tolist(), abs=TOL[kind])
            below_top += entry.logprob < tops[0] - 1e-6
    assert below_top > 0
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)


def test_best_of_and_bad_logprob_fields_are_400s(fleet: dict) -> None:
    """``best_of`` > 1, ``top_logprobs`` without ``logprobs`` and too many choices are 400s in
    OpenAI's error shape, at the gateway and at the nodes."""
    for where in ("gw", "cloud", "edge"):
        client = _client(fleet, where)
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=fleet["model"], prompt="Hi", best_of=2)
        body = err.value.body
        assert body["code"] == "unsupported_parameter" and body["param"] == "best_of", body
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=fleet["model"], messages=[{"role": "user", "content": "Hi"}],
                top_logprobs=2,
            )  # fmt: skip
        assert "top_logprobs" in str(err.value.body)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=fleet["model"], messages=[{"role": "user", "content": "Hi"}],
                top_logprobs=21, logprobs=True,
            )  # fmt: skip
    with pytest.raises(openai.BadRequestError) as err:  # the edge has 4 slots
        _client(fleet, "edge").completions.create(model=fleet["model"], prompt="Hi", n=5)
    assert err.value.body["param"] == "n"


def test_gateway_routes_by_capability_and_counts_choices(fleet: dict) -> None:
    """Through the gateway: both nodes advertise logprobs and their ``max_n``; ``n`` beyond
    the edge's slots goes to the cloud; the estimate of ``n=4`` decodes at a larger batch."""
    gw = fleet["served"]["gw"].url
    nodes = httpx.get(gw + "/admin/nodes").json()["nodes"]
    by_kind = {n["kind"]: n for n in nodes}
    assert set(by_kind["edge"]["capabilities"]) == {"grammar", "logprobs", "prompt_logprobs"}
    assert by_kind["edge"]["max_n"] == 4 and by_kind["cloud"]["max_n"] >= 8
    client = _client(fleet, "gw")
    reply = client.completions.with_raw_response.create(
        model=fleet["model"], prompt=PROMPT, max_tokens=3, n=6, temperature=0, logprobs=1
    )
    assert reply.headers["x-edgecloud-tier"] == "cloud"
    parsed = reply.parse()
    assert len(parsed.choices) == 6 and all(c.logprobs.token_logprobs for c in parsed.choices)
    texts: dict[int, str] = {}
    lps: dict[int, list[float]] = {}
    usage = None
    for chunk in client.completions.create(
        model=fleet["model"], prompt=PROMPT, max_tokens=4, n=3, temperature=0, logprobs=1,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ):  # fmt: skip
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1  # greedy: alike
    assert all(len(v) == 4 for v in lps.values())
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens == 16
    one = _route(gw, fleet["model"], 1)
    four = _route(gw, fleet["model"], 4)
    for node in one:
        assert four[node]["predicted_e2e_ms"] > one[node]["predicted_e2e_ms"], (
            one[node],
            four[node],
        )


def _route(gw: str, model: str, n: int) -> dict[str, dict[str, Any]]:
    body = {"model": model, "prompt": "Hello there", "max_tokens": 32, "n": n}
    r = httpx.post(
        gw + "/v1/route", content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text
    return {c["node"]: c for c in r.json()["candidates"]}
