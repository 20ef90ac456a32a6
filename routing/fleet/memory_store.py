"""The in-process fleet store (one gateway, nodes from its config) and its building blocks.

- :class:`PrefixIndex`: block hashes per node, LRU-bounded; precise when fed a node's block
  events, approximate when fed the gateway's own routing decisions (``note_routed``).
- :class:`OpenAINodeTracker`: the inferred state of an external OpenAI-compatible server
  (kind ``openai``), from its configured limits and what the gateway observes.
- :class:`InProcessFleetStore`: polls each configured node's ``/load`` through an injected
  ``fetch_state(url)`` coroutine (the gateway supplies it with its HTTP client; routing stays
  free of HTTP libraries).

Invariants:
- ``view`` never performs I/O and returns only fresh states: a polled state is stamped with the
  time it was *received* (node clocks do not matter) and lives ``stale_after_s``.
- A node that has published block events is indexed precisely from then on: the gateway's own
  decisions no longer add guesses to it.
- Per node, the index holds at most ``max_blocks_per_node`` hashes; the least recently
  routed or stored are dropped first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from routing.fleet.state import NodeKind, NodeState
from routing.fleet.store import FleetStore, FleetView

log = logging.getLogger(__name__)

FetchState = Callable[[str], Awaitable[NodeState]]


class PrefixIndex:
    """Block hashes per node, each node's set an LRU of at most ``max_blocks_per_node``."""

    def __init__(self, max_blocks_per_node: int = 65_536) -> None:
        self.max_blocks_per_node = max_blocks_per_node
        self._nodes: dict[str, OrderedDict[int, None]] = {}

    def add(self, node_id: str, hashes: Iterable[int]) -> None:
        blocks = self._nodes.setdefault(node_id, OrderedDict())
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.max_blocks_per_node:
            blocks.popitem(last=False)

    def remove(self, node_id: str, hashes: Iterable[int]) -> None:
        blocks = self._nodes.get(node_id)
        if blocks is not None:
            for h in hashes:
                blocks.pop(h, None)

    def drop(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)

    def size(self, node_id: str) -> int:
        return len(self._nodes.get(node_id, ()))

    def leading(self, node_id: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, the node holds without a gap."""
        blocks = self._nodes.get(node_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n


class OpenAINodeConfig(BaseModel):
    """An external OpenAI-compatible server (vLLM, SGLang, a hosted API) fronted as a node."""

    model_config = ConfigDict(extra="forbid")

    id: str
    url: str
    region: str
    models: list[str] = Field(min_length=1)
    max_context: int = Field(default=8192, gt=0)
    max_concurrency: int = Field(default=32, gt=0, description="its batch, as far as we know")
    prefill_tokens_per_s: float = Field(default=0.0, ge=0, description="0: learn it")
    decode_ms_per_token: float = Field(default=0.0, ge=0, description="0: learn it")
    device: str = "external"
    ttl_s: float = Field(default=5.0, gt=0)


class OpenAINodeTracker:
    """Synthesizes an ``openai`` node's NodeState from config, in-flight count and latency seen.

    Observed rates are EWMAs over finished requests (``finished``); until there is one, the
    configured rates (possibly 0 = unknown) are reported.
    """

    def __init__(
        self, config: OpenAINodeConfig, alpha: float = 0.2, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config
        self.alpha = alpha
        self.clock = clock
        self.in_flight = 0
        self.completed = 0
        self.failed = 0
        self._prefill_tps: float | None = None
        self._decode_ms: float | None = None

    @property
    def id(self) -> str:
        return self.config.id

    def started(self) -> None:
        self.in_flight += 1

    def _ewma(self, prev: float | None, x: float) -> float:
        return x if prev is None else prev + self.alpha * (x - prev)

    def finished(
        self,
        *,
        ok: bool = True,
        ttft_ms: float | None = None,
        e2e_ms: float | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        if not ok:
            self.failed += 1
            return
        self.completed += 1
        if ttft_ms is not None and ttft_ms > 0 and prompt_tokens > 0:
            self._prefill_tps = self._ewma(self._prefill_tps, 1000.0 * prompt_tokens / ttft_ms)
        if (
            ttft_ms is not None
            and e2e_ms is not None
            and completion_tokens >= 2
            and e2e_ms > ttft_ms
        ):
            per_token = (e2e_ms - ttft_ms) / (completion_tokens - 1)
            self._decode_ms = self._ewma(self._decode_ms, per_token)

    def state(self) -> NodeState:
        c = self.config
        slots = c.max_concurrency
        return NodeState(
            id=c.id,
            kind=NodeKind.OPENAI,
            region=c.region,
            url=c.url,
            models=list(c.models),
            max_context=c.max_context,
            device=c.device,
            max_batch=slots,
            running=min(self.in_flight, slots),
            waiting=max(0, self.in_flight - slots),
            prefill_tokens_per_s=self._prefill_tps or c.prefill_tokens_per_s,
            decode_ms_per_token=self._decode_ms or c.decode_ms_per_token,
            timestamp=self.clock(),
            ttl_s=c.ttl_s,
        )


class InProcessFleetStore(FleetStore):
    """Nodes from the gateway's config, polled over ``/load``; an index from its own decisions."""

    def __init__(
        self,
        urls: Sequence[str] = (),
        *,
        fetch_state: FetchState | None = None,
        openai_nodes: Sequence[OpenAINodeTracker] = (),
        poll_interval_s: float = 1.0,
        fetch_timeout_s: float = 0.5,
        stale_after_s: float | None = None,
        max_blocks_per_node: int = 65_536,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if urls and fetch_state is None:
            raise ValueError("polling node urls needs a fetch_state(url) coroutine")
        self.urls = list(urls)
        self.fetch_state = fetch_state
        self.openai_nodes = {t.id: t for t in openai_nodes}
        self.poll_interval_s = poll_interval_s
        self.fetch_timeout_s = fetch_timeout_s
        self.stale_after_s = stale_after_s if stale_after_s is not None else 3 * poll_interval_s
        self.clock = clock
        self.index = PrefixIndex(max_blocks_per_node)
        self._precise: set[str] = set()
        self._states: dict[str, NodeState] = {}
        self.poll_errors: dict[str, str] = {}  # url -> last error, while it fails
        self._task: asyncio.Task[None] | None = None

    # ---- health (the in-process store has no external dependency) ---------------------------
    @property
    def healthy(self) -> bool:
        return True

    @property
    def last_error(self) -> str | None:
        return None

    def health(self) -> dict[str, object]:
        return {"backend": "memory", "healthy": True, "poll_errors": dict(self.poll_errors)}

    # ---- polling -----------------------------------------------------------------------------
    async def _poll_one(self, url: str) -> bool:
        assert self.fetch_state is not None
        try:
            state = await asyncio.wait_for(self.fetch_state(url), self.fetch_timeout_s)
        except Exception as exc:  # any failure just lets the node's last state go stale
            if url not in self.poll_errors:
                log.warning("polling %s/load failed: %s", url, exc)
            self.poll_errors[url] = f"{type(exc).__name__}: {exc}"
            return False
        self.poll_errors.pop(url, None)
        self._states[state.id] = state.model_copy(
            update={"timestamp": self.clock(), "ttl_s": self.stale_after_s}
        )
        return True

    async def poll_once(self) -> int:
        """Fetch every configured node's state once, concurrently; returns how many answered."""
        if not self.urls:
            return 0
        results = await asyncio.gather(*(self._poll_one(u) for u in self.urls))
        return sum(results)

    async def start(self) -> None:
        """Poll once now, then every ``poll_interval_s`` in the background until ``close``."""
        await self.poll_once()
        if self._task is None and self.urls:
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.poll_once()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ---- FleetStore --------------------------------------------------------------------------
    async def put_node(self, state: NodeState) -> None:
        self._states[state.id] = state

    async def remove_node(self, node_id: str) -> None:
        self._states.pop(node_id, None)
        self.index.drop(node_id)
        self._precise.discard(node_id)

    async def record_blocks(
        self, node_id: str, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        if node_id not in self._precise:
            self._precise.add(node_id)
            self.index.drop(node_id)  # forget our guesses: the node tells us now
        self.index.remove(node_id, removed)
        self.index.add(node_id, stored)

    def note_routed(self, node_id: str, block_hashes: Sequence[int]) -> None:
        """Remember that ``node_id`` was sent this prefix (it will likely hold it afterwards)."""
        if node_id not in self._precise and block_hashes:
            self.index.add(node_id, block_hashes)

    def nodes(self) -> list[NodeState]:
        now = self.clock()
        fresh = [s for s in self._states.values() if s.is_fresh(now)]
        fresh.extend(t.state() for t in self.openai_nodes.values())
        return fresh

    async def view(self, block_hashes: Sequence[int]) -> FleetView:
        nodes = self.nodes()
        prefix = {}
        if block_hashes:
            for n in nodes:
                count = self.index.leading(n.id, block_hashes)
                if count:
                    prefix[n.id] = count
        return FleetView(nodes=nodes, prefix_blocks=prefix, stale=False)
