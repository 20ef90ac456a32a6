"""The office morning peak: N people in M regions, ramping up from 08:30 to a plateau at
09:00-09:30, then easing off; request classes chat, code and automation with shared prompts.

Classes (shares and sizes are knobs of :class:`MorningPeak`):
- ``chat``: one of a few chat apps, each with its own system prompt shared by all its users;
  a person's next chat within ``followup_window_s`` continues the conversation (its prompt is the
  previous prompt, the previous answer and a new message: a shared prefix on the node that
  served it);
- ``code``: long prompts over a shared repository context (one per team), long answers;
- ``automation``: short prompts from a shared template, short structured answers (a low cap).

Invariants:
- Deterministic for a seed (``random.Random`` only, never the global one).
- Arrivals are a non-homogeneous Poisson process (thinning) whose rate is ``people x
  per-person rate x shape(t)``; ``shape`` is ``base`` before 08:30, rises linearly to 1 at 09:00,
  stays 1 until 09:30 and falls linearly back to ``base`` at 10:00.
- Prompts are described as ``hash_ids`` of ``BLOCK``-token blocks: equal ids at one position mean
  the same prefix; every block not shared gets a fresh id.
- ``arrival_s`` counts from ``start_clock`` (default 08:00).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from routing.sim.trace import TraceRequest

BLOCK = 64


@dataclass(frozen=True, slots=True)
class ClassMix:
    """One request class: its share, prompt and answer sizes (lognormal medians) and cap."""

    share: float
    prompt_median: int
    prompt_sigma: float
    output_median: int
    output_sigma: float
    max_tokens: int
    shared_tokens: int  # the app's system prompt or the team's repository context


@dataclass(frozen=True)
class MorningPeak:
    people: int = 1000
    regions: Sequence[str] = ("eu-west", "eu-central", "eu-north")
    region_weights: Sequence[float] = (0.5, 0.3, 0.2)
    requests_per_person_per_hour: float = 20.0  # at the plateau
    base: float = 0.15  # shape before 08:30 and after 10:00
    start_clock: str = "08:00"
    duration_s: float = 7200.0
    apps: int = 3
    teams: int = 8
    followup_window_s: float = 600.0
    followup_p: float = 0.6
    classes: dict[str, ClassMix] = field(
        default_factory=lambda: {
            "chat": ClassMix(0.55, 120, 0.8, 150, 0.7, 512, 384),
            "code": ClassMix(0.15, 400, 0.7, 300, 0.6, 1024, 2048),
            "automation": ClassMix(0.30, 120, 0.5, 24, 0.5, 64, 256),
        }
    )


def _clock_s(text: str) -> float:
    h, m = text.split(":")
    return int(h) * 3600.0 + int(m) * 60.0


def shape(clock_s: float, base: float) -> float:
    """Relative load at a wall-clock time of day (seconds since midnight)."""
    a, b, c, d = _clock_s("08:30"), _clock_s("09:00"), _clock_s("09:30"), _clock_s("10:00")
    if clock_s <= a or clock_s >= d:
        return base
    if clock_s < b:
        return base + (1.0 - base) * (clock_s - a) / (b - a)
    if clock_s <= c:
        return 1.0
    return base + (1.0 - base) * (d - clock_s) / (d - c)


def _lognormal(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma)))))


@dataclass(slots=True)
class _Conversation:
    app: int
    ids: list[int]  # ids of the full blocks of the last prompt
    tokens: int  # last prompt + its answer
    at: float


def generate(spec: MorningPeak | None = None, seed: int = 0) -> list[TraceRequest]:
    """The trace, sorted by arrival."""
    spec = spec or MorningPeak()
    rng = random.Random(seed)
    next_id = [1_000_000]

    def fresh(n: int) -> list[int]:
        out = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return out

    app_ids = [[a * 10_000 + i for i in range(64)] for a in range(spec.apps)]
    team_ids = [[500_000 + t * 10_000 + i for i in range(256)] for t in range(spec.teams)]
    auto_ids = [[900_000 + a * 10_000 + i for i in range(64)] for a in range(spec.apps)]
    start = _clock_s(spec.start_clock)
    weights = list(spec.region_weights)[: len(spec.regions)]
    total_w = sum(weights)
    names = list(spec.classes)
    shares = [spec.classes[n].share for n in names]
    out: list[TraceRequest] = []
    convs: dict[tuple[str, int], _Conversation] = {}
    for ri, region in enumerate(spec.regions):
        people = max(1, round(spec.people * weights[ri] / total_w))
        lam_max = people * spec.requests_per_person_per_hour / 3600.0
        t = 0.0
        while True:
            t += rng.expovariate(lam_max)
            if t >= spec.duration_s:
                break
            if rng.random() > shape(start + t, spec.base):
                continue
            person = rng.randrange(people)
            cls = rng.choices(names, shares)[0]
            mix = spec.classes[cls]
            new = _lognormal(rng, mix.prompt_median, mix.prompt_sigma, 8 * mix.prompt_median)
            output = _lognormal(rng, mix.output_median, mix.output_sigma, mix.max_tokens)
            key = f"{cls}-{person % spec.apps}"
            if cls == "chat":
                conv = convs.get((region, person))
                if (
                    conv is not None
                    and t - conv.at <= spec.followup_window_s
                    and rng.random() < spec.followup_p
                ):
                    head, head_tokens = conv.ids, conv.tokens
                else:
                    app = rng.randrange(spec.apps)
                    n = mix.shared_tokens // BLOCK
                    head, head_tokens = app_ids[app][:n], n * BLOCK
                    conv = _Conversation(app, [], 0, t)
                key = f"chat-{conv.app}"
            elif cls == "code":
                team = (person + ri) % spec.teams
                n = mix.shared_tokens // BLOCK
                head, head_tokens = team_ids[team][:n], n * BLOCK
            else:
                app = person % spec.apps
                n = mix.shared_tokens // BLOCK
                head, head_tokens = auto_ids[app][:n], n * BLOCK
            prompt = head_tokens + new
            full = prompt // BLOCK
            ids = list(head[: min(len(head), full)])
            ids += fresh(math.ceil(prompt / BLOCK) - len(ids))
            if cls == "chat":
                convs[(region, person)] = _Conversation(conv.app, ids[:full], prompt + output, t)
            out.append(
                TraceRequest(
                    arrival_s=round(t, 6),
                    prompt_tokens=prompt,
                    output_tokens=output,
                    max_tokens=mix.max_tokens,
                    region=region,
                    api_key=key,
                    stream=cls != "automation",
                    kind=cls,
                    hash_ids=ids,
                    hash_block_tokens=BLOCK,
                )
            )
    out.sort(key=lambda r: r.arrival_s)
    return out
