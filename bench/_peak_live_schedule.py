"""The load schedule of ``bench/morning_peak_live.py``: which sub-windows of the morning-peak
trace are replayed, at which rate multiple, and the trace each level sends.

A level replays the requests of one sub-window of the trace (``window_minutes`` long) with their
arrival times divided by ``rate``: the same number of requests (on average) at every rate, in
``window_minutes / rate`` minutes. The first level's window is the ``--slice``; each further
level takes the next sub-window of the same length, wrapping inside the plateau (09:00-09:30,
where the trace's rate is constant), so no level resends a prompt another sent (unless the
levels together span more than the plateau).
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.sim.trace import TraceRequest

START_CLOCK_S = 8 * 3600.0  # the generator's arrival_s counts from 08:00
PLATEAU = ("09:00", "09:30")


def clock_s(text: str) -> float:
    """Seconds since 08:00 of a clock time ``HH:MM`` (or ``HH:MM:SS``)."""
    parts = [int(p) for p in text.split(":")]
    if len(parts) not in (2, 3):
        raise ValueError(f"not a clock time HH:MM: {text!r}")
    h, m, s = (*parts, 0)[:3]
    return h * 3600.0 + m * 60.0 + s - START_CLOCK_S


def parse_window(text: str) -> tuple[float, float]:
    """``09:10-09:12`` as (start, end) in seconds since 08:00."""
    a, _, b = text.partition("-")
    start, end = clock_s(a.strip()), clock_s(b.strip())
    if end <= start:
        raise ValueError(f"empty window: {text!r}")
    return start, end


def _clock(s: float) -> str:
    t = round(s + START_CLOCK_S)
    return f"{t // 3600:02d}:{t % 3600 // 60:02d}" + (f":{t % 60:02d}" if t % 60 else "")


@dataclass(frozen=True, slots=True)
class Level:
    """One load level: the trace's arrivals in ``[start_s, end_s)`` sent ``rate`` times faster."""

    rate: float
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        """How long the level's arrivals last (wall clock)."""
        return (self.end_s - self.start_s) / self.rate

    @property
    def label(self) -> str:
        return f"{self.rate:g}x {_clock(self.start_s)}-{_clock(self.end_s)}"


def schedule(first: str, rates: list[float], plateau: str = "-".join(PLATEAU)) -> list[Level]:
    """One level per rate: the first on the window ``first``, each next one on the following
    window of the same length, wrapping to the plateau's start past its end."""
    a, b = parse_window(first)
    p0, p1 = parse_window(plateau)
    span = b - a
    if span > p1 - p0:
        raise ValueError(f"window {first} is longer than the plateau {plateau}")
    out = []
    for rate in rates:
        if rate <= 0:
            raise ValueError(f"rate must be > 0: {rate}")
        if b > p1 + 1e-9:  # wrap inside the plateau
            a, b = p0, p0 + span
        out.append(Level(rate, a, b))
        a, b = b, b + span
    return out


def level_trace(trace: list[TraceRequest], level: Level, region: str) -> list[TraceRequest]:
    """The level's requests, arrivals from 0 divided by its rate, every client in ``region``."""
    return [
        r.model_copy(
            update={"arrival_s": (r.arrival_s - level.start_s) / level.rate, "region": region}
        )
        for r in trace
        if level.start_s <= r.arrival_s < level.end_s
    ]
