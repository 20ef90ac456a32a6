"""Who may take one more of the fleet's slots: per-key and per-team concurrency limits, and
weighted fair shares by max-min water-filling (the rule; the counts live in
:mod:`gateway.fair_counts`, the waiting in :mod:`gateway.fair_queue`).

A *slot* is one request running on a node (the fleet has ``capacity`` of them: the sum of its
nodes' ``max_batch``, or a configured number). A request asks for one slot for its key.

Invariants (:func:`verdict`):
- A key never holds more than its ``max_concurrent``, nor its team more than the team's
  ``max_concurrent`` (``OWN_LIMIT``: the request waits in its key's queue, and asks for no
  fleet slot meanwhile).
- The fleet never holds more than ``capacity`` (``FLEET``).
- Shares are max-min fair (:func:`water_fill`): first among *units* (a team, or a key without
  one) by unit weight, then within a team among its keys by key weight; a unit or key
  demanding less than its weighted portion gets its demand and leaves the rest to the others.
  A key's demand is what it holds plus what it waits for (never above its own limit). A key
  takes one more slot only while it then holds no more than its share rounded up: so while
  another key waits, no key holds more than its fair share, and with nobody waiting a key may
  use every free slot (work-conserving).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_EPS = 1e-9


class Verdict(enum.IntEnum):
    """The answer to one request for a slot (the Redis script returns the same numbers)."""

    ADMIT = 0
    OWN_LIMIT = 1  # its key or team is at its concurrency limit
    FLEET = 2  # no free slot, or one more would put its key over its fair share


@dataclass(frozen=True, slots=True)
class Tenant:
    """A request's key as fair share sees it: ``weight`` and ``max_concurrent`` (None:
    unlimited) of the key and of its team (``team`` None: the key is its own unit)."""

    key: str
    weight: float = 1.0
    max_concurrent: int | None = None
    team: str | None = None
    team_weight: float = 1.0
    team_max_concurrent: int | None = None

    @property
    def unit(self) -> str:
        """The top-level unit of water-filling: ``team:<name>`` or ``key:<name>``."""
        return f"team:{self.team}" if self.team is not None else f"key:{self.key}"


@dataclass(slots=True)
class KeyCount:
    """One key's fleet-wide counts: slots held, requests waiting for a fleet slot."""

    held: int = 0
    waiting: int = 0
    weight: float = 1.0
    max_concurrent: int | None = None
    team: str | None = None
    team_weight: float = 1.0


@dataclass(slots=True)
class Snapshot:
    """Every active key's counts (held or waiting > 0), fleet-wide."""

    keys: dict[str, KeyCount] = field(default_factory=dict)

    @property
    def total_held(self) -> int:
        return sum(c.held for c in self.keys.values())

    def team_held(self, team: str) -> int:
        return sum(c.held for c in self.keys.values() if c.team == team)


def water_fill(units: Mapping[str, tuple[float, float]], capacity: float) -> dict[str, float]:
    """Max-min fair allocation of ``capacity`` among ``units`` (name -> (weight, demand)):
    each gets ``min(demand, its weighted portion of what is left)``, repeated until no unit
    demands less than its portion. Allocations sum to at most ``capacity``."""
    alloc: dict[str, float] = {}
    left = max(0.0, float(capacity))
    active = {u: wd for u, wd in units.items() if wd[1] > 0}
    for u in units:
        alloc[u] = 0.0
    while active:
        total_w = sum(max(w, _EPS) for w, _ in active.values())
        sated = {u: d for u, (w, d) in active.items() if d <= left * max(w, _EPS) / total_w + _EPS}
        if not sated:
            for u, (w, _) in active.items():
                alloc[u] = left * max(w, _EPS) / total_w
            break
        for u, d in sated.items():
            alloc[u] = d
            left -= d
            del active[u]
    return alloc


def _demand(c: KeyCount) -> float:
    d = c.held + c.waiting
    return float(min(d, c.max_concurrent) if c.max_concurrent is not None else d)


def key_shares(snap: Snapshot, capacity: int) -> dict[str, float]:
    """Every active key's fair share of ``capacity`` (see the module's invariants)."""
    units: dict[str, tuple[float, float]] = {}
    members: dict[str, list[str]] = {}
    for name, c in snap.keys.items():
        unit = f"team:{c.team}" if c.team is not None else f"key:{name}"
        members.setdefault(unit, []).append(name)
        w = c.team_weight if c.team is not None else c.weight
        prev = units.get(unit, (w, 0.0))
        units[unit] = (w, prev[1] + _demand(c))
    out: dict[str, float] = {}
    for unit, alloc in water_fill(units, capacity).items():
        names = members[unit]
        if len(names) == 1:
            out[names[0]] = alloc
            continue
        inner = {n: (snap.keys[n].weight, _demand(snap.keys[n])) for n in names}
        out.update(water_fill(inner, alloc))
    return out


def with_request(snap: Snapshot, t: Tenant, registered: bool) -> Snapshot:
    """``snap`` with the asking request counted as waiting (unless ``registered``: it is
    counted already) and ``t``'s weights and limits as the request states them."""
    keys = dict(snap.keys)
    old = keys.get(t.key) or KeyCount()
    keys[t.key] = KeyCount(
        held=old.held,
        waiting=old.waiting + (0 if registered else 1),
        weight=t.weight,
        max_concurrent=t.max_concurrent,
        team=t.team,
        team_weight=t.team_weight,
    )
    return Snapshot(keys)


def verdict(snap: Snapshot, t: Tenant, capacity: int, *, registered: bool = False) -> Verdict:
    """Whether ``t``'s request may take a slot now (see the module's invariants).
    ``registered``: the request is already counted in ``snap`` as waiting."""
    mine = snap.keys.get(t.key) or KeyCount()
    if t.max_concurrent is not None and mine.held >= t.max_concurrent:
        return Verdict.OWN_LIMIT
    if (
        t.team is not None
        and t.team_max_concurrent is not None
        and snap.team_held(t.team) >= t.team_max_concurrent
    ):
        return Verdict.OWN_LIMIT
    if snap.total_held >= capacity:
        return Verdict.FLEET
    share = key_shares(with_request(snap, t, registered), capacity)[t.key]
    if mine.held + 1 > math.ceil(share - _EPS):
        return Verdict.FLEET
    return Verdict.ADMIT


def allowed_slots(snap: Snapshot, t: Tenant, capacity: int, *, registered: bool = False) -> int:
    """How many slots ``t``'s key may hold at once now (its share, its limits): at least 1."""
    share = key_shares(with_request(snap, t, registered), capacity).get(t.key, 0.0)
    n = max(1, math.ceil(share - _EPS))
    for lim in (t.max_concurrent, t.team_max_concurrent if t.team is not None else None):
        if lim is not None:
            n = min(n, lim)
    return max(1, n)


def fair_order(snap: Snapshot, keys: Iterable[str]) -> list[str]:
    """``keys`` in the order their heads should try for a slot: fewest held slots per unit
    of weight first (the most under-served key first); ties by name."""

    def rank(k: str) -> tuple[float, str]:
        c = snap.keys.get(k) or KeyCount()
        return ((c.held + 1) / max(c.weight, _EPS), k)

    return sorted(keys, key=rank)
