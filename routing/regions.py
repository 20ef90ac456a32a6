"""Regions and the network round trip between them: a great-circle estimate, corrected by measurement.

Invariants:
- ``rtt_ms(a, b) == rtt_ms(b, a)``; it is always finite and positive.
- Precedence: a configured override for the pair, else the pair's measured EWMA, else the
  great-circle estimate scaled by the global correction learned from every measured pair.
- A region missing from the table gets ``unknown_rtt_ms`` to anything but itself.
- Pure: no I/O. The geoip lookup that names a client's region lives in ``gateway/``; it can use
  :meth:`RegionTable.nearest` to turn a latitude/longitude into a region name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from routing.ewma import Ewma

EARTH_RADIUS_KM = 6371.0
FIBER_KM_PER_MS = 200.0  # light in fibre, one way
ROUTE_FACTOR = 1.5  # real network paths over the great circle
BASE_MS = 2.0  # fixed cost added to every great-circle estimate
MEASUREMENT_ALPHA = 0.2  # EWMA weight of a measured RTT sample


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    lat: float
    lon: float


# Where the usual cloud regions are (nearest large city), so a config can name them without
# coordinates. A config may add regions or move these.
BUILTIN_REGIONS: dict[str, tuple[float, float]] = {
    "us-east": (38.9, -77.4),  # northern Virginia
    "us-east-2": (40.0, -83.0),  # Ohio
    "us-central": (41.3, -95.9),  # Iowa
    "us-west": (45.6, -121.2),  # Oregon
    "us-west-1": (37.4, -122.0),  # northern California
    "ca-central": (45.5, -73.6),  # Montreal
    "sa-east": (-23.5, -46.6),  # São Paulo
    "eu-west": (53.3, -6.3),  # Dublin
    "eu-west-2": (51.5, -0.1),  # London
    "eu-west-3": (48.9, 2.4),  # Paris
    "eu-central": (50.1, 8.7),  # Frankfurt
    "eu-north": (59.3, 18.1),  # Stockholm
    "eu-south": (45.5, 9.2),  # Milan
    "me-central": (25.2, 55.3),  # Dubai
    "af-south": (-33.9, 18.4),  # Cape Town
    "ap-south": (19.1, 72.9),  # Mumbai
    "ap-southeast": (1.35, 103.8),  # Singapore
    "ap-southeast-2": (-33.9, 151.2),  # Sydney
    "ap-northeast": (35.7, 139.7),  # Tokyo
    "ap-northeast-2": (37.6, 127.0),  # Seoul
    "ap-east": (22.3, 114.2),  # Hong Kong
}


class RttOverride(BaseModel):
    """A measured or contracted RTT for one pair of regions, used as is."""

    model_config = ConfigDict(extra="forbid")

    a: str
    b: str
    ms: float = Field(gt=0)


class RegionKnobs(BaseModel):
    """The region table's knobs (one section of the policy YAML)."""

    model_config = ConfigDict(extra="forbid")

    table: dict[str, tuple[float, float]] = Field(
        default_factory=dict, description="extra or moved regions: name -> [lat, lon]"
    )
    rtt_overrides: list[RttOverride] = Field(default_factory=list)
    intra_region_ms: float = Field(default=2.0, gt=0, description="RTT within one region")
    unknown_rtt_ms: float = Field(default=80.0, gt=0, description="RTT to an unknown region")


def great_circle_km(a: Region, b: Region) -> float:
    """Haversine distance between two points on the Earth, in km."""
    p1, p2 = math.radians(a.lat), math.radians(b.lat)
    dp, dl = p2 - p1, math.radians(b.lon - a.lon)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


class RegionTable:
    """Region coordinates plus RTT estimates that learn from measurements.

    Measurements survive :meth:`configure` (a hot-reloaded config changes knobs, not history).
    """

    def __init__(self, knobs: RegionKnobs | None = None) -> None:
        self._measured: dict[tuple[str, str], Ewma] = {}
        self._ratio = Ewma(MEASUREMENT_ALPHA)  # measured / estimated over every measurement
        self.configure(knobs or RegionKnobs())

    def configure(self, knobs: RegionKnobs) -> None:
        self.knobs = knobs
        coords = {**BUILTIN_REGIONS, **knobs.table}
        self.regions = {name: Region(name, lat, lon) for name, (lat, lon) in coords.items()}
        self._overrides = {_pair(o.a, o.b): o.ms for o in knobs.rtt_overrides}
        self._cache: dict[tuple[str, str], float] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.regions

    def names(self) -> list[str]:
        return sorted(self.regions)

    def estimate_ms(self, a: str, b: str) -> float:
        """The uncorrected great-circle estimate (``unknown_rtt_ms`` for unknown regions)."""
        k = self.knobs
        if a == b:
            return k.intra_region_ms
        ra, rb = self.regions.get(a), self.regions.get(b)
        if ra is None or rb is None:
            return k.unknown_rtt_ms
        km = great_circle_km(ra, rb) * ROUTE_FACTOR
        return max(k.intra_region_ms, 2.0 * km / FIBER_KM_PER_MS + BASE_MS)

    def rtt_ms(self, a: str, b: str) -> float:
        """Best RTT estimate between two regions, in ms (see the module's precedence rule)."""
        key = _pair(a, b)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if key in self._overrides:
            value = self._overrides[key]
        elif key in self._measured:
            value = self._measured[key].value
        else:
            est = self.estimate_ms(a, b)
            known = a == b or (a in self.regions and b in self.regions)
            value = est * self.correction if known else est
        self._cache[key] = value
        return value

    def observe(self, a: str, b: str, measured_ms: float) -> None:
        """Fold one measured RTT between two regions into the pair's EWMA and the global ratio."""
        if not (measured_ms > 0 and math.isfinite(measured_ms)):
            return
        self._measured.setdefault(_pair(a, b), Ewma(MEASUREMENT_ALPHA)).add(measured_ms)
        if a != b and a in self.regions and b in self.regions:
            self._ratio.add(min(3.0, max(1 / 3, measured_ms / self.estimate_ms(a, b))))
        self._cache.clear()

    @property
    def correction(self) -> float:
        """The global measured/estimated ratio applied to unmeasured pairs (1.0 until measured)."""
        return self._ratio.value if self._ratio.n else 1.0

    def measured(self) -> Mapping[tuple[str, str], float]:
        return {pair: e.value for pair, e in self._measured.items()}

    def nearest(self, lat: float, lon: float, among: Iterable[str] | None = None) -> str | None:
        """The region closest to a point (``None`` if the table is empty)."""
        here = Region("", lat, lon)
        names = list(among) if among is not None else list(self.regions)
        best: tuple[float, str] | None = None
        for name in names:
            r = self.regions.get(name)
            if r is not None:
                d = great_circle_km(here, r)
                if best is None or d < best[0]:
                    best = (d, name)
        return best[1] if best else None
