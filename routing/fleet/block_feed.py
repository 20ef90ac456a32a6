"""A node's prefix-block feed: the one drainer of its engine's block events, read by cursors.

An engine that keeps a prefix cache (:class:`routing.engine.PrefixCacheEngine`) reports what
changed since its last drain; draining is destructive, so a node has exactly one
:class:`BlockFeed`, and every consumer (the Redis publisher, a gateway polling the node's
``/prefix/events``) follows it with its own cursor ``(epoch, seq)``.

Invariants:
- ``held`` is what the engine's cache holds as of the last :meth:`pump`: the engine's snapshot
  at start plus every drained batch applied in order.
- ``seq`` counts pumps that changed something; the log keeps the last ``max_log`` of them. A
  reader whose cursor is in the log gets the changes after it, merged (latest state per hash
  wins); a reader from another epoch (the node restarted) or from before the log gets the
  whole ``held`` set with ``full=True`` and must replace what it had.
- Applying pages in cursor order to an empty index gives exactly ``held``.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass

from routing.engine import PrefixCacheEngine


@dataclass(frozen=True, slots=True)
class BlockFeedPage:
    """What a reader must apply to catch up to cursor ``(epoch, seq)``.

    ``full``: ``stored`` is the node's whole index (replace, ``removed`` is empty); otherwise
    ``stored`` and ``removed`` are the (disjoint) changes since the reader's cursor.
    """

    epoch: str
    seq: int
    full: bool
    stored: list[int]
    removed: list[int]

    def to_json(self) -> dict[str, object]:
        return {
            "epoch": self.epoch,
            "seq": self.seq,
            "full": self.full,
            "stored": [f"{h:016x}" for h in self.stored],
            "removed": [f"{h:016x}" for h in self.removed],
        }

    @classmethod
    def from_json(cls, obj: dict[str, object]) -> BlockFeedPage:
        """Parse a page a node sent; raises ``ValueError``/``TypeError``/``KeyError`` if bad."""
        stored, removed = obj["stored"], obj["removed"]
        if not isinstance(stored, list) or not isinstance(removed, list):
            raise TypeError("stored and removed must be lists")
        seq = obj["seq"]
        if not isinstance(seq, int):
            raise TypeError("seq must be an integer")
        return cls(
            epoch=str(obj["epoch"]),
            seq=seq,
            full=bool(obj["full"]),
            stored=[int(h, 16) for h in stored],
            removed=[int(h, 16) for h in removed],
        )


class BlockFeed:
    """The node's block events as a log readers follow by cursor (see the module docstring)."""

    def __init__(self, engine: PrefixCacheEngine, max_log: int = 4096) -> None:
        self.engine = engine
        self.epoch = uuid.uuid4().hex[:16]
        self.seq = 0
        self.held: set[int] = set(engine.held_blocks())
        self._log: deque[tuple[int, dict[int, bool]]] = deque(maxlen=max_log)

    def pump(self) -> tuple[list[int], list[int]]:
        """Drain the engine's events into the log; returns this pump's (stored, removed)."""
        ev = self.engine.drain_block_events()
        if not ev:
            return [], []
        changes: dict[int, bool] = {}
        for h in ev.removed:
            changes[h] = False
            self.held.discard(h)
        for h in ev.stored:
            changes[h] = True
            self.held.add(h)
        self.seq += 1
        self._log.append((self.seq, changes))
        return list(ev.stored), list(ev.removed)

    def since(self, epoch: str | None, seq: int) -> BlockFeedPage:
        """Pump, then the page that brings a reader at ``(epoch, seq)`` up to date."""
        self.pump()
        oldest = self._log[0][0] if self._log else self.seq + 1
        if epoch != self.epoch or seq > self.seq or seq < oldest - 1:
            return BlockFeedPage(self.epoch, self.seq, True, sorted(self.held), [])
        merged: dict[int, bool] = {}
        for entry_seq, changes in self._log:
            if entry_seq > seq:
                merged.update(changes)
        return BlockFeedPage(
            self.epoch,
            self.seq,
            False,
            [h for h, s in merged.items() if s],
            [h for h, s in merged.items() if not s],
        )
