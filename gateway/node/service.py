"""Turns OpenAI requests into engine requests and engine token events into OpenAI chunks.

One NodeService wraps one engine (edge or cloud) and one model. It owns no HTTP: the routes in
``gateway.node.app`` call it. Invariants:
- Every admitted request ends with exactly one finish (stop, length or abort) and its engine
  request is released (``aclose`` + ``abort``) on every path: done, stop string, client gone.
- Prompt plus max_tokens over the context is a 400 before anything runs; a full queue a 429.
- Bodies arrive validated by ``gateway.openai_schema`` (bounded integers, no lone surrogates);
  on top of that, token ids outside the model's vocabulary, text the tokenizer cannot encode,
  sampling parameters an engine cannot honour (``routing.sampling_limits``) and any admission
  refusal of the engine are 400s naming the field, before anything runs.
- A request of ``n`` choices is ``n`` engine requests (``routing.choices``), checked for
  admission together before any runs; ``n`` above the engine's ``max_n`` is a 400.
- A ``response_format`` grammar is compiled here (off the event loop, once per schema:
  ``routing.grammar.GrammarCompiler``) and travels in ``SamplingParams.grammar`` (one compiled
  grammar for all ``n`` choices; each engine request starts its own state from it).
- Chat ``tools`` render through the model's template (``routing.tools.template_inputs``) and
  their grammar travels as a response_format's does; replies that may hold calls are parsed
  into ``tool_calls`` (``gateway.node.replies``).
- What the engine does not list in its capabilities (``routing.fleet.state.Capability``: a
  grammar, logprobs) is a 400 naming the field (``response_format``/``tools``, ``logprobs``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio

from gateway.errors import APIError, bad_request, not_found_model, too_many_requests
from gateway.node.textstream import TextStreamer
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from routing.choices import choice_request_id, choice_seed
from routing.engine import (
    Engine,
    EngineError,
    EngineTraits,
    FinishReason,
    GenerationRequest,
    QueueFull,
    RequestTooLong,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
)
from routing.fleet.state import Capability, NodeKind, NodeState
from routing.grammar import Grammar, GrammarCompiler, GrammarSpec, InvalidGrammar
from routing.power import EnergyMeter, RaplReader, Watts
from routing.prompt import PromptFormatter, TemplateError, UnencodableText
from routing.sampling_limits import InvalidSampling, check_sampling
from routing.tools import InvalidTools, ToolCalling, template_inputs

# Prompts longer than this many characters are tokenized off the event loop.
_OFFLOAD_CHARS = 2000


@dataclass
class NodeConfig:
    node_id: str
    region: str
    public_url: str
    model_name: str
    model_path: Path
    model_identity: str
    ttl_s: float = 5.0
    max_body_bytes: int = 4 * 1024 * 1024
    watts: Watts | None = None  # the operator's idle and load figures (--watts)
    energy_window_s: float = 1.0  # shortest window of the joules-per-request EWMA


@dataclass
class Prepared:
    """A validated request, tokenized and ready for the engine: one engine request per choice
    (``choices[0]`` is ``gen``; the others share its prompt, see ``routing.choices``)."""

    gen: GenerationRequest
    stop: list[str]
    model: str
    include_usage: bool
    kind: str  # "chat" or "completion"
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[GenerationRequest] = field(default_factory=list)
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    echo: str | None = None  # completions with echo: the prompt's text, sent before the answer
    tools: ToolCalling | None = None  # chat with tools that may be called: replies are parsed

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [self.gen]


@dataclass
class Delta:
    text: str
    event: TokenEvent
    finish_reason: str | None  # OpenAI finish reason once finished
    # with ``run(..., with_ids=True)``: the ids whose text this delta completes, and whether
    # the streamer holds back no text after it (see gateway.token_ids)
    token_ids: list[int] = field(default_factory=list)
    clean: bool = True
    index: int = 0  # the choice it belongs to
    # logprobs of the tokens consumed since the previous delta (the request asks), and on a
    # choice's first delta the prompt's (echo)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


class NodeService:
    def __init__(self, engine: Engine, formatter: PromptFormatter, config: NodeConfig) -> None:
        self.engine = engine
        self.formatter = formatter
        self.config = config
        self.served_names = {config.model_name, config.model_identity, config.model_path.name}
        self.started_at = time.time()
        self.energy = EnergyMeter(config.watts, RaplReader.find(), config.energy_window_s)
        self._grammars: GrammarCompiler | None = None  # made at the first grammar request

    # ---- grammars ------------------------------------------------------------------------
    def grammar_compiler(self) -> GrammarCompiler:
        """The node's compiler (its tokenizer at the model's logits width), made once."""
        if self._grammars is None:
            vocab = self.formatter.vocab_size
            cfg = self.config.model_path / "config.json"
            if cfg.is_file():
                vocab = max(vocab, int(json.loads(cfg.read_text()).get("vocab_size") or 0))
            self._grammars = GrammarCompiler(
                self.formatter.tokenizer.to_str(), vocab, self.formatter.stop_token_ids
            )
        return self._grammars

    async def grammar(
        self, spec: GrammarSpec | None, prefix: list[int], param: str = "response_format"
    ) -> Grammar | None:
        """``spec`` compiled for this node, its state checked over ``prefix`` (400s naming
        ``param``, the field that asked for it)."""
        if spec is None:
            return None
        if Capability.GRAMMAR not in self.traits.capabilities:
            raise bad_request(
                f"this node's engine does not serve {param}",
                param=param,
                code="unsupported_parameter",
            )

        def build() -> Grammar:
            g = Grammar(self.grammar_compiler().compile(spec), tuple(prefix))
            g.start()  # the prefix (a resumed reply) follows the grammar
            return g

        try:
            return await anyio.to_thread.run_sync(build)
        except InvalidGrammar as exc:
            raise bad_request(str(exc), param=exc.param) from exc

    # ---- request preparation -------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model not in self.served_names:
            raise not_found_model(model)

    async def _encode(self, fn, arg):  # type: ignore[no-untyped-def]
        size = len(arg) if isinstance(arg, str) else sum(len(m.get("content", "")) for m in arg)
        if size > _OFFLOAD_CHARS:
            return await anyio.to_thread.run_sync(fn, arg)
        return fn(arg)

    async def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self.check_model(req.model)
        calling = req.tool_calling
        try:
            messages, extra = template_inputs(req.messages, calling, self.formatter.chat_template)
            encode = functools.partial(self.formatter.encode_chat, **extra)
            ids = await self._encode(encode, messages)
        except (TemplateError, UnencodableText, InvalidTools) as exc:
            raise bad_request(str(exc), param="messages") from exc
        grammar = await self.grammar(
            req.grammar_spec, [], "tools" if calling else "response_format"
        )
        prep = self._prepared(req, ids, "chat", grammar)
        prep.tools = calling if calling is not None and calling.calls_possible else None
        return prep

    async def prepare_completion(self, req: CompletionRequest) -> Prepared:
        self.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            ids = [int(t) for t in prompt]
            vocab = self.formatter.vocab_size
            low, high = min(ids), max(ids)
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise bad_request(
                    f"token id {bad} is outside the vocabulary (size {vocab})", param="prompt"
                )
        else:
            text = prompt[0] if isinstance(prompt, list) else prompt
            try:
                ids = await self._encode(self.formatter.encode, text)
            except UnencodableText as exc:
                raise bad_request(str(exc), param="prompt") from exc
        if not ids:
            raise bad_request("prompt is empty after tokenization", param="prompt")
        if req.resumed_tokens > len(ids) - 1:
            raise bad_request("resumed_tokens must be less than the prompt's tokens", "prompt")
        resumed = ids[len(ids) - req.resumed_tokens :] if req.resumed_tokens else []
        grammar = await self.grammar(
            req.grammar_spec, resumed, "tools" if req.tools else "response_format"
        )
        return self._prepared(req, ids, "completion", grammar)

    def _prepared(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        ids: list[int],
        kind: str,
        grammar: Grammar | None = None,
    ) -> Prepared:
        ctx = self.engine.max_context
        requested = req.requested_max_tokens
        if len(ids) >= ctx:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens; your prompt has {len(ids)} tokens.",
                param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        if requested is not None and len(ids) + requested > ctx:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{len(ids) + requested} tokens ({len(ids)} in the prompt, {requested} for the "
                "completion). Please reduce the prompt or max_tokens.",
                param="max_tokens"
                if req.max_completion_tokens is None
                else "max_completion_tokens",
                code="context_length_exceeded",
            )
        max_tokens = requested if requested is not None else ctx - len(ids)
        n = req.n
        if n > 1 and n > self.max_n:
            raise bad_request(f"n must be at most {self.max_n} on this node", param="n")
        logprobs = _logprobs_asked(req)
        echo = isinstance(req, CompletionRequest) and req.echo
        if logprobs is not None and Capability.LOGPROBS not in self.traits.capabilities:
            raise bad_request(
                "this node's engine returns no log probabilities",
                param="logprobs",
                code="unsupported_parameter",
            )
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.formatter.sampling("temperature", req.temperature),
            top_p=self.formatter.sampling("top_p", req.top_p),
            top_k=int(self.formatter.sampling("top_k", req.top_k)),
            seed=req.seed,
            stop_token_ids=self.formatter.stop_token_ids,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=logprobs if echo else None,
            grammar=grammar,
        )
        try:
            check_sampling(sampling)
        except InvalidSampling as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        choices = [
            GenerationRequest(
                prompt_token_ids=ids,
                sampling=replace(sampling, seed=choice_seed(sampling.seed, i)),
                request_id=choice_request_id(rid, i),
                prefill_with=None if i == 0 else rid,
            )
            for i in range(n)
        ]
        try:
            for gen in choices:
                self.engine.check(gen)
        except RequestTooLong as exc:
            raise bad_request(str(exc), param="max_tokens", code="context_length_exceeded") from exc
        except QueueFull as exc:
            raise too_many_requests(str(exc), exc.retry_after_s) from exc
        except EngineError as exc:  # any other admission refusal is the request's fault
            raise bad_request(str(exc), param="prompt") from exc
        echo_text = None
        if echo:
            assert isinstance(req, CompletionRequest)
            p = req.prompt
            echo_text = p if isinstance(p, str) else p[0] if isinstance(p[0], str) else None
            if echo_text is None:
                echo_text = self.formatter.tokenizer.decode(ids, skip_special_tokens=False)
        return Prepared(
            choices[0],
            req.stop_list,
            req.model,
            req.include_usage,
            kind,
            choices=choices,
            logprobs=logprobs,
            echo=echo_text,
        )

    @functools.cached_property
    def traits(self) -> EngineTraits:
        """The engine's traits (what it serves: ``capabilities``, ``max_n``)."""
        return self.engine.stats().traits

    @property
    def max_n(self) -> int:
        """The most choices one request may ask for here (the engine's ``max_n``)."""
        return self.traits.max_n

    async def run_choices(self, prep: Prepared, with_ids: bool = False) -> AsyncIterator[Delta]:
        """The deltas of every choice of ``prep``, as they come (``Delta.index``); one choice
        runs as :meth:`run`. Leaving early releases every choice's engine request; a choice's
        error ends them all."""
        if len(prep.choices) == 1:
            async for d in self.run(prep, with_ids=with_ids):
                yield d
            return
        queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

        async def pump(i: int, gen: GenerationRequest) -> None:
            try:
                async for d in self.run(replace(prep, gen=gen, choices=[gen])):
                    d.index = i
                    await queue.put(d)
            except Exception as exc:  # handed to the consumer
                await queue.put(exc)
                return
            await queue.put(None)

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(prep.choices)]
        left = len(tasks)
        try:
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- running -----------------------------------------------------------------------------
    async def run(self, prep: Prepared, with_ids: bool = False) -> AsyncIterator[Delta]:
        """Text deltas of one request; the last one carries the OpenAI finish reason.

        ``with_ids``: each delta says which token ids its text completes (``Delta.token_ids``,
        ``Delta.clean``; see :mod:`gateway.token_ids`). Leaving this iterator early releases
        the engine request at once.
        """
        streamer = TextStreamer(
            self.formatter.tokenizer, prep.stop, min_tokens=prep.gen.sampling.min_tokens
        )
        stops = set(prep.gen.sampling.stop_token_ids)
        agen = self.engine.generate(prep.gen)
        finished = False
        self.energy.started()
        waiting: list[int] = []  # ids whose text has not gone out yet (with_ids)
        lps: list[TokenLogprob] = []  # logprobs of tokens consumed, not yet in a delta
        prompt_lps: list[TokenLogprob | None] | None = None

        def delta(
            text: str, ev: TokenEvent, reason: str | None, ids: list[int], clean: bool
        ) -> Delta:
            nonlocal lps, prompt_lps
            out = Delta(text, ev, reason, ids, clean, 0, lps, prompt_lps)
            lps, prompt_lps = [], None
            return out

        try:
            async for ev in agen:
                ids = ev.token_ids
                if ev.finish_reason is FinishReason.STOP and ids and ids[-1] in stops:
                    ids = ids[:-1]
                if ev.logprobs is not None:
                    lps.extend(ev.logprobs[: len(ids)])
                if ev.prompt_logprobs is not None:
                    prompt_lps = ev.prompt_logprobs
                done_ids: list[int] = []
                if with_ids:
                    text = ""
                    for tid in ids:
                        waiting.append(tid)
                        piece = streamer.push((tid,))
                        if piece:
                            text += piece
                            done_ids += waiting
                            waiting.clear()
                else:
                    text = streamer.push(ids)
                if streamer.stopped:
                    finished = True
                    yield delta(text, ev, "stop", done_ids, False)
                    return
                if ev.finish_reason is not None:
                    finished = True
                    text += streamer.flush()
                    reason = "length" if ev.finish_reason is FinishReason.LENGTH else "stop"
                    if ev.finish_reason is FinishReason.ABORT:
                        raise APIError(
                            503, "the request was aborted by the node", type_="server_error"
                        )
                    yield delta(text, ev, reason, done_ids, False)
                    return
                if text:
                    yield delta(text, ev, None, done_ids, not streamer.holding)
        except QueueFull as exc:
            raise too_many_requests(str(exc), exc.retry_after_s) from exc
        except RequestTooLong as exc:
            raise bad_request(str(exc), code="context_length_exceeded") from exc
        except InvalidSampling as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        except EngineError as exc:  # any other refusal of the request itself
            raise bad_request(str(exc), param="prompt") from exc
        finally:
            self.energy.ended(finished)
            await agen.aclose()
            if not finished or streamer.stopped:
                await self.engine.abort(prep.gen.request_id)

    # ---- state ---------------------------------------------------------------------------
    def node_state(self) -> NodeState:
        s = self.engine.stats()
        self.energy.sample()
        return NodeState(
            id=self.config.node_id,
            kind=NodeKind(self.engine.kind),
            region=self.config.region,
            url=self.config.public_url,
            models=[self.config.model_name],
            model_identities={self.config.model_name: self.config.model_identity},
            max_context=self.engine.max_context,
            **s.node_fields(),
            **self.energy.fields(),
            ttl_s=self.config.ttl_s,
        )


def _logprobs_asked(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """The top alternatives per token the request asks for; None: no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs
