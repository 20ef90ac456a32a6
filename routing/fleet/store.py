"""The fleet store interface: where node states and the prefix index live.

Two implementations: ``routing.fleet.redis_store.RedisFleetStore`` (many gateways, nodes
register themselves and push their block events) and
``routing.fleet.memory_store.InProcessFleetStore`` (one gateway, nodes from its config, polled
over ``/load`` and ``/prefix/events``). Both index exactly what the nodes report holding
(``routing.fleet.block_feed``): a node that keeps no prefix cache is never credited.

Redis key layout (all under ``edgecloud:v1:``; ``{node_id}`` is a Redis Cluster hash tag,
:func:`routing.redis_connect.hash_tag`, so a node's keys share one slot and the nodes spread
over the cluster's slots):
- ``node:{node_id}``: the NodeState as JSON, with a TTL of ``state.ttl_s``.
- ``blocks:{node_id}``: set of the block hashes (hex) the node holds (from stored/removed events).
- ``events:{node_id}``: stream of raw block events (capped), for observers.
- ``nodes``: sorted set node_id -> last push time (stale members are pruned by writers).
- ``epoch``: the fleet's epoch (a random id; see ``routing.fleet.redis_store``).
- ``node:<node_id>`` (no hash tag; not on a cluster): the same state, still written for
  gateways of releases before the hash tags, for one release (see docs/deploy.md).
``nodes`` and ``epoch`` are the only keys every node shares: nodes write them once per state
push, and on a cluster gateways read them at most every ``members_refresh_s``, not per request.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from routing.fleet.state import NodeState

KEY_PREFIX = "edgecloud:v1:"


@dataclass(frozen=True, slots=True)
class FleetView:
    """One consistent read for one routing decision.

    ``prefix_blocks[node_id]`` is the number of *leading* blocks of the request's prefix that
    the node holds (0 if none). ``others_in_flight[node_id]``: rows the other workers sharing
    this gateway's in-flight board have in flight on the node now
    (:mod:`routing.fleet.inflight`; empty without one).
    """

    nodes: list[NodeState]
    prefix_blocks: dict[str, int]
    stale: bool = False  # True when the store was unreachable and this is the last known view
    others_in_flight: Mapping[str, int] = field(default_factory=dict)


class FleetStore(abc.ABC):
    @abc.abstractmethod
    async def put_node(self, state: NodeState) -> bool:
        """Publish a node's state (with its TTL). Returns whether the store still holds the
        node's prefix index; False (it restarted empty) asks the node for ``replace_blocks``."""

    @abc.abstractmethod
    async def remove_node(self, node_id: str) -> None:
        """Forget a node and its prefix blocks (called on clean shutdown)."""

    @abc.abstractmethod
    async def record_blocks(
        self, node_id: str, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        """Apply a node's block events to the prefix index."""

    @abc.abstractmethod
    async def replace_blocks(self, node_id: str, held: Sequence[int]) -> None:
        """Replace the node's whole prefix index with ``held`` (a snapshot of its cache)."""

    def note_cache_changed(self, node_id: str) -> None:  # noqa: B027 - optional hook
        """A request on ``node_id`` passed its prefill or finished: block events it caused may
        be waiting on the node (stores that poll nodes fetch them now)."""

    @abc.abstractmethod
    async def view(self, block_hashes: Sequence[int]) -> FleetView:
        """Fresh node states and per-node leading prefix matches, in one round trip."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
