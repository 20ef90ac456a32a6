"""The in-process fleet store (one gateway, nodes from its config) and its building blocks.

- :class:`PrefixIndex`: the block hashes each node reported holding, LRU-bounded.
- :class:`OpenAINodeTracker`: the inferred state of an external OpenAI-compatible server
  (kind ``openai``), from its configured limits and what the gateway observes.
- :class:`InProcessFleetStore`: polls each configured node's ``/load`` and, for nodes that keep
  a prefix cache, its ``/prefix/events`` feed (``routing.fleet.block_feed``), through injected
  ``fetch_state(url)`` and ``fetch_blocks(url, epoch, seq)`` coroutines (the gateway supplies
  them with its HTTP client; routing stays free of HTTP libraries).

Invariants:
- ``view`` never performs I/O of its own and returns only fresh states: a polled state is
  stamped with the time it was *received* (node clocks do not matter) and lives
  ``stale_after_s``. It waits (at most ``sync_wait_s``) for block syncs already under way, so a
  request that follows a finished one sees what that one left in the cache.
- A node is credited only with hashes it reported (``record_blocks``, ``replace_blocks``, or its
  feed): the same exactness as the Redis store. A node whose state says it keeps no prefix
  cache, and every ``openai`` node, is never credited.
- Per node, the index holds at most ``max_blocks_per_node`` hashes; the least recently stored
  are dropped first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from routing.choices import MAX_CHOICES
from routing.ewma import Ewma
from routing.fleet.block_feed import BlockFeedPage
from routing.fleet.state import Capability, NodeKind, NodeState
from routing.fleet.store import FleetStore, FleetView

log = logging.getLogger(__name__)

FetchState = Callable[[str], Awaitable[NodeState]]
FetchBlocks = Callable[[str, str | None, int], Awaitable[BlockFeedPage]]


class PrefixIndex:
    """Block hashes per node, each node's set an LRU of at most ``max_blocks_per_node``."""

    def __init__(self, max_blocks_per_node: int = 1 << 20) -> None:
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

    def replace(self, node_id: str, hashes: Iterable[int]) -> None:
        self._nodes.pop(node_id, None)
        self.add(node_id, hashes)

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
        self._prefill_tps = Ewma(self.alpha)
        self._decode_ms = Ewma(self.alpha)

    @property
    def id(self) -> str:
        return self.config.id

    def started(self) -> None:
        self.in_flight += 1

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
            self._prefill_tps.add(1000.0 * prompt_tokens / ttft_ms)
        if (
            ttft_ms is not None
            and e2e_ms is not None
            and completion_tokens >= 2
            and e2e_ms > ttft_ms
        ):
            per_token = (e2e_ms - ttft_ms) / (completion_tokens - 1)
            self._decode_ms.add(per_token)

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
            # the upstream is sent response_format, tools and the logprob fields as they are
            # (streams to it are never resumed, so resumed_tokens, ours, never reach it)
            capabilities=[Capability.GRAMMAR, *Capability.LOGPROB_KINDS],
            max_n=MAX_CHOICES,
            running=min(self.in_flight, slots),
            waiting=max(0, self.in_flight - slots),
            prefill_tokens_per_s=self._prefill_tps.value or c.prefill_tokens_per_s,
            decode_ms_per_token=self._decode_ms.value or c.decode_ms_per_token,
            timestamp=self.clock(),
            ttl_s=c.ttl_s,
        )


class InProcessFleetStore(FleetStore):
    """Nodes from the gateway's config, polled over ``/load``; their prefix caches over
    ``/prefix/events`` (see the module docstring)."""

    def __init__(
        self,
        urls: Sequence[str] = (),
        *,
        fetch_state: FetchState | None = None,
        fetch_blocks: FetchBlocks | None = None,
        openai_nodes: Sequence[OpenAINodeTracker] = (),
        poll_interval_s: float = 1.0,
        fetch_timeout_s: float = 1.0,
        stale_after_s: float | None = None,
        sync_wait_s: float = 0.05,
        max_blocks_per_node: int = 1 << 20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if urls and fetch_state is None:
            raise ValueError("polling node urls needs a fetch_state(url) coroutine")
        self.urls = list(urls)
        self.fetch_state = fetch_state
        self.fetch_blocks = fetch_blocks
        self.openai_nodes = {t.id: t for t in openai_nodes}
        self.poll_interval_s = poll_interval_s
        self.fetch_timeout_s = fetch_timeout_s
        # a node busy generating may answer /load late: three missed polls, and never under 5 s
        self.stale_after_s = (
            stale_after_s if stale_after_s is not None else max(3 * poll_interval_s, 5.0)
        )
        self.sync_wait_s = sync_wait_s
        self.clock = clock
        self.index = PrefixIndex(max_blocks_per_node)
        self._states: dict[str, NodeState] = {}
        self._cursors: dict[str, tuple[str | None, int]] = {}  # node id -> (epoch, seq)
        self._syncs: dict[str, asyncio.Task[None]] = {}  # node id -> block sync under way
        self._resync: set[str] = set()  # finished requests while a sync was under way
        self.poll_errors: dict[str, str] = {}  # url -> last error, while it fails
        self.block_sync_errors = 0
        self._task: asyncio.Task[None] | None = None

    # ---- health (the in-process store has no external dependency) ---------------------------
    @property
    def healthy(self) -> bool:
        return True

    @property
    def last_error(self) -> str | None:
        return None

    def health(self) -> dict[str, object]:
        return {
            "backend": "memory",
            "healthy": True,
            "poll_errors": dict(self.poll_errors),
            "block_sync_errors": self.block_sync_errors,
        }

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
        if state.prefix_cache:
            await self._sync_blocks(state.id)
        return True

    async def _sync_blocks(self, node_id: str) -> None:
        """Bring the node's index up to its feed's cursor (one request to the node)."""
        state = self._states.get(node_id)
        if state is None or self.fetch_blocks is None or not state.prefix_cache:
            return
        epoch, seq = self._cursors.get(node_id, (None, 0))
        try:
            page = await asyncio.wait_for(
                self.fetch_blocks(state.url, epoch, seq), self.fetch_timeout_s
            )
        except Exception as exc:  # the next poll retries from the same cursor
            self.block_sync_errors += 1
            log.debug("block sync of %s failed: %s", node_id, exc)
            return
        if page.full:
            self.index.replace(node_id, page.stored)
        else:
            self.index.remove(node_id, page.removed)
            self.index.add(node_id, page.stored)
        self._cursors[node_id] = (page.epoch, page.seq)

    def note_cache_changed(self, node_id: str) -> None:
        """Fetch the node's block events now (coalesced: one sync at a time per node)."""
        state = self._states.get(node_id)
        if state is None or not state.prefix_cache or self.fetch_blocks is None:
            return
        if node_id in self._syncs:
            self._resync.add(node_id)
            return
        self._syncs[node_id] = asyncio.get_running_loop().create_task(self._sync_loop(node_id))

    async def _sync_loop(self, node_id: str) -> None:
        try:
            while True:
                self._resync.discard(node_id)
                await self._sync_blocks(node_id)
                if node_id not in self._resync:
                    return
        finally:
            self._syncs.pop(node_id, None)

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
        tasks = [t for t in (self._task, *self._syncs.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._task = None

    # ---- FleetStore --------------------------------------------------------------------------
    async def put_node(self, state: NodeState) -> bool:
        self._states[state.id] = state
        return True

    async def remove_node(self, node_id: str) -> None:
        self._states.pop(node_id, None)
        self._cursors.pop(node_id, None)
        self.index.drop(node_id)

    async def record_blocks(
        self, node_id: str, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        self.index.remove(node_id, removed)
        self.index.add(node_id, stored)

    async def replace_blocks(self, node_id: str, held: Sequence[int]) -> None:
        self.index.replace(node_id, held)

    def nodes(self) -> list[NodeState]:
        now = self.clock()
        fresh = [s for s in self._states.values() if s.is_fresh(now)]
        fresh.extend(t.state() for t in self.openai_nodes.values())
        return fresh

    async def view(self, block_hashes: Sequence[int]) -> FleetView:
        if block_hashes and self._syncs:
            await asyncio.wait(list(self._syncs.values()), timeout=self.sync_wait_s)
        nodes = self.nodes()
        prefix = {}
        if block_hashes:
            for n in nodes:
                if n.kind == NodeKind.OPENAI:
                    continue
                count = self.index.leading(n.id, block_hashes)
                if count:
                    prefix[n.id] = count
        return FleetView(nodes=nodes, prefix_blocks=prefix, stale=False)
