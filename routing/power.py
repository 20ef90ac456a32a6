"""A node's power: watts at idle and under load, and joules per finished request.

Where the node can read energy it does: RAPL counters under ``/sys/class/powercap`` (x86 Linux;
the package zones ``intel-rapl:N``, or ``amd-rapl:N`` where a kernel names them so; AMD Zen
CPUs usually appear as ``intel-rapl`` too). The counters cover the whole CPU package, not this
process, and most kernels let only root read them (``energy_uj`` is mode 0400): where none can
be read, the operator's figure (``--watts IDLE:LOAD``) is used instead, as::

    joules = idle x window + (load - idle) x seconds the node was busy in it

Joules per request is an EWMA over windows of at least ``window_s``: the energy of a window over
the requests that finished in it. A window in which no request finished is dropped (an idle
node's energy is no request's). Reporting only: routing does not use it.

Invariants: a counter that wrapped (read below its last value) adds ``max_energy_range_uj``;
figures are finite and non-negative; nothing here raises on an unreadable sysfs.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from routing.ewma import Ewma

POWERCAP = Path("/sys/class/powercap")
POWERCAP_ENV = "EDGECLOUD_POWERCAP"  # another powercap folder (a container's mount; "": none)
# top-level zones only: a package's subzones (core, uncore, dram) are counted inside it;
# intel-rapl-mmio:N is the same package read another way
_ZONE = re.compile(r"^(intel|amd)-rapl:\d+$")


@dataclass(frozen=True, slots=True)
class Watts:
    """An operator's power figures for the node's machine."""

    idle: float
    load: float


def parse_watts(text: str) -> Watts:
    """``IDLE:LOAD`` in watts, e.g. ``4.5:15``; load at least idle."""
    idle_s, sep, load_s = text.partition(":")
    try:
        idle, load = float(idle_s), float(load_s)
    except ValueError:
        idle = load = -1.0
    if not sep or not (0 <= idle <= load) or load == float("inf"):
        raise ValueError(f"{text!r} is not IDLE:LOAD in watts with 0 <= IDLE <= LOAD")
    return Watts(idle, load)


def estimated_joules(watts: Watts, seconds: float, busy_s: float) -> float:
    """Energy over ``seconds`` of which ``busy_s`` were busy, from configured figures."""
    busy = min(max(busy_s, 0.0), max(seconds, 0.0))
    return watts.idle * max(seconds, 0.0) + (watts.load - watts.idle) * busy


@dataclass(slots=True)
class _Zone:
    energy: Path
    range_uj: int
    last_uj: int


class RaplReader:
    """Cumulative joules of the machine's RAPL package zones since it was made."""

    def __init__(self, zones: list[_Zone]) -> None:
        self._zones = zones
        self.joules = 0.0

    @classmethod
    def find(cls, root: Path | None = None) -> RaplReader | None:
        """A reader over every readable package zone under ``root`` (default: $EDGECLOUD_POWERCAP,
        else /sys/class/powercap); None where there is none."""
        if root is None:
            env = os.environ.get(POWERCAP_ENV)
            if env == "":
                return None
            root = Path(env) if env else POWERCAP
        zones: list[_Zone] = []
        try:
            entries = sorted(root.iterdir()) if root.is_dir() else []
        except OSError:
            entries = []
        for d in entries:
            if not _ZONE.match(d.name):
                continue
            try:
                if (d / "name").is_file() and (d / "name").read_text().strip() == "psys":
                    continue  # the platform zone contains the packages: not summed with them
                now = int((d / "energy_uj").read_text())
                span = int((d / "max_energy_range_uj").read_text())
            except (OSError, ValueError):
                continue  # unreadable (root only) or not a counter
            zones.append(_Zone(d / "energy_uj", span, now))
        return cls(zones) if zones else None

    @property
    def zones(self) -> int:
        """How many package zones it sums."""
        return len(self._zones)

    def read(self) -> float:
        """Joules since this reader was made (each zone's wraparound undone)."""
        for z in self._zones:
            try:
                now = int(z.energy.read_text())
            except (OSError, ValueError):
                continue
            delta = now - z.last_uj
            if delta < 0:
                delta += z.range_uj
            z.last_uj = now
            self.joules += max(delta, 0) / 1e6
        return self.joules


class EnergyMeter:
    """A node's joules per finished request (an EWMA over windows), from RAPL where it can be
    read, else from configured watts and the share of the window the node was busy."""

    def __init__(
        self,
        watts: Watts | None,
        rapl: RaplReader | None,
        window_s: float = 1.0,
        alpha: float = 0.3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.watts = watts
        self.rapl = rapl
        self.window_s = window_s
        self.clock = clock
        self._jpr = Ewma(alpha)
        self._idle = Ewma(alpha)  # measured watts in windows with the node (nearly) idle
        self._load = Ewma(alpha)  # measured watts extrapolated to a fully busy window
        self._in_flight = 0
        self._busy_since = 0.0
        self._start = clock()
        self._busy_s = 0.0
        self._finished = 0
        self._joules0 = rapl.read() if rapl is not None else 0.0

    @property
    def source(self) -> str:
        """``rapl``, ``configured`` or ``""`` (nothing known)."""
        return "rapl" if self.rapl is not None else "configured" if self.watts else ""

    def started(self) -> None:
        """A request began running on the node."""
        if self._in_flight == 0:
            self._busy_since = self.clock()
        self._in_flight += 1

    def ended(self, finished: bool) -> None:
        """A request left the node; ``finished``: it ran to its end (not refused or aborted)."""
        self._in_flight -= 1
        if self._in_flight == 0:
            self._busy_s += self.clock() - self._busy_since
        if finished:
            self._finished += 1

    def sample(self) -> None:
        """Close the window if it is ``window_s`` old and a request finished in it."""
        now = self.clock()
        span = now - self._start
        if span < self.window_s or not self.source:
            return
        busy = self._busy_s + (now - self._busy_since if self._in_flight else 0.0)
        if self.rapl is not None:
            joules = self.rapl.read()
            energy = joules - self._joules0
            self._joules0 = joules
            self._learn_watts(energy / span, busy / span)
        else:
            assert self.watts is not None
            energy = estimated_joules(self.watts, span, busy)
        if self._finished:
            self._jpr.add(energy / self._finished)
        self._start, self._busy_s, self._finished = now, 0.0, 0
        if self._in_flight:
            self._busy_since = now

    def _learn_watts(self, watts: float, busy_share: float) -> None:
        if busy_share < 0.05:
            self._idle.add(watts)
        elif busy_share > 0.5 and self._idle.n:
            self._load.add(self._idle.value + (watts - self._idle.value) / busy_share)

    def fields(self) -> dict[str, float | str | None]:
        """NodeState's power fields: watts at idle and under load, joules per request."""
        idle = self.watts.idle if self.watts else None
        load = self.watts.load if self.watts else None
        if self.rapl is not None:  # measured figures, where measured, over configured ones
            idle = self._idle.value if self._idle.n else idle
            load = self._load.value if self._load.n else load
        return {
            "watts_idle": idle,
            "watts_load": load,
            "joules_per_request": self._jpr.value if self._jpr.n else None,
            "power_source": self.source,
        }
