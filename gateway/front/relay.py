"""Relaying one streamed reply to its client, resuming it on another node if its node dies.

:class:`StreamRelay` forwards the upstream's SSE events as they complete (what one read
completed goes out as one write); :class:`RelayResponse` is the ASGI response that runs it and
owns the dispatch from then on.

Invariants:
- ``RelayResponse`` ends its dispatch exactly once however the response ends: the body
  finished, broke, was cancelled (the client left), or was never iterated at all (the client
  left before the body started; Starlette then never touches the body); and if the response
  is dropped without being called, its finalizer does it.
- Once the first byte has gone to the client, a stream is never silently truncated: either it
  is resumed (below) or the client gets an SSE error event and ``[DONE]``.
- A stream whose node dies (connection lost, stream closed before ``[DONE]``, or ended by the
  node's drain word, :mod:`gateway.drain_word`) before its
  finish reason went out is resumed on another edge or cloud node serving the model, when
  the node sent the token ids of what it streamed (``gateway.token_ids``) and the cut fell on a
  token boundary: the client reads one uninterrupted answer (``gateway.front.resume``). At
  most ``MAX_RESUMES`` times per stream; each dead node's breaker counts a failure.
- The usage chunk is kept out when the client did not ask for it.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.drain_word import DRAIN_MARK
from gateway.front.dispatch import Dispatch, Outcome, measured_of
from gateway.front.resume import (
    Resumed,
    StreamIdentity,
    continuation_body,
    primed_parser,
    rewrite_event,
    tag_comment,
    usage_event,
    whole_usage,
)
from gateway.node_headers import node_ttft_ms, node_wait_ms
from gateway.proxy import Opened, SSEReader, split_events, sse_error, usage_of
from gateway.token_ids import PREFIX as IDS_PREFIX
from gateway.token_ids import TOKEN_IDS_HEADER, take_ids
from routing.fleet.state import NodeKind
from routing.prompt import PromptFormatter
from routing.tool_parser import ToolCallParser
from routing.tools import calling_of

MAX_RESUMES = 2
_FINISH = b'"finish_reason":"'


@dataclass(slots=True)
class StreamStats:
    """Streams this gateway saw break after their first byte, and those it resumed."""

    broken: int = 0
    resumed: int = 0


class StreamRelay:
    """One streamed reply, leg by leg (see the module's docstring)."""

    def __init__(
        self,
        dispatch: Dispatch,
        opened: Opened,
        stats: StreamStats,
        formatter: PromptFormatter | None = None,
    ) -> None:
        assert dispatch.plan is not None
        self.formatter = formatter  # the model's: decodes what was streamed, for a tools resume
        self.dispatch = dispatch
        self.plan = dispatch.plan
        self.stats = stats
        self.chat = self.plan.route == "chat"
        now = time.perf_counter()
        self.ttft_ms = (now - self.plan.t_start) * 1000
        self.first_event = opened.first_event or b""
        self.node_id = opened.node_id
        self.leg_start = opened.sent_at
        self.leg_ttft_ms = (now - opened.sent_at) * 1000
        self._take_leg(opened)
        self.convert = False  # a continuation: its events are rewritten for the client
        self.sent_ids: list[int] = []  # completion token ids the client has
        self.clean = True  # the text sent ends on a token boundary
        self.finished = False  # a finish reason went out
        self.done = False  # [DONE] went out
        self.usage: dict[str, Any] | None = None  # as the client gets it
        self.leg_usage: dict[str, Any] | None = None  # as the last node reported it
        self.failed: str | None = None  # the stream broke for good
        self.resumed: Resumed | None = None
        self.ident: StreamIdentity | None = None
        self.calls: ToolCallParser | None = None  # a chat with tools, once resumed
        self._earlier_completion = 0

    def _take_leg(self, opened: Opened) -> None:
        self.node_drained = False  # this leg ended with its node's drain word
        resp = opened.response
        self.reader: SSEReader = resp.extensions["edgecloud_batches"]
        self.got: tuple[bytes, int] | None = resp.extensions["edgecloud_first_batch"]
        self.with_ids = resp.headers.get(TOKEN_IDS_HEADER) == "1"
        self.leg_wait_ms = node_wait_ms(resp.headers)  # its node's wait before the first token
        self.leg_node_ttft_ms = node_ttft_ms(resp.headers)  # and its own time to first token

    # ---- the body -----------------------------------------------------------------------------
    async def body(self) -> AsyncIterator[bytes]:
        while True:
            try:
                async for data in self._leg():
                    yield data
                if self.done:
                    return
                broken = (
                    "the node shut down mid-stream"
                    if self.node_drained
                    else "the node closed the stream before it finished"
                )
            except (httpx.TransportError, OSError) as exc:
                broken = f"the node failed mid-stream ({type(exc).__name__})"
            self.stats.broken += 1
            if not await self._resume():
                self.failed = broken
                yield sse_error(broken)
                return

    async def _leg(self) -> AsyncIterator[bytes]:
        got, self.got = self.got, None
        while got is not None:
            data = got[0]
            if DRAIN_MARK in data:
                data = self._drop_drain_word(data)
            if self.with_ids and IDS_PREFIX in data:
                data = self._strip_ids(data)
                self.dispatch.progress(self.node_id, len(self.sent_ids) - self._earlier_completion)
            if self.convert:
                data = self._rewrite(data)
            elif b"[DONE]" in data or b'"usage"' in data:
                data = self._usage_and_done(data)
            if self.with_ids and _FINISH in data:
                self.finished = True
            if data:
                yield data
            if self.node_drained:
                return
            got = await self.reader.next_events()

    def _drop_drain_word(self, data: bytes) -> bytes:
        """The events before a node's drain word (:mod:`gateway.drain_word`); the word and
        its ``[DONE]`` are dropped and the leg counts as broken, so it is resumed."""
        out = []
        for ev in split_events(data):
            if DRAIN_MARK in ev and ev.startswith(b'data: {"error"'):
                self.node_drained = True
                break
            out.append(ev)
        return b"".join(out)

    def _strip_ids(self, data: bytes) -> bytes:
        out = []
        for ev in split_events(data):
            taken = take_ids(ev)
            if taken is not None:
                ids, self.clean, ev = taken
                self.sent_ids += ids
            out.append(ev)
        return b"".join(out)

    def _usage_and_done(self, data: bytes) -> bytes:
        out = []
        for ev in split_events(data):
            u = usage_of(ev)
            if u is not None:
                self.usage = self.leg_usage = u
                if not self.plan.include_usage:
                    continue
            if ev.startswith(b"data: [DONE]"):
                self.done = True
            out.append(ev)
        return b"".join(out)

    def _rewrite(self, data: bytes) -> bytes:
        assert self.ident is not None and self.resumed is not None
        out = []
        for ev in split_events(data):
            if ev.startswith(b"data: [DONE]"):
                tag = self.resumed.tag()
                if self.usage is not None and self.plan.include_usage:
                    out.append(usage_event(self.usage, self.chat, self.ident, tag))
                else:
                    out.append(tag_comment(tag))
                out.append(ev)
                self.done = True
                continue
            conv, usage = rewrite_event(ev, self.chat, self.ident, self.calls)
            if usage is not None:
                self.leg_usage = usage
                self.usage = whole_usage(
                    usage, self.plan.profile.prompt_tokens, self._earlier_completion
                )
            elif conv:
                out.append(conv)
        return b"".join(out)

    # ---- resuming -----------------------------------------------------------------------------
    async def _resume(self) -> bool:
        """Continue the stream on another node; False when it cannot be (see the module)."""
        d, plan = self.dispatch, self.plan
        d.fail(self.node_id)
        await d.aclose_upstream_quietly()
        if not (self.with_ids and self.clean) or self.finished:
            return False
        if self.chat and self.formatter is None and self._calls_possible():
            return False  # the streamed text cannot be decoded to continue its calls
        if self.resumed is not None and len(self.resumed.hops) >= MAX_RESUMES:
            return False
        body = continuation_body(
            plan.body, plan.profile.prompt_token_ids, self.sent_ids, plan.profile.max_tokens
        )
        if body is None:
            return False
        cands = [
            c
            for c in plan.decision.candidates()
            if c.node.id not in d.tried and c.node.kind in (NodeKind.EDGE, NodeKind.CLOUD)
        ]
        opened = await d.open_continuation(cands, body)
        if opened is None:
            return False
        if self.ident is None:
            self.ident = StreamIdentity.of_event(self.first_event, str(plan.body.get("model")))
        if self.calls is None and self.chat and self._calls_possible():
            assert self.formatter is not None
            self.calls = primed_parser(self.formatter.decode(self.sent_ids))
        if self.resumed is None:
            self.resumed = Resumed(self.node_id)
        self.resumed.hops.append(opened.node_id)
        self._earlier_completion = len(self.sent_ids)
        self.node_id = opened.node_id
        self.leg_start = opened.sent_at
        self.leg_ttft_ms = (time.perf_counter() - opened.sent_at) * 1000
        self._take_leg(opened)
        self.convert = True
        self.stats.resumed += 1
        d.first_token(opened.node_id)
        return True

    def _calls_possible(self) -> bool:
        calling = calling_of(self.plan.body)
        return calling is not None and calling.calls_possible

    # ---- the end ------------------------------------------------------------------------------
    async def finish(self) -> None:
        """End the dispatch as the body ended (called once, by :class:`RelayResponse`)."""
        d = self.dispatch
        outcome = Outcome.CLIENT_GONE
        try:
            await d.aclose_upstream_quietly()
            now = time.perf_counter()
            if self.failed is not None:
                outcome = Outcome.FAILED
            elif self.done and self.usage is not None:
                e2e = (now - self.plan.t_start) * 1000
                whole = measured_of(self.usage, e2e, self.ttft_ms)
                leg = replace(
                    whole, node_queue_ms=self.leg_wait_ms, node_ttft_ms=self.leg_node_ttft_ms
                )
                if self.resumed is not None and self.leg_usage is not None:
                    leg_e2e = (now - self.leg_start) * 1000
                    leg = measured_of(
                        self.leg_usage,
                        leg_e2e,
                        self.leg_ttft_ms,
                        self.leg_wait_ms,
                        self.leg_node_ttft_ms,
                    )
                d.end(self.node_id, leg)
                outcome = Outcome.OK
                await d.account(whole, self.node_id, self._tier_headers())
        finally:
            d.close(outcome)

    def _tier_headers(self) -> dict[str, str]:
        cand = next((c for c in self.plan.decision.candidates() if c.node.id == self.node_id), None)
        h = {"x-edgecloud-tier": cand.node.kind.value if cand else ""}
        if cand is not None:
            h["x-edgecloud-predicted-ttft-ms"] = f"{cand.estimate.ttft_ms:.1f}"
        return h


class RelayResponse(StreamingResponse):
    """The streamed reply: runs a :class:`StreamRelay` and ends its dispatch once, however
    the response ends (see the module's docstring).

    It also watches for the client going away without an anyio task group. Under ASGI spec
    versions before 2.4 (uvicorn says 2.3), Starlette streams in a child task of an anyio task
    group and waits for ``http.disconnect`` in the parent, cancelling the stream when the
    client leaves. This does the same with one plain asyncio task watching ``receive``, which
    cancels the streaming task on a disconnect (and that cancellation, its own, ends the
    response normally, as Starlette's cancel scope does): the task group, its cancel scope and
    task handles cost about a tenth of a streamed request's CPU.
    """

    def __init__(self, relay: StreamRelay, headers: dict[str, str]) -> None:
        super().__init__(relay.body(), media_type="text/event-stream", headers=headers)
        self.relay = relay
        # dropped without being called: the dispatch still ends (its close is idempotent)
        self._finalizer = weakref.finalize(self, relay.dispatch.close, Outcome.CLIENT_GONE)
        self._finalizer.atexit = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._serve(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            finally:
                await self.relay.finish()

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        spec = scope.get("asgi", {}).get("spec_version", "2.0")
        if scope["type"] != "http" or tuple(map(int, spec.split("."))) >= (2, 4):
            await super().__call__(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        state = {"streaming": True, "disconnected": False}

        async def watch() -> None:
            await self.listen_for_disconnect(receive)
            if state["streaming"]:
                state["disconnected"] = True
                task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["disconnected"]:
                raise
            task.uncancel()  # our own cancellation: the client left, the response is over
        finally:
            state["streaming"] = False
            watcher.cancel()
        if self.background is not None:
            await self.background()
