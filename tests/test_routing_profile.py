"""Request profiles: the node's own tokens and block hashes, max_tokens, learned output length."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from routing.blocks import BLOCK_SIZE, block_hashes, model_seed
from routing.output_length import OutputKnobs, OutputLengthEstimator
from routing.profile import build_profile, prompt_key
from routing.prompt import PromptFormatter
from routing.request_body import ProfileError

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "system",
    "user",
    "assistant",
    "you",
    "are",
    "kind",
    "hello",
    "there",
    "what",
    "is",
    "the",
    "capital",
    "of",
    "france",
]


@pytest.fixture(scope="module")
def formatter(tmp_path_factory: pytest.TempPathFactory) -> PromptFormatter:
    folder: Path = tmp_path_factory.mktemp("tok")
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(
        [AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)]
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"})
    )
    return PromptFormatter.from_folder(folder)


def chat_body(n_turns: int = 1, **kw) -> dict:
    messages = [{"role": "developer", "content": "you are kind"}]
    for _ in range(n_turns):
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is the "},
                    {"type": "text", "text": "capital of france"},
                ],
            }
        )
    return {"model": "m", "messages": messages, **kw}


def test_chat_profile_matches_the_nodes_tokens_and_hashes(formatter: PromptFormatter):
    body = chat_body(n_turns=4, max_tokens=50, stream=True)
    p = build_profile(
        body,
        formatter,
        model="m",
        model_identity="m-v1",
        route="chat",
        client_region="eu-west",
        api_key="k1",
    )
    # What the node computes: developer -> system, text parts joined, the model's template.
    flat = [{"role": "system", "content": "you are kind"}] + [
        {"role": "user", "content": "what is the capital of france"}
    ] * 4
    expected = formatter.encode_chat(flat)
    assert list(p.prompt_token_ids) == expected
    assert expected[0] == 1 and expected.count(2) == 5  # special tokens kept whole
    assert list(p.block_hashes) == block_hashes(expected, model_seed("m-v1"))
    assert len(p.block_hashes) == len(expected) // BLOCK_SIZE > 0
    assert (p.max_tokens, p.stream, p.client_region, p.api_key) == (50, True, "eu-west", "k1")
    assert p.expected_output_tokens == 50  # the default 128, capped by max_tokens
    assert p.context_needed == len(expected) + 50
    # Another model identity never shares block hashes.
    other = build_profile(
        body, formatter, model="m", model_identity="m-v2", route="chat", client_region="eu-west"
    )
    assert set(other.block_hashes).isdisjoint(p.block_hashes)


def test_pydantic_requests_render_as_their_dicts(formatter: PromptFormatter):
    """The gateway profiles a validated request or its raw body alike (tools and a history
    of calls included): the node's prompt is the gateway's."""
    from gateway.openai_schema import ChatCompletionRequest
    from routing.request_body import chat_prompt

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    body = {
        "model": "m",
        "max_completion_tokens": 7,
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "hello there"}]},
            {"role": "user", "content": "call f"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
    }
    kw = dict(model="m", model_identity="i", route="chat", client_region="us-east")
    p = build_profile(ChatCompletionRequest.model_validate(body), formatter, **kw)
    assert list(p.prompt_token_ids) == list(build_profile(body, formatter, **kw).prompt_token_ids)
    messages, extra = chat_prompt(body, formatter)
    text = formatter.render(messages, **extra)
    assert list(p.prompt_token_ids) == formatter.encode(text)
    assert "hello there\n\n# Tools" in text and "<tool_response>\n2\n</tool_response>" in text
    assert p.max_tokens == 7 and p.stream is False and p.tools
    assert "grammar" in p.needs


def test_completion_prompts(formatter: PromptFormatter):
    kw = dict(model="m", model_identity="i", route="completions", client_region="r")
    p = build_profile({"prompt": "hello there", "max_tokens": 16}, formatter, **kw)
    assert list(p.prompt_token_ids) == formatter.encode("hello there") and p.max_tokens == 16
    p = build_profile({"prompt": list(range(40))}, formatter, **kw)
    assert list(p.prompt_token_ids) == list(range(40)) and len(p.block_hashes) == 2
    assert p.max_tokens is None and p.context_needed == 41
    p = build_profile({"prompt": ["hello"]}, formatter, **kw)
    assert p.prompt_tokens == 1
    for bad in ({"prompt": ["a", "b"]}, {"prompt": ""}, {"prompt": None}, {"prompt": []}):
        with pytest.raises(ProfileError):
            build_profile(bad, formatter, **kw)
    with pytest.raises(ProfileError):
        build_profile({"messages": []}, formatter, **{**kw, "route": "chat"})


def test_expected_output_is_learned_per_key_and_route(formatter: PromptFormatter):
    est = OutputLengthEstimator(OutputKnobs(default_tokens=100, alpha=0.5))
    kw = dict(model="m", model_identity="i", route="chat", client_region="r", outputs=est)
    assert build_profile(chat_body(), formatter, api_key="a", **kw).expected_output_tokens == 100
    est.observe("a", "chat", 20)
    est.observe("a", "chat", 40)  # EWMA of logs: exp(log 20 + 0.5 * (log 40 - log 20))
    got = build_profile(chat_body(), formatter, api_key="a", **kw).expected_output_tokens
    assert got == pytest.approx(math.sqrt(20 * 40))
    assert (
        build_profile(chat_body(max_tokens=5), formatter, api_key="a", **kw).expected_output_tokens
        == 5
    )
    assert build_profile(chat_body(), formatter, api_key="b", **kw).expected_output_tokens == 100
    assert est.expected("a", "completions") == 100  # routes are learned apart


def test_output_estimator_is_lru_bounded_and_waits_for_samples():
    est = OutputLengthEstimator(OutputKnobs(default_tokens=64, max_keys=2, min_samples=2))
    est.observe("a", "chat", 10)
    assert est.expected("a", "chat") == 64  # one sample is not enough yet
    est.observe("a", "chat", 10)
    assert est.expected("a", "chat") == 10
    est.observe("b", "chat", 5)
    est.observe("c", "chat", 5)  # evicts "a", the least recently updated
    assert len(est) == 2 and est.expected("a", "chat") == 64
    assert est.expected(None, "chat", max_tokens=0) == 1.0  # never below one token


def test_output_length_is_learned_per_max_tokens_then_per_key():
    est = OutputLengthEstimator(OutputKnobs(default_tokens=100, alpha=1.0))
    est.observe("a", "chat", 8, max_tokens=32)  # short answers under a cap of 32
    est.observe("a", "chat", 250, max_tokens=512)  # long ones under 512
    assert est.expected("a", "chat", 32) == 8
    assert est.expected("a", "chat", 512) == 250
    assert est.expected("a", "chat", 300) == 250  # a cap never seen: the key's latest overall
    assert est.expected("a", "chat", None) == 250
    assert est.expected("a", "chat", 4) == 4  # never above the cap


def test_output_length_is_learned_per_first_prompt_block():
    est = OutputLengthEstimator(OutputKnobs(default_tokens=100, alpha=1.0))
    est.observe("a", "chat", 5, max_tokens=64, prefix=111)  # an app answering in a word
    est.observe("a", "chat", 60, max_tokens=64, prefix=222)  # one writing paragraphs
    assert est.expected("a", "chat", 64, prefix=111) == 5
    assert est.expected("a", "chat", 64, prefix=222) == 60
    assert est.expected("a", "chat", 64, prefix=333) == 60  # unseen app: the cap's latest


def test_a_prompt_sent_again_is_predicted_by_its_own_answers(formatter: PromptFormatter):
    """The whole prompt's statistic answers after one sample, ahead of its app's: two
    questions under one system prompt (one first block) keep their own lengths."""
    est = OutputLengthEstimator(OutputKnobs(default_tokens=100, alpha=1.0, min_samples=3))
    kw = dict(model="m", model_identity="i", route="chat", client_region="r", outputs=est)
    system = "You are terse. " * 20  # several blocks shared by both questions

    def profile(question: str):
        body = chat_body(max_tokens=64)
        body["messages"] = [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
        return build_profile(body, formatter, api_key="a", **kw)

    yes, essay = profile("Is it on?"), profile("Write about the sea.")
    assert yes.first_block == essay.first_block and yes.prompt_key != essay.prompt_key
    assert profile("Is it on?").prompt_key == yes.prompt_key  # the same text, the same key
    for p, n in ((yes, 3), (essay, 60)):
        est.observe("a", "chat", n, 64, p.first_block, p.prompt_key)
    assert profile("Is it on?").expected_output_tokens == 3
    assert profile("Write about the sea.").expected_output_tokens == 60
    # a new question: the app's statistics have 2 samples of the 3 needed, so the default
    # (100, capped at max_tokens)
    assert profile("Anything else?").expected_output_tokens == 64
    # prompts that differ only past their last full block are told apart
    ids = list(range(40))
    a, b = [*ids, 7], [*ids, 8]
    assert prompt_key(a, block_hashes(a, 1)) != prompt_key(b, block_hashes(b, 1))


def test_the_whole_prompt_key_can_be_turned_off():
    est = OutputLengthEstimator(OutputKnobs(default_tokens=100, alpha=1.0, whole_prompt=False))
    est.observe("a", "chat", 3, 64, prefix=1, prompt=42)
    assert est.expected("a", "chat", 64, prefix=1, prompt=42) == 3  # the app's statistic
    assert len(est) == 3  # (cap, first block), (cap), (route): no whole-prompt entry


def test_a_prompts_own_length_holds_under_any_cap_and_a_cut_answer_is_a_bound():
    """An answer that ended on its own (7 tokens under a cap of 16) predicts the same prompt
    under a cap of 32; one cut at its cap (16 of 16) says only 'at least 16'."""
    est = OutputLengthEstimator(OutputKnobs(default_tokens=100, alpha=1.0, min_samples=3))
    est.observe("a", "chat", 7, 16, prefix=1, prompt=42)
    assert est.expected("a", "chat", 32, prefix=1, prompt=42) == 7
    assert est.expected("a", "chat", 4, prefix=1, prompt=42) == 4  # the cap still caps
    est.observe("a", "chat", 16, 16, prefix=1, prompt=43)  # cut: no length of its own
    assert est.expected("a", "chat", 32, prefix=1, prompt=43) == 32  # default 100, capped
    est.observe("a", "chat", 20, 32, prefix=2, prompt=44)
    est.observe("a", "chat", 20, 32, prefix=2, prompt=45)
    est.observe("a", "chat", 20, 32, prefix=2, prompt=46)  # the cap-32 statistic: 20
    assert est.expected("a", "chat", 32, prefix=3, prompt=43) == 20  # ... but at least 16
    est.observe("a", "chat", 24, 24, prefix=1, prompt=43)  # cut again, higher
    assert est.expected("a", "chat", 32, prefix=3, prompt=43) == 24
    est.observe("a", "chat", 7, 32, prefix=1, prompt=43)  # then it ended on its own
    assert est.expected("a", "chat", 32, prefix=3, prompt=43) == 7  # no bound any more


def test_a_prompts_own_length_is_kept_per_node_kind(formatter: PromptFormatter):
    """The edge's int8 graph and the cloud's torch model may answer one prompt at different
    lengths: each kind's own answers predict it there; a kind that has not answered it yet
    takes the prompt's latest answer on any kind; a cut on one kind does not bound the other."""
    est = OutputLengthEstimator(OutputKnobs(default_tokens=100, alpha=1.0, min_samples=3))
    est.observe("a", "chat", 12, 32, prefix=1, prompt=42, kind="edge")
    est.observe("a", "chat", 22, 32, prefix=1, prompt=42, kind="cloud")
    assert est.expected("a", "chat", 32, prefix=1, prompt=42, kind="edge") == 12
    assert est.expected("a", "chat", 32, prefix=1, prompt=42, kind="cloud") == 22
    assert est.expected("a", "chat", 32, prefix=1, prompt=42, kind="npu") == 22  # latest, any
    assert est.expected("a", "chat", 32, prefix=1, prompt=42) == 22
    est.observe("a", "chat", 16, 16, prefix=1, prompt=43, kind="cloud")  # cut on the cloud
    est.observe("a", "chat", 9, 32, prefix=1, prompt=43, kind="edge")
    assert est.expected("a", "chat", 32, prefix=1, prompt=43, kind="edge") == 9
    # on the cloud: the app's latest (9), but at least the cap it was cut at there
    assert est.expected("a", "chat", 32, prefix=1, prompt=43, kind="cloud") == 16

    kw = dict(model="m", model_identity="i", route="chat", client_region="r", outputs=est)
    body = chat_body(max_tokens=32)
    p = build_profile(body, formatter, api_key="a", **kw)
    est.observe("a", "chat", 5, 32, p.first_block, p.prompt_key, "edge")
    est.observe("a", "chat", 30, 32, p.first_block, p.prompt_key, "cloud")
    again = build_profile(body, formatter, api_key="a", **kw)
    assert again.expected_output_tokens == 30  # the latest answer, on any kind
    assert again.expected_output_on("edge") == 5 and again.expected_output_on("cloud") == 30
    assert dict(again.expected_output_by_kind) == {"edge": 5.0}  # only where it differs


def test_answer_lengths_are_averaged_in_log_space():
    """Answers of one kind stop anywhere from a few tokens to their cap; predicted at their
    geometric mean, a short answer is not predicted at twice its length by the long ones."""
    geo = OutputLengthEstimator(OutputKnobs(alpha=0.5))
    for n in (6, 16, 6, 16):
        geo.observe("a", "chat", n, max_tokens=32)
    # an EWMA with alpha 0.5 over the logs of 6, 16, 6, 16: 11.08 tokens
    logs = math.log(6)
    for n in (16, 6, 16):
        logs += 0.5 * (math.log(n) - logs)
    assert geo.expected("a", "chat", max_tokens=32) == pytest.approx(math.exp(logs))
    assert math.exp(logs) == pytest.approx(11.076, abs=1e-3)
    one = OutputLengthEstimator()
    one.observe("a", "chat", 7, max_tokens=32)
    assert one.expected("a", "chat", max_tokens=32) == 7  # one length comes back whole


def test_one_apps_answers_are_told_apart_by_last_message_and_prompt_length(
    formatter: PromptFormatter,
):
    """Under one first block and cap, the same question asked at the end of other chats
    shares its answers' length, and a long document is not predicted by one-line answers."""
    est = OutputLengthEstimator(OutputKnobs(default_tokens=100, alpha=1.0))
    kw = dict(model="m", model_identity="i", route="chat", client_region="r", outputs=est)

    def profile(*turns: str):
        body = chat_body(max_tokens=16)
        roles = ["user", "assistant"]
        body["messages"] = [
            {"role": "system", "content": "You are a helpful assistant. " * 8},  # > one block
            *({"role": roles[i % 2], "content": t} for i, t in enumerate(turns)),
        ]
        return build_profile(body, formatter, api_key="a", **kw)

    def learn(p, n: int) -> None:
        est.observe(
            "a", "chat", n, 16, p.first_block, p.prompt_key, None, p.last_message_key,
            p.prompt_tokens,
        )  # fmt: skip

    yes = profile("Is it on?")
    learn(yes, 3)
    learn(profile("Describe the sea."), 12)
    doc = profile("Summarize: " + "lorem ipsum dolor " * 60)
    learn(doc, 1)  # an engine that ends a summary at once
    in_chat = profile("Hello, chat 7.", "Hi there.", "Is it on?")
    assert in_chat.first_block == yes.first_block and in_chat.prompt_key != yes.prompt_key
    assert in_chat.last_message_key == yes.last_message_key
    assert in_chat.expected_output_tokens == 3  # the same question's answer
    # a new short question: the short prompts' statistic (12), not the summary's 1
    assert profile("What is new?").expected_output_tokens == 12
    assert profile("Summarize: " + "other words here " * 60).expected_output_tokens == 1
    est.configure(OutputKnobs(default_tokens=100, alpha=1.0, last_message=False))
    assert profile("Hello, chat 8.", "Hi there.", "Is it on?").expected_output_tokens == 1
    est.configure(
        OutputKnobs(default_tokens=100, alpha=1.0, last_message=False, length_bucket=False)
    )
    assert profile("What is new?").expected_output_tokens == 1  # the app's latest, the summary


def _chat(
    formatter: PromptFormatter, est: OutputLengthEstimator, system: str, cap: int, *turns: str
):
    """The profile of a chat under one app's system prompt, its turns alternating user and
    assistant, with ``cap`` as max_tokens."""
    body = chat_body(max_tokens=cap)
    roles = ["user", "assistant"]
    body["messages"] = [{"role": "system", "content": system},
                        *({"role": roles[i % 2], "content": t} for i, t in enumerate(turns))]  # fmt: skip
    kw = dict(model="m", model_identity="i", route="chat", client_region="r", outputs=est)
    return build_profile(body, formatter, api_key="a", **kw)


def _learn(est: OutputLengthEstimator, p, n: int, cap: int) -> None:
    """``est`` learns that ``p`` was answered in ``n`` tokens under ``cap``."""
    est.observe("a", "chat", n, cap, p.first_block, p.prompt_key, None, p.last_message_key,
                p.prompt_tokens)  # fmt: skip


def test_an_answer_cut_at_its_cap_does_not_speak_for_its_question_elsewhere(
    formatter: PromptFormatter,
):
    """A question cut at its cap on its own (16 of 16) says only that it runs at least that
    long there: its last message's statistic keeps only answers that ended on their own."""
    system = "You are a helpful assistant. " * 8
    est = OutputLengthEstimator(OutputKnobs(default_tokens=100, alpha=1.0))
    alone = _chat(formatter, est, system, 16, "Tell me more.")
    other = _chat(formatter, est, system, 16, "Hi, chat 3.", "Hello.", "Go on.")
    _learn(est, alone, 16, 16)
    _learn(est, other, 5, 16)
    in_chat = _chat(formatter, est, system, 16, "Hi, chat 9.", "Hello.", "Tell me more.")
    assert in_chat.last_message_key == alone.last_message_key
    assert in_chat.expected_output_tokens == 5.0  # the app's 5, not the cut 16


def test_a_prompt_cut_at_its_cap_is_bounded_by_the_cut_under_a_larger_one(
    formatter: PromptFormatter,
):
    """A question cut at 16 asked again under 32 is predicted at least the cut."""
    system = "You are a helpful assistant. " * 8
    est = OutputLengthEstimator(OutputKnobs(default_tokens=100, alpha=1.0))
    for question, cap, n in (("Describe the sea.", 32, 24), ("Is it on?", 32, 8),
                             ("Tell me a story.", 16, 16)):  # fmt: skip
        _learn(est, _chat(formatter, est, system, cap, question), n, cap)
    assert _chat(formatter, est, system, 32, "Tell me a story.").expected_output_tokens == 16.0
    # under its old cap it is that cap; a question never cut is not lifted
    assert _chat(formatter, est, system, 16, "Tell me a story.").expected_output_tokens == 16
    assert _chat(formatter, est, system, 32, "Is it on?").expected_output_tokens == 8.0
