"""Tokenizer, chat template and streaming detokenization of the default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.node.textstream import TextStreamer
from routing.blocks import BLOCK_SIZE, block_hashes, model_seed
from routing.prompt import PromptFormatter, TemplateError

TEXTS = [
    "The quick brown fox jumps over the lazy dog. 1234567890!",
    "你好，世界！北京欢迎你。我们的办公室在上海和深圳。",
    "Emoji: 🎉🚀👍🏽 family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇨🇳",
    "Mixed 混合 text with ünïcödé and tabs\tand\nnewlines.",
]


@pytest.fixture(scope="module")
def fmt(default_model_path: Path) -> PromptFormatter:
    return PromptFormatter.from_folder(default_model_path)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(fmt: PromptFormatter, text: str) -> None:
    ids = fmt.encode(text)
    assert ids and fmt.decode(ids) == text


def test_digits_split_and_special_markers(fmt: PromptFormatter) -> None:
    ids = fmt.encode("2024")
    assert len(ids) == 4  # every digit on its own
    assert fmt.encode("<|im_start|>") == [1]
    assert fmt.encode("<|im_end|>") == [2]
    assert set(fmt.stop_token_ids) >= {2}


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_detokenization_never_splits_characters(fmt: PromptFormatter, text: str) -> None:
    ids = fmt.encode(text)
    streamer = TextStreamer(fmt.tokenizer)
    chunks = [streamer.push([i]) for i in ids]
    chunks.append(streamer.flush())
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_chat_template_matches_transformers(fmt: PromptFormatter, default_model_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(default_model_path)
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "再说一次"},
        ],
    ]
    for msgs in conversations:
        for gen in (True, False):
            ours = fmt.render(msgs, add_generation_prompt=gen)
            theirs = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert ours == theirs
        assert (
            fmt.encode_chat(msgs)
            == hf_tok.apply_chat_template(
                msgs, tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )


def test_default_system_prompt_injected(fmt: PromptFormatter) -> None:
    text = fmt.render([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")


def test_template_errors_are_typed() -> None:
    from tokenizers import Tokenizer, models

    f = PromptFormatter(
        Tokenizer(models.BPE()),
        "{{ raise_exception('roles must alternate') }}",
        None,
        None,
        (),
        frozenset(),
    )
    with pytest.raises(TemplateError, match="alternate"):
        f.render([{"role": "user", "content": "x"}])
    g = PromptFormatter(Tokenizer(models.BPE()), None, None, None, (), frozenset())
    with pytest.raises(TemplateError):
        g.render([{"role": "user", "content": "x"}])


def test_stop_strings_cut_and_hold_back(fmt: PromptFormatter) -> None:
    ids = fmt.encode("Answer: Paris. END of story")
    s = TextStreamer(fmt.tokenizer, stop=["END"])
    out = "".join(s.push([i]) for i in ids) + s.flush()
    assert out == "Answer: Paris. " and s.stopped
    s2 = TextStreamer(fmt.tokenizer, stop=["ENDING"])
    out2 = "".join(s2.push([i]) for i in ids) + s2.flush()
    assert out2 == "Answer: Paris. END of story" and not s2.stopped


def test_block_hashes_chain_and_are_seeded() -> None:
    ids = list(range(100))
    seed = model_seed("model-a")
    hs = block_hashes(ids, seed)
    assert len(hs) == 100 // BLOCK_SIZE
    assert block_hashes(ids[:48], seed) == hs[:3]  # a prefix has a prefix of the hashes
    changed = ids.copy()
    changed[5] = 999
    assert block_hashes(changed, seed)[0] != hs[0] and block_hashes(changed, seed)[3] != hs[3]
    assert block_hashes(ids, model_seed("model-b"))[0] != hs[0]
    assert hs[0] == block_hashes(ids, model_seed("model-a"))[0]  # stable


def test_private_redis_is_not_the_shared_one(redis_url: str) -> None:
    import redis

    assert not redis_url.endswith(":6379/0")
    r = redis.Redis.from_url(redis_url)
    r.set("edgecloud:test:ping", "pong")
    assert r.get("edgecloud:test:ping") == b"pong"
    r.close()
