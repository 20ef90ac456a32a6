"""The latency cost model of DESIGN.md, with rates learned online from every finished request.

For one node and one request::

    ttft = rtt(client region, node region) + queue wait (the step in flight, the requests
           ahead) + uncached prompt tokens / prefill rate
    e2e  = ttft + expected output tokens * decode ms per token at the batch it will run in

Invariants:
- Every rate the model uses is a blend of what it measured itself (EWMA per node over finished
  requests) and what the node reports about itself; configured per-kind defaults are used only
  while a node has neither. Measurements take over as samples accumulate (``warmup_samples``),
  but the node's self-report keeps ``self_report_weight`` so a sudden change on the node shows.
- A node with nothing measured and nothing reported borrows what its peers measured (nodes of
  the same kind, device and models: replicas of one deployment), before the kind's defaults:
  a fresh replica must not look slower than its busy twin, or it never gets the traffic that
  would measure it.
- Decode time scales with the batch and the context its rows attend to: a step of ``b`` rows
  over ``n`` tokens of context in all takes ``ms(1) * (1 + batch_slope * (b - 1)) + c * n``;
  rates are stored normalized to batch 1 and no context, so measurements at different batches
  and prompt lengths are comparable (``c`` is fitted once contexts spread, 0 until then).
- Predictions are finite and non-negative; a request never has fewer than one uncached token.
- Predicted-vs-measured error is recorded for every observation that carries a prediction.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from routing.backlog import (
    Arrivals,
    EngineShape,
    Replayed,
    SharedPrefix,
    Work,
    replay,
    replay_pair,
)
from routing.blocks import BLOCK_SIZE, reusable_blocks
from routing.fleet.state import NodeKind, NodeState, StepCost

Switch = Literal["off", "on", "accelerators"]


def on_cpu(node: NodeState) -> bool:
    """Whether the node computes on CPUs (its torch device or execution provider says so)."""
    return _cpu_device(node.device)


def _cpu_device(device: str) -> bool:
    return device.lower().startswith("cpu")


class KindDefaults(BaseModel):
    """What to assume about a node of one kind before it reports or is measured."""

    model_config = ConfigDict(extra="forbid")

    prefill_tokens_per_s: float = Field(gt=0)
    decode_ms_per_token: float = Field(gt=0, description="one sequence, batch 1")
    batch_slope: float = Field(
        ge=0, description="relative decode slowdown per extra sequence, until fitted"
    )
    prefill_chunk: int = Field(
        default=256, ge=1, description="prompt tokens per engine step, where the node says none"
    )
    mixed_steps: bool = Field(
        default=False,
        description="its engine runs a prompt's chunk and the decode rows as one step, so the "
        "first token comes after the decode rows' time too (the cloud engine)",
    )


class LatencyKnobs(BaseModel):
    """The cost model's knobs (one section of the policy YAML)."""

    model_config = ConfigDict(extra="forbid")

    rate_alpha: float = Field(default=0.2, gt=0, le=1, description="EWMA weight of a new sample")
    self_report_weight: float = Field(default=0.3, ge=0, le=1)
    warmup_samples: int = Field(default=3, ge=1)
    min_prefill_tokens: int = Field(default=32, ge=1, description="learn prefill above this")
    min_decode_tokens: int = Field(default=4, ge=2, description="learn decode above this")
    prefix_credit: float = Field(default=1.0, ge=0, le=1, description="trust in the index")
    error_alpha: float = Field(default=0.05, gt=0, le=1)
    cached_prefill_cost: bool = Field(
        default=True,
        description="fit the time a prompt's cached tokens still take (attention over them); "
        "off: a prefix hit costs only its new tokens",
    )
    node_step_cost: bool = Field(
        default=False,
        description="where a node reports the step cost its engine fitted on its own steps "
        "(NodeState.step_cost), replay its steps with that: a pass, each decode row, each "
        "prompt token and each token of context read, a prompt's chunk beside decode rows "
        "adding its tokens only (off: rates learned from finished requests; on the embedded "
        "default neither was better over six paired runs, docs/benchmarks.md)",
    )
    measured_decode_batch: bool = Field(
        default=True,
        description="learn a finished request's decode cost against the rows it decoded beside "
        "as this gateway saw them (its requests on the node over the request's decode, at most "
        "the node's slots; off: the mean batch its prediction expected, which misses the "
        "requests sent after it and so charges their rows to batch 1)",
    )
    prefill_pass: Switch = Field(
        default="accelerators",
        description="on a node whose steps mix prompt chunks with decode rows (the cloud "
        "engine), a chunk that runs alone pays a forward pass and one beside decode rows what "
        "it adds to their step, each the median of what the node's accounts of such prompts "
        "held beyond their tokens' cost (min_alone_samples; before, a one-row decode step less "
        "one token's compute, and nothing), no fixed cost fitted beside them, the rates learned "
        "without the passes (off: the per-token rate carries the pass, at least a one-row step "
        "a prompt). accelerators: on for nodes not on a CPU, where decode steps are CUDA graphs "
        "of 1-2 ms and a step with a prompt chunk an eager pass of 12-20 ms (on the GPU "
        "machine's H200 the concurrency-1 TTFT median error went from 0.52-0.69 to 0.16-0.34); "
        "on a CPU the one-row step is the pass, and on the embedded default it was no better: "
        "docs/benchmarks.md",
    )
    request_overhead: bool = Field(
        default=True,
        description="add what each node's requests take beyond its engine: the gateway's own "
        "share of their time to first token (its TTFT less the RTT less the node's own) and, "
        "on an idle node, the node's wait before its engine starts them (HTTP, tokenizing, "
        "handing over), both learned per node, and learn prefill from the node's compute "
        "alone (over one paired run on the GPU machine's H200 cloud it took the TTFT p90 from "
        "0.90-1.43 to 0.78-0.85; on the embedded default, over eight paired rounds on an "
        "Intel Xeon, 11 goal cells against 10, the concurrency-16 TTFT / e2e p90 0.47 / 0.46 "
        "against 0.59 / 0.54, the concurrency-4 e2e p90 0.53 against 0.48; off by default "
        "until 2026-12-05, when on an AMD EPYC it made the concurrency-1 TTFT median worse, "
        "0.16-0.32 against 0.10-0.15: docs/benchmarks.md)",
    )
    busy_wait: Switch = Field(
        default="accelerators",
        description="add what the node's own account of a request's wait (its time to first "
        "token less its prompt's compute) held beyond the replay's, on a node with requests in "
        "hand: the median of its last 31 by how many were in hand (1, 2-3, 4-7, 8-15, 16 or "
        "more): waits the replay does not see (on the GPU machine 14-40 ms of HTTP and "
        "tokenizing while the engine thread runs; with prefill_pass it took the concurrency-16 "
        "TTFT median error from 0.52-0.57 to 0.28-0.39). accelerators: on for nodes not on a CPU "
        "(on the embedded default no better: docs/benchmarks.md)",
    )

    min_alone_samples: int = Field(
        default=3,
        ge=1,
        description="prompts run alone before a node's own pass is used (prefill_pass; "
        "until then a one-row decode step less one token's compute)",
    )
    min_step_cost_steps: int = Field(
        default=24, ge=1, description="steps a node's step cost must be fitted over to be used"
    )
    overrun_left: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="share of its prefill work or decode steps a request in flight is taken to "
        "have left once it is late against its prediction (no first token, or not finished): "
        "how far along it is is not known; 0.5, the mean of a uniform guess; 0: as good as "
        "done, one decode step left (0 erred less over two paired runs once; as a shadow model "
        "over twelve rounds 0.5 erred less, and with in_hand_prefix off, routing by it over "
        "twelve paired rounds, every p90 was as good or better: docs/benchmarks.md)",
    )
    stream_progress: bool = Field(
        default=True,
        description="a stream in flight is as far along as the tokens the gateway has relayed "
        "of it (off: as its prediction and the clock say)",
    )
    future_arrivals: bool = Field(
        default=True,
        description="replay the requests this gateway is expected to send a node while one "
        "runs there (arrival_population, arrival_work, joining after its first token; with "
        "the node held at what it has in hand, newcomers at the median work and half the "
        "arrivals' weight, the default since 2026-12-04, on the embedded default, pooled over "
        "six rounds, the concurrency-4 e2e error went from 0.26 / 0.58 (median / p90) to "
        "0.16 / 0.50 and the concurrency-16 p90s from 0.56 / 0.56 to 0.67 / 0.66 (TTFT / e2e), "
        "the goal cells met from 8 to 9 of 12; on the GPU machine's H200, two runs, from 0 to "
        "3; off: the default before, docs/benchmarks.md)",
    )
    arrival_population: Literal[
        "recent_mean", "in_hand", "in_hand_or_mean", "in_slots", "gateway_share"
    ] = Field(
        default="in_hand",
        description="the population future_arrivals keeps a node at: its mean number of this "
        "gateway's requests over arrival_window_s, or what it holds at the decision with the "
        "new request (in_hand: a closed loop of clients replaces each request that finishes), "
        "or the larger of the two (in_hand_or_mean: a node momentarily emptier than usual "
        "fills again), or that at most its slots (in_slots: a queue is not refilled), or the gateway's "
        "requests in flight now times the node's share of their time lately (gateway_share: a "
        "closed loop refills the gateway, not each node); on the embedded default "
        "in_hand with median work took the decode's measured / predicted from 1.4-2.0 to "
        "0.8-1.1 and the concurrency-4 e2e median error from 0.22 to 0.16, but not the p90s; "
        "gateway_share with median work, pooled over three runs against four, took the "
        "concurrency-16 e2e error from 0.17 / 0.47 (median / p90) to 0.09 / 0.44 and the "
        "concurrency-4 p90 from 0.56 to 0.62 (docs/benchmarks.md)",
    )
    arrival_work: Literal["mean", "median", "rows"] = Field(
        default="median",
        description="each newcomer's prefill work, decode steps and context under "
        "future_arrivals: the mean or the median of the requests sent to the node lately (one "
        "long prompt moves the mean of a short-chat mix by hundreds of tokens), or the "
        "median's decode rows with one prompt token (rows: decode rates learned against the "
        "rows seen carry the newcomers' prompts already)",
    )
    arrival_weight: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="how much of what future_arrivals does to a request's decode the "
        "prediction takes: its decode time is the geometric blend, by this weight, of the "
        "replay's without arrivals (0) and with them (1); in full (1) they remove the "
        "decode's bias at concurrency 4 and 16 on the embedded default (measured / predicted "
        "1.56 to 1.04-1.10) but err wider where the next requests go elsewhere, and the p90s "
        "stayed; at 0.5 the concurrency-4 e2e p90 was met for the first time (0.50 over six "
        "rounds against 0.58 without arrivals; 0.60 in full over two: docs/benchmarks.md)",
    )
    arrival_window_s: float = Field(
        default=10.0,
        gt=0,
        description="the recent past (at most 30 s) a node's mean population and work are "
        "taken over (future_arrivals)",
    )
    in_hand_prefix: bool = Field(
        default=True,
        description="on a node with a prefix cache, a request whose leading blocks an earlier "
        "request in hand computes too is replayed computing only the rest when it takes a "
        "slot after that one's prefill (both engines hand a running request's written blocks "
        "to the next), or whenever it takes one on a node that catches up (the edge: "
        "NodeState.prefix_catch_up); off, each computes what the prefix index credited it at "
        "dispatch. Off "
        "in the sixteenth and seventeenth sessions (with the edge's compact slot order it "
        "erred more at concurrency 16); with the shared slot order, routing by it over eight "
        "paired rounds took the concurrency-16 TTFT p90 from 0.64 to 0.56 and the goal cells "
        "from 10 to 11: docs/benchmarks.md",
    )
    gateway_order: bool = Field(
        default=True,
        description="on a node that takes the gateway's order (NodeState.gateway_order: the "
        "edge), send each request its place in the node's queue (x-edgecloud-order-at: when "
        "it was sent), so the node admits and prefills in the order the replay assumes and "
        "never lets one request pass another by itself; a request whose prompt the node holds "
        "4+ blocks more of than waiting requests in hand is placed ahead of those with room "
        "for it (routing.passes, pass_room) and predicted there; off, the node orders its "
        "queue itself (by arrival, a prefix reuser passing ahead) and the replay assumes "
        "arrival order (on the embedded default, eight paired rounds pooled: concurrency-16 "
        "TTFT p90 0.46 against 0.78, 12 goal cells against 10, mean e2e there 10% more: "
        "docs/benchmarks.md)",
    )
    pass_room: float = Field(
        default=1.5,
        gt=1.0,
        description="gateway_order: a waiting request is passed only while what passes it "
        "adds to its wait (each passer's predicted time in a slot) stays within pass_room - 1 "
        "times its predicted time to first token",
    )
    slot_eviction: bool = Field(
        default=True,
        description="on a node whose prefix cache is what its slots keep (the edge), credit "
        "no prefix the index says it holds when this gateway has a slot's worth of requests "
        "in hand there without it, all sent after the last one with it left, and none with it "
        "(DispatchLedger.slots_taken_without): every slot then holds, or is about to, a "
        "prompt without it, so what kept it was overwritten, which the index hears only from "
        "the node's next events (a burst's short prompts took the edge's four slots in its "
        "first millisecond; its shared prompts, decided 30 ms later, were credited 1,136 "
        "cached tokens and computed all of them; as a shadow over twelve rounds it turned 4 "
        "misses into hits and 1 hit into a miss)",
    )
    service_output_tokens: float = Field(
        default=128.0, gt=0, description="assumed output of a request ahead in the queue"
    )
    edge: KindDefaults = Field(
        default=KindDefaults(
            prefill_tokens_per_s=400.0, decode_ms_per_token=30.0, batch_slope=0.6,
            prefill_chunk=256,
        ),
        description="an edge node's rates before it reports or is measured, where no peer "
        "(same kind, device and models) was",
    )  # fmt: skip
    cloud: KindDefaults = Field(
        default=KindDefaults(
            prefill_tokens_per_s=6000.0, decode_ms_per_token=20.0, batch_slope=0.03,
            prefill_chunk=1024, mixed_steps=True,
        ),
        description="a cloud node's on an accelerator, likewise",
    )  # fmt: skip
    cloud_cpu: KindDefaults = Field(
        default=KindDefaults(
            prefill_tokens_per_s=250.0, decode_ms_per_token=60.0, batch_slope=0.25,
            prefill_chunk=1024, mixed_steps=True,
        ),
        description="a cloud node's whose torch device is a CPU (the embedded default's), "
        "likewise: measured on the 2-core test machines, 130-270 prompt tokens/s and 55-95 ms "
        "a one-row decode step (the accelerator's figures made a first 560-token prompt there "
        "look 96 ms; it took 2.8 s)",
    )  # fmt: skip
    openai: KindDefaults = Field(
        default=KindDefaults(
            prefill_tokens_per_s=3000.0, decode_ms_per_token=25.0, batch_slope=0.0
        ),
        description="an OpenAI-compatible upstream's, likewise",
    )  # fmt: skip

    @field_validator("prefill_pass", "busy_wait", mode="before")
    @classmethod
    def _switch_from_bool(cls, value: object) -> object:
        """``true``/``false`` (what these knobs took before) mean on and off."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    def enabled(self, switch: Switch, node: NodeState) -> bool:
        """Whether a :data:`Switch` knob applies to ``node``."""
        return switch == "on" or (switch == "accelerators" and not on_cpu(node))

    def defaults(self, kind: NodeKind, device: str | None = None) -> KindDefaults:
        """What to assume of a node of ``kind`` (on ``device``, where known: a cloud node on a
        CPU takes ``cloud_cpu``)."""
        if kind == NodeKind.EDGE:
            return self.edge
        if kind == NodeKind.CLOUD:
            return self.cloud_cpu if device is not None and _cpu_device(device) else self.cloud
        return self.openai


def _blend_decode(without: Replayed, held: Replayed, weight: float) -> Replayed:
    """``held`` (the replay with future arrivals) with its decode ``weight`` of the way from
    ``without``'s, geometrically: arrivals join after the first token, which both share."""
    d0 = max(without.last_token_ms - without.first_token_ms, 0.0)
    d1 = max(held.last_token_ms - held.first_token_ms, 0.0)
    decode = d0 ** (1.0 - weight) * d1**weight if d0 > 0 and d1 > 0 else d1
    return replace(
        held,
        last_token_ms=held.first_token_ms + decode,
        mean_batch=(1.0 - weight) * without.mean_batch + weight * held.mean_batch,
        mean_context=(1.0 - weight) * without.mean_context + weight * held.mean_context,
    )


@dataclass(frozen=True, slots=True)
class Estimate:
    """One node's predicted timings for one request (all times in ms)."""

    node_id: str
    rtt_ms: float
    queue_ms: float
    prefill_ms: float
    ttft_ms: float
    decode_ms_per_token: float  # at ``batch``
    e2e_ms: float
    cached_tokens: int
    uncached_tokens: int
    batch: int  # sequences decoding alongside, itself included (mean_batch rounded)
    load: float  # occupancy (requests in hand, this one not counted) / slots
    own_prefill_ms: float = 0.0  # its own uncached tokens at the prefill rate
    in_hand: int = 0  # requests the node was taken to have ahead of this one
    mean_batch: float = 1.0  # mean rows of the decode steps it is predicted to take part in
    # its prefill as work at the node's per-token rate: the uncached tokens plus the cost of
    # attending to the cached ones (``LatencyModel.prefill_cost``), in token equivalents
    prefill_work_tokens: float = 0.0
    # one decode step's own time at ``mean_batch``; ``decode_ms_per_token`` beyond it is the
    # predicted stall per token (other requests' prefill chunks between its steps)
    step_ms: float = 0.0
    # the delay its prefill chunks add to the requests decoding beside it, summed over them
    stalled_others_ms: float = 0.0
    # mean tokens of context its decode steps are predicted to attend to (all rows, summed)
    mean_context: float = 0.0
    # the passes its own chunks were predicted to pay (in ``own_prefill_ms``), alone or beside
    # decode rows (``in_hand``): what a node's account of its prompt's compute holds beyond its
    # tokens' marginal cost
    pass_ms: float = 0.0
    passes: int = 0  # how many: its chunks, on a node of mixed steps (``prefill_pass``)
    # the wait added beyond the replay's (in ``queue_ms``), as the node's accounts taught
    extra_wait_ms: float = 0.0
    # what it takes beyond the engine (in ``ttft_ms`` and ``e2e_ms``): the gateway's share and,
    # on an idle node, the node's own before its engine starts it
    overhead_ms: float = 0.0
    # prefill work it was predicted to take from an earlier request's prefix (not in
    # ``prefill_work_tokens``, which it computes; see ``routing.backlog.SharedPrefix``)
    reused_tokens: float = 0.0
    # requests in hand it was placed ahead of on a node that takes the gateway's order
    # (``routing.passes``), and its time in a slot, which each of them waits more
    placed_ahead: int = 0
    slot_ms: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return self.cached_tokens + self.uncached_tokens


@dataclass(frozen=True, slots=True)
class Observation:
    """What the gateway measured about one finished request on one node.

    ``ttft_ms``/``e2e_ms`` are measured at the gateway (``ttft_ms`` is ``None`` when the reply
    was not streamed). ``net_rtt_ms`` is the gateway-to-node round trip included in them.
    ``node_queue_ms``, when the node reports it, replaces the predicted queue wait;
    ``node_ttft_ms`` is the node's own time to first token (from its request's arrival).
    """

    node_id: str
    kind: NodeKind
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    e2e_ms: float
    ttft_ms: float | None = None
    net_rtt_ms: float = 0.0
    node_queue_ms: float | None = None
    estimate: Estimate | None = None  # the prediction made for this node at decision time
    node_ttft_ms: float | None = None
    # the mean rows it decoded beside, itself included, as the gateway saw them (None: the
    # prediction's)
    decode_batch: float | None = None


@dataclass(slots=True)
class _Ewma:
    value: float = 0.0
    n: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.n == 0 else self.value + alpha * (x - self.value)
        self.n += 1


@dataclass(slots=True)
class _RecentMedian:
    """The median of the last ``window`` samples: what a small cost usually is, which a
    one-off (a gateway's first request fetching its tokenizer: seconds) does not move."""

    window: int = 31
    samples: deque[float] = field(default_factory=deque)
    n: int = 0

    def add(self, x: float) -> None:
        self.samples.append(x)
        if len(self.samples) > self.window:
            self.samples.popleft()
        self.n += 1

    @property
    def value(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0


@dataclass(frozen=True, slots=True)
class _Centered:
    """Weighted means, variances and covariances of samples ``(x, z, y)``."""

    mx: float
    mz: float
    my: float
    vx: float
    vz: float
    cxz: float
    cxy: float
    czy: float

    def plane(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` of ``y = a + b x + c z`` by least squares, None where x and z are
        collinear."""
        det = self.vx * self.vz - self.cxz * self.cxz
        if det <= 1e-9 * self.vx * self.vz:
            return None
        b = (self.cxy * self.vz - self.czy * self.cxz) / det
        c = (self.czy * self.vx - self.cxy * self.cxz) / det
        return self.my - b * self.mx - c * self.mz, b, c


@dataclass(slots=True)
class PlaneMoments:
    """The running moments of samples ``(x, z, y)``, each older sample's weight multiplied by
    ``decay`` per new one: what a least-squares fit of ``y`` on ``x`` and ``z`` needs."""

    decay: float = 0.97
    n: int = 0
    m: list[float] = field(default_factory=lambda: [0.0] * 9)  # w, x, z, xx, xz, zz, y, xy, zy

    def add(self, x: float, z: float, y: float) -> None:
        d = self.decay
        terms = (1.0, x, z, x * x, x * z, z * z, y, x * y, z * y)
        self.m = [d * a + t for a, t in zip(self.m, terms, strict=True)]
        self.n += 1

    def centered(self) -> _Centered | None:
        w, sx, sz, sxx, sxz, szz, sy, sxy, szy = self.m
        if w <= 0:
            return None
        mx, mz, my = sx / w, sz / w, sy / w
        return _Centered(
            mx, mz, my, sxx / w - mx * mx, szz / w - mz * mz,
            sxz / w - mx * mz, sxy / w - mx * my, szy / w - mz * my,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """A decode step's cost as :class:`DecodeFit` found it: ``b1_ms`` for one row of no
    context, ``per_row_ms`` for each further row, ``per_context_ms`` for each token of context
    over all rows; ``slope_fitted`` is False where the batch never spread and ``per_row_ms``
    is the assumed slope's."""

    b1_ms: float
    per_row_ms: float
    per_context_ms: float
    slope_fitted: bool


@dataclass(slots=True)
class DecodeFit:
    """Decode ms per token ``y = a + b * (batch - 1) + c * context`` by least squares over
    exponentially forgotten samples, ``context`` being the tokens a step's rows attend to.

    ``solve`` fits the terms whose regressor spread (``min_spread_batch`` rows,
    ``min_spread_context`` tokens, standard deviations) over at least ``min_samples``: both,
    or the batch line (``c = 0``), or the context line over samples of one batch size, which
    says nothing of the slope (the assumed one then normalizes the intercept to batch 1); a
    negative context cost is dropped (``c = 0``); None while neither spread.
    """

    min_samples: int = 6
    min_spread_batch: float = 0.5
    min_spread_context: float = 64.0
    moments: PlaneMoments = field(default_factory=PlaneMoments)

    def add(self, extra_rows: float, context: float, y: float) -> None:
        self.moments.add(extra_rows, context, y)

    def solve(self, assumed_slope: float) -> DecodeCost | None:
        s = self.moments.centered() if self.moments.n >= self.min_samples else None
        if s is None:
            return None
        x_ok, z_ok = s.vx >= self.min_spread_batch**2, s.vz >= self.min_spread_context**2
        plane = s.plane() if x_ok and z_ok else None
        if plane is not None and plane[2] >= 0:
            return DecodeCost(*plane, True)
        if x_ok:
            b = s.cxy / s.vx
            return DecodeCost(s.my - b * s.mx, b, 0.0, True)
        if z_ok:
            c = max(0.0, s.czy / s.vz)
            b1 = (s.my - c * s.mz) / (1.0 + assumed_slope * max(0.0, s.mx))
            return DecodeCost(b1, b1 * assumed_slope, c, False)
        return None


@dataclass(slots=True)
class PrefillFit:
    """A prompt's own time to first token ``y = a + b * uncached + c * cached`` by least
    squares over exponentially forgotten samples: new tokens cost ``b`` each, and each cached
    token they attend to (and the engine walks: block tables, KV gathers) ``c``.

    A fit whose fixed cost exceeds the cheapest prompt's whole time, or falls below minus that
    time, is an extrapolation of samples that do not pin it (prompts that all hit a prefix, or
    all miss; cached and uncached lengths that move together, whose plane gave -8.8 s plus 10 ms
    a new token on six such samples): it is not used. Nor is a plane that charges a cached token more than a
    new one (attending to a token's KV costs less than computing it).
    ``solve`` answers once the uncached lengths spread over ``min_samples``; the cached
    term joins only once the cached lengths spread too (``c = 0`` until then, and whenever the
    fit would make it negative), so a node that never hits a prefix is fitted as a line.
    """

    min_samples: int = 4
    min_spread: float = 24.0  # tokens (standard deviation), for each regressor
    moments: PlaneMoments = field(default_factory=PlaneMoments)
    min_y: float = math.inf  # the cheapest prompt seen: no fixed cost can exceed it

    def add(self, uncached: float, cached: float, y: float) -> None:
        self.min_y = min(self.min_y, y)
        self.moments.add(uncached, cached, y)

    def solve(self, cached_term: bool = True) -> tuple[float, float, float] | None:
        """``(a, b, c)`` or None while the samples do not pin the per-token cost down
        (``cached_term=False``: the line over the uncached lengths, ``c = 0``)."""
        s = self.moments.centered() if self.moments.n >= self.min_samples else None
        if s is None or s.vx < self.min_spread**2:
            return None
        plane = s.plane() if cached_term and s.vz >= self.min_spread**2 else None
        if plane is not None and 0 <= plane[2] <= plane[1] and self._pinned(plane[0]):
            return plane
        b = s.cxy / s.vx  # no usable cached term: the line over the uncached lengths
        if not self._pinned(s.my - b * s.mx):
            return None
        return s.my - b * s.mx, b, 0.0

    def fixed_at(self, ms_per_token: float) -> float:
        """The fixed cost that puts a line of slope ``ms_per_token`` through the samples' mean,
        within ``[0, the cheapest prompt's time]``: what the samples say of a prompt's fixed
        cost while their lengths do not spread enough to fit the slope too (a GPU node that
        only gets short prompts: 25 ms measured for 30 tokens at 0.27 ms a token). 0 before
        ``min_samples``."""
        s = self.moments.centered() if self.moments.n >= self.min_samples else None
        if s is None:
            return 0.0
        return min(max(0.0, s.my - ms_per_token * s.mx), self.min_y)

    def _pinned(self, fixed_ms: float) -> bool:
        """A fixed cost within the cheapest prompt's whole time, either side."""
        return -self.min_y <= fixed_ms <= self.min_y


@dataclass(slots=True)
class NodeRates:
    """What the model measured on one node (normalized to batch 1 for decode)."""

    prefill_tokens_per_s: _Ewma = field(default_factory=_Ewma)
    decode_ms_per_token_b1: _Ewma = field(default_factory=_Ewma)
    output_tokens: _Ewma = field(default_factory=_Ewma)
    decode_fit: DecodeFit = field(default_factory=DecodeFit)  # ms/token, batch and context
    prompt_tokens: _Ewma = field(default_factory=_Ewma)  # of the requests it served
    # the gateway's time to first token less the RTT less the node's own
    gateway_ms: _RecentMedian = field(default_factory=_RecentMedian)
    # the node's wait before its engine started a request it took with nothing in hand
    admission_ms: _RecentMedian = field(default_factory=_RecentMedian)
    # a prompt's own time to first token: fixed cost + per uncached token + per cached token
    prefill_fit: PrefillFit = field(default_factory=PrefillFit)
    # what a prompt that ran alone took beyond its tokens' predicted cost: the forward pass a
    # chunk pays with no decode row beside it (``prefill_pass``)
    alone_pass_ms: _RecentMedian = field(default_factory=_RecentMedian)
    # the same of a prompt whose chunks ran beside decode rows: what its chunk adds to their
    # step beyond its tokens (about 0 on a CPU; an eager pass where decode steps alone are
    # CUDA graphs)
    beside_pass_ms: _RecentMedian = field(default_factory=_RecentMedian)
    # the node's account of a request's wait less the replay's, by requests in hand (``busy_wait``)
    busy_wait_ms: dict[int, _RecentMedian] = field(default_factory=dict)


@dataclass(slots=True)
class ErrorStats:
    """Predicted-vs-measured error of one quantity: EWMAs of signed, absolute and relative error."""

    count: int = 0
    bias_ms: float = 0.0  # measured - predicted
    mean_abs_ms: float = 0.0
    mean_abs_rel: float = 0.0  # |error| / measured
    last_error_ms: float = 0.0

    def add(self, predicted: float, measured: float, alpha: float) -> None:
        err = measured - predicted
        rel = abs(err) / max(measured, 1.0)
        a = 1.0 if self.count == 0 else alpha
        self.bias_ms += a * (err - self.bias_ms)
        self.mean_abs_ms += a * (abs(err) - self.mean_abs_ms)
        self.mean_abs_rel += a * (rel - self.mean_abs_rel)
        self.last_error_ms = err
        self.count += 1


class PredictionErrors:
    """Error stats of TTFT and end-to-end predictions, overall and per tier."""

    def __init__(self) -> None:
        self.stats: dict[tuple[str, str], ErrorStats] = {}

    def add(self, metric: str, tier: str, predicted: float, measured: float, alpha: float) -> float:
        """Record one pair; returns the signed error (measured - predicted) in ms."""
        stats = self.stats
        for key in ((metric, "all"), (metric, tier)):
            s = stats.get(key)
            if s is None:
                s = stats[key] = ErrorStats()
            s.add(predicted, measured, alpha)
        return measured - predicted

    def get(self, metric: str, tier: str = "all") -> ErrorStats:
        return self.stats.get((metric, tier), ErrorStats())

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {
            f"{m}:{t}": {
                "count": s.count,
                "bias_ms": s.bias_ms,
                "mean_abs_ms": s.mean_abs_ms,
                "mean_abs_rel": s.mean_abs_rel,
            }
            for (m, t), s in sorted(self.stats.items())
        }


def _finite(x: float, fallback: float) -> float:
    return x if math.isfinite(x) and x > 0 else fallback


_NO_RATES = NodeRates()  # what a node never measured has (read only, never updated)


class LatencyModel:
    """Predicts per-node TTFT and end-to-end latency and learns each node's rates online."""

    def __init__(self, knobs: LatencyKnobs | None = None) -> None:
        self.knobs = knobs or LatencyKnobs()
        self.rates: dict[str, NodeRates] = {}
        self.errors = PredictionErrors()
        self._peer_group: dict[str, tuple[object, ...]] = {}  # node id -> its deployment
        self._groups: dict[tuple[object, ...], set[str]] = {}

    def configure(self, knobs: LatencyKnobs) -> None:
        """New knobs (hot reload); learned rates are kept."""
        self.knobs = knobs

    def forget(self, node_id: str) -> None:
        self.rates.pop(node_id, None)
        group = self._peer_group.pop(node_id, None)
        if group is not None:
            self._groups[group].discard(node_id)

    # ---- peers -------------------------------------------------------------------------------
    def _register(self, node: NodeState) -> tuple[object, ...]:
        """The node's deployment (kind, device, models), remembered for its peers."""
        group = self._peer_group.get(node.id)
        if group is None:
            group = (node.kind, node.device, tuple(sorted(node.models)))
            self._peer_group[node.id] = group
            self._groups.setdefault(group, set()).add(node.id)
        return group

    def _peers(self, node: NodeState) -> list[NodeRates]:
        """What the node's peers (same kind, device and models) measured."""
        self._register(node)
        return self._peer_rates(node.id)

    def _peer_ids(self, node: NodeState) -> set[str]:
        group = self._register(node)
        return self._groups.get(group, set()) - {node.id}

    def _peer_rates(self, node_id: str) -> list[NodeRates]:
        group = self._peer_group.get(node_id)
        members = self._groups.get(group, ()) if group is not None else ()
        return [r for i in members if i != node_id and (r := self.rates.get(i))]

    @staticmethod
    def _mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    # ---- rates -------------------------------------------------------------------------------
    def batch_factor(self, kind: NodeKind, batch: float, node_id: str | None = None) -> float:
        slope = self._slope(node_id, kind)
        return 1.0 + slope * max(0.0, batch - 1.0)

    def _assumed_slope(self, node_id: str | None, kind: NodeKind) -> float:
        """The default slope for the node's kind and, once the node was seen, its device."""
        group = self._peer_group.get(node_id) if node_id is not None else None
        device = str(group[1]) if group is not None else None
        return self.knobs.defaults(kind, device).batch_slope

    def _slope(self, node_id: str | None, kind: NodeKind) -> float:
        assumed = self._assumed_slope(node_id, kind)
        if node_id is not None:
            own = self.rates.get(node_id)
            for rates in [own, *self._peer_rates(node_id)]:  # its own fit, else a peer's
                fit = rates.decode_fit.solve(assumed) if rates is not None else None
                if fit is not None and fit.slope_fitted and fit.b1_ms > 0:
                    return min(max(fit.per_row_ms / fit.b1_ms, 0.0), 2.0)
        return assumed

    def _decode_cost(self, node_id: str, kind: NodeKind) -> DecodeCost | None:
        rates = self.rates.get(node_id)
        if rates is None:
            return None
        fit = rates.decode_fit.solve(self._assumed_slope(node_id, kind))
        return fit if fit is not None and fit.b1_ms > 0 else None

    def context_cost(self, node: NodeState) -> float:
        """Decode ms per token of context (summed over a step's rows): fitted on this node's
        requests once their contexts spread, else a peer's, else 0."""
        for node_id in [node.id, *sorted(self._peer_ids(node))]:
            fit = self._decode_cost(node_id, node.kind)
            if fit is not None and fit.per_context_ms > 0:
                return fit.per_context_ms
        return 0.0

    def _blend(self, measured: _Ewma, reported: float, default: float) -> float:
        k = self.knobs
        if measured.n == 0:
            return reported if reported > 0 else default
        if reported <= 0:
            return measured.value
        w = (1.0 - k.self_report_weight) * min(1.0, measured.n / k.warmup_samples)
        return w * measured.value + (1.0 - w) * reported

    def prefill_tokens_per_s(self, node: NodeState) -> float:
        rates = self.rates.get(node.id) or _NO_RATES
        default = self.knobs.defaults(node.kind, node.device).prefill_tokens_per_s
        if rates.prefill_tokens_per_s.n == 0 and node.prefill_tokens_per_s <= 0:
            peers = self._peers(node)
            default = (
                self._mean(
                    [r.prefill_tokens_per_s.value for r in peers if r.prefill_tokens_per_s.n]
                )
                or default
            )
        value = self._blend(rates.prefill_tokens_per_s, node.prefill_tokens_per_s, default)
        return _finite(value, default)

    def decode_ms_per_token_b1(self, node: NodeState) -> float:
        """Decode ms/token of one sequence at batch 1 (the node's report is normalized)."""
        self._register(node)  # its device: the batch slope it is assumed to have
        rates = self.rates.get(node.id) or _NO_RATES
        default = self.knobs.defaults(node.kind, node.device).decode_ms_per_token
        factor = self.batch_factor(node.kind, max(1, node.running), node.id)
        reported = node.decode_ms_per_token / factor
        measured = rates.decode_ms_per_token_b1
        fit = self._decode_cost(node.id, node.kind)
        if fit is not None:  # the fit's intercept is batch 1 itself
            measured = _Ewma(fit.b1_ms, measured.n)
        if measured.n == 0 and reported <= 0:
            peers = self._peers(node)
            default = (
                self._mean(
                    [r.decode_ms_per_token_b1.value for r in peers if r.decode_ms_per_token_b1.n]
                )
                or default
            )
        return _finite(self._blend(measured, reported, default), default)

    def mean_prompt_tokens(self, node_id: str) -> float:
        """Prompt tokens of a typical request on the node (0 until one is seen)."""
        rates = self.rates.get(node_id)
        return rates.prompt_tokens.value if rates is not None else 0.0

    def mean_output_tokens(self, node_id: str) -> float:
        rates = self.rates.get(node_id)
        if rates is None or rates.output_tokens.n == 0:
            return self.knobs.service_output_tokens
        return max(1.0, rates.output_tokens.value)

    # ---- prediction --------------------------------------------------------------------------
    def batch_slope(self, node: NodeState) -> float:
        """Relative decode slowdown per extra row: fitted on this node's observations once they
        span several batch sizes, else the default for its kind and device."""
        self._register(node)
        return self._slope(node.id, node.kind)

    @staticmethod
    def _load_bucket(in_hand: int) -> int:
        """1, 2-3, 4-7, 8-15, 16 or more in hand: buckets 1 to 5."""
        return min(5, max(1, in_hand).bit_length())

    def busy_wait_ms(self, node: NodeState, in_hand: int) -> float:
        """What the node's requests waited beyond the replay's prediction with ``in_hand``
        requests ahead, as learned (``busy_wait``; 0 until three were seen at that load, and
        on an idle node, whose wait is the admission of ``request_overhead``)."""
        rates = self.rates.get(node.id)
        if not self.knobs.enabled(self.knobs.busy_wait, node) or rates is None or in_hand <= 0:
            return 0.0
        seen = rates.busy_wait_ms.get(self._load_bucket(in_hand))
        return seen.value if seen is not None and seen.n >= 3 else 0.0

    def overhead_ms(self, node_id: str, idle: bool) -> float:
        """What a request on the node takes beyond its engine and the RTT, as learned: the
        gateway's share and, when the node has nothing in hand (``idle``), the node's own
        before its engine starts it (busy, that overlaps the step in flight). A node not yet
        measured is taken at the mean of those that are, so that measuring a node never makes
        it look dearer than an unknown one; 0 before any, and with ``request_overhead`` off."""
        if not self.knobs.request_overhead:
            return 0.0
        own = self.rates.get(node_id)

        def learned(part: Callable[[NodeRates], _RecentMedian]) -> float:
            if own is not None and part(own).n:
                return part(own).value
            seen = [part(r).value for r in self.rates.values() if part(r).n]
            return self._mean(seen)

        gateway = learned(lambda r: r.gateway_ms)
        return gateway + (learned(lambda r: r.admission_ms) if idle else 0.0)

    def step_cost(self, node: NodeState) -> StepCost | None:
        """The step cost the node fitted on its own steps, where it reports one fitted over
        enough steps and the knobs use it."""
        k, cost = self.knobs, node.step_cost
        if not k.node_step_cost or cost is None or cost.steps < k.min_step_cost_steps:
            return None
        return cost

    def prefill_cost(self, node: NodeState) -> tuple[float, float, float]:
        """(fixed ms, ms per uncached token, ms per cached token) of a prompt's own time to
        first token beyond its passes' own cost: the node's step cost where it reports one
        (no fixed cost, its prompt-token and context terms); else fitted on this node's
        requests once their lengths spread (the cached term once cached lengths spread too),
        else the blended rate with the fixed cost that puts it through those requests' mean
        (:meth:`PrefillFit.fixed_at`), and 0. With ``prefill_pass`` on a node of mixed steps
        the fixed cost is the pass's (:meth:`alone_pass_ms`): none of its own."""
        cost = self.step_cost(node)
        if cost is not None:
            return 0.0, cost.ms_per_prompt_token, cost.ms_per_context_token
        rates = self.rates.get(node.id)
        per_token = 1000.0 / self.prefill_tokens_per_s(node)
        if rates is None:
            return 0.0, per_token, 0.0
        k = self.knobs
        passes = k.enabled(k.prefill_pass, node) and k.defaults(node.kind, node.device).mixed_steps
        fit = rates.prefill_fit.solve(self.knobs.cached_prefill_cost)
        if fit is not None and fit[1] > 0:
            return 0.0 if passes else max(0.0, fit[0]), fit[1], fit[2]
        return 0.0 if passes else rates.prefill_fit.fixed_at(per_token), per_token, 0.0

    def alone_pass_ms(self, node_id: str, one_row_ms: float) -> float:
        """The pass a prompt's chunk pays with no decode row beside it: the median of what
        the node's prompts that ran alone took beyond their tokens' cost, once
        ``min_alone_samples`` of them were seen (an H200's eager prefill pass took 9-13 ms
        where its decode steps, CUDA graphs, took 2), else a one-row decode step less one
        token's compute (``one_row_ms``)."""
        rates = self.rates.get(node_id)
        if rates is not None and rates.alone_pass_ms.n >= self.knobs.min_alone_samples:
            return rates.alone_pass_ms.value
        return max(0.0, one_row_ms)

    def beside_pass_ms(self, node_id: str) -> float:
        """What a prompt's chunk adds to a step of decode rows beyond its tokens: the median of
        the node's accounts of its prompts that ran beside rows, once ``min_alone_samples`` of
        them were seen (an H200's: 12-20 ms, an eager step where rows alone take 1-2), else 0
        (the rows' step has the pass)."""
        rates = self.rates.get(node_id)
        if rates is not None and rates.beside_pass_ms.n >= self.knobs.min_alone_samples:
            return rates.beside_pass_ms.value
        return 0.0

    def shape(self, node: NodeState) -> EngineShape:
        """The node's engine as :func:`routing.backlog.replay` runs it."""
        kd = self.knobs.defaults(node.kind, node.device)
        self._register(node)
        fixed, per_token, per_cached = self.prefill_cost(node)
        chunk = node.prefill_chunk or kd.prefill_chunk
        cost = self.step_cost(node)
        if cost is not None:  # the node's own fit: a pass, then rows, tokens and context
            b1 = cost.pass_ms + cost.ms_per_row
            slope = cost.ms_per_row / b1 if b1 > 0 else 0.0
            beside_ms = 0.0
            per_context, pass_ms = cost.ms_per_context_token, cost.pass_ms
        else:
            b1, slope = self.decode_ms_per_token_b1(node), self.batch_slope(node)
            per_context, pass_ms, beside_ms = self.context_cost(node), 0.0, 0.0
            if kd.mixed_steps and self.knobs.enabled(self.knobs.prefill_pass, node):
                pass_ms = self.alone_pass_ms(node.id, b1 - per_token)
                beside_ms = self.beside_pass_ms(node.id)
        return EngineShape(
            slots=max(1, node.max_batch),
            chunk_tokens=chunk,
            chunk_tokens_decoding=(node.prefill_chunk_decoding or chunk) / node.prefill_chunk_every,
            prefill_ms_per_token=per_token,
            decode_step_ms_b1=b1,
            batch_slope=slope,
            prefill_fixed_ms=fixed,
            cached_token_ms=per_cached,
            mixed_steps=kd.mixed_steps,
            catch_up=node.prefix_catch_up,
            decode_ms_per_context_token=per_context,
            step_fixed_ms=pass_ms,
            chunk_beside_ms=beside_ms,
        )

    def estimate(
        self,
        node: NodeState,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        expected_output_tokens: float,
        rtt_ms: float,
        extra_inflight: int = 0,
        ahead: Sequence[Work] | None = None,
        arrivals: Arrivals | None = None,
        shared_prefix: SharedPrefix | None = None,
        position: int | None = None,
    ) -> Estimate:
        """Predict one request's timings on ``node``.

        ``cached_tokens`` is what the prefix index says the node holds (whole blocks, capped at
        ``(prompt_tokens - 1) // BLOCK_SIZE`` of them as the engines do, scaled by
        ``prefix_credit``). ``ahead`` is the work this gateway knows the node has in hand, in
        arrival order (``routing.router.DispatchLedger.work``); ``extra_inflight`` counts
        requests on the node that ``ahead`` does not describe (other gateways', or, without
        ``ahead``, everything beyond the node's own running and waiting counts): each is taken
        as half of a typical request's decoding. ``arrivals`` are the requests expected after
        this one (``DispatchLedger.arrivals``); they queue behind it. ``shared_prefix`` is the
        longest run of its leading blocks a request in ``ahead`` has too (its prompt tokens:
        ``DispatchLedger.shared_prefix``); with ``in_hand_prefix``, on a node with a prefix
        cache, those beyond the credit are cached if that request's prefill is done when this
        one takes a slot (``routing.backlog``). ``position`` places it among ``ahead`` on a
        node that takes the gateway's order (``routing.passes``; None: after all of it). On a
        node with work in hand the request first waits for the step in flight (half a decode
        step, on average).
        """
        k = self.knobs
        # whole blocks only, and at least one token computed: what the engines then report
        blocks = min(cached_tokens // BLOCK_SIZE, reusable_blocks(prompt_tokens))
        cached = int(blocks * k.prefix_credit) * BLOCK_SIZE
        uncached = max(1, prompt_tokens - cached)
        shape = self.shape(node)
        if ahead is None:
            unknown = node.running + node.waiting + max(0, extra_inflight)
            work: list[Work] = []
        else:
            unknown = max(0, extra_inflight)
            work = list(ahead)
        reuse = k.in_hand_prefix and node.prefix_cache
        if position is not None and (unknown or ahead is None):
            position = None  # placed among requests it knows, in front of none it does not
        shared = None
        if position is not None and shared_prefix is not None and shared_prefix.source >= position:
            shared_prefix = None  # the one writing it comes after it now
        if reuse and shared_prefix is not None and ahead is not None:
            beyond = shared_prefix.tokens - cached
            if beyond > 0:
                shared = SharedPrefix(shared_prefix.source + unknown, beyond)
        # what work in hand shares is counted from its index among what is replayed
        work = [
            w if w.shared is None
            else replace(w, shared=replace(w.shared, source=w.shared.source + unknown)
                         if reuse else None)
            for w in work
        ]  # fmt: skip
        if unknown:
            half = 0.5 * self.mean_output_tokens(node.id)
            typical = Work(0.0, half, context=self.mean_prompt_tokens(node.id) + half)
            work = [typical] * unknown + work
        out = max(1.0, expected_output_tokens)
        if node.kv_blocks_total > 0 and work:
            need = math.ceil((prompt_tokens + out) / BLOCK_SIZE) - cached // BLOCK_SIZE
            if need > node.kv_blocks_total - node.kv_blocks_used:
                # no room in the KV cache: it starts when a request in hand finishes
                shape = replace(shape, slots=min(shape.slots, len(work)))
        # the cached tokens' cost as prefill work of the same rate (what replay schedules)
        work_tokens = uncached + cached * shape.cached_token_ms / shape.prefill_ms_per_token
        if arrivals is not None and k.arrival_work == "rows":
            arrivals = Arrivals(arrivals.population, replace(arrivals.work, prefill_tokens=1.0))
        if arrivals is not None and k.arrival_population == "in_hand":
            arrivals = Arrivals(len(work) + 1, arrivals.work)
        elif arrivals is not None and k.arrival_population == "in_hand_or_mean":
            arrivals = Arrivals(max(len(work) + 1, arrivals.population), arrivals.work)
        elif arrivals is not None and k.arrival_population == "in_slots":
            arrivals = Arrivals(min(len(work) + 1, shape.slots), arrivals.work)
        new = Work(work_tokens, out - 1.0, context=prompt_tokens, shared=shared)
        if arrivals is not None and k.arrival_weight < 1.0:
            pair = replay_pair(shape, work, new, arrivals, position=position)
            r = _blend_decode(*pair, k.arrival_weight)
        else:
            r = replay(shape, work, new, arrivals=arrivals, position=position)
        work_tokens -= r.reused_tokens  # what it computes
        # its chunks pay the pass where they run alone (nothing in hand), else what a chunk
        # adds to the decode rows' step (nothing where that step has the pass already)
        chunks = math.ceil(work_tokens / max(1, shape.chunk_tokens))
        passes = (
            chunks
            if shape.mixed_steps
            and k.enabled(k.prefill_pass, node)
            and self.step_cost(node) is None
            else 0
        )
        pass_ms = (shape.chunk_beside_ms if work else shape.step_fixed_ms) * passes
        own_prefill = shape.prefill_fixed_ms + pass_ms + work_tokens * shape.prefill_ms_per_token
        # A prompt's last chunk is a forward pass: it reads every weight and the prompt's KV as
        # a decode step of one row does, however few its new tokens (a prefix hit's 16 new
        # tokens after 1,152 cached took the CPU cloud node 120-160 ms, predicted 17-19 ms
        # from its per-token rate): its own time is at least that step's.
        floor = shape.decode_step_ms(1, prompt_tokens)
        if own_prefill < floor and shape.step_fixed_ms <= 0:  # else the replay has the pass
            short = floor - (r.first_token_ms - r.queue_ms)
            if short > 0:
                r = replace(
                    r,
                    first_token_ms=r.first_token_ms + short,
                    last_token_ms=r.last_token_ms + short,
                )
            own_prefill = floor
        # a busy engine takes a new request in between steps: half the step in flight, on
        # average, before anything of the replay (100+ ms a step on a CPU cloud node)
        if work:
            rows = work[: shape.slots]
            in_flight = 0.5 * shape.decode_step_ms(len(rows), sum(w.context for w in rows))
            r = replace(
                r,
                queue_ms=r.queue_ms + in_flight,
                first_token_ms=r.first_token_ms + in_flight,
                last_token_ms=r.last_token_ms + in_flight,
            )
        extra_wait = max(self.busy_wait_ms(node, len(work)), -r.queue_ms)
        if extra_wait:
            r = replace(
                r,
                queue_ms=r.queue_ms + extra_wait,
                first_token_ms=r.first_token_ms + extra_wait,
                last_token_ms=r.last_token_ms + extra_wait,
            )
        overhead = self.overhead_ms(node.id, idle=not work)
        rtt = max(0.0, rtt_ms) + overhead
        steps = out - 1.0
        per_token = (r.last_token_ms - r.first_token_ms) / steps if steps > 0 else 0.0
        step_ms = shape.decode_step_ms(r.mean_batch, r.mean_context)
        if per_token <= 0:
            per_token = shape.decode_step_ms(max(1, round(r.mean_batch)), r.mean_context)
        return Estimate(
            node_id=node.id,
            rtt_ms=rtt_ms,
            queue_ms=r.queue_ms,
            prefill_ms=r.first_token_ms - r.queue_ms,
            ttft_ms=rtt + r.first_token_ms,
            decode_ms_per_token=per_token,
            e2e_ms=rtt + r.last_token_ms,
            cached_tokens=cached,
            uncached_tokens=uncached,
            batch=max(1, round(r.mean_batch)),
            load=len(work) / shape.slots,
            own_prefill_ms=own_prefill,
            mean_batch=r.mean_batch,
            in_hand=len(work),
            prefill_work_tokens=work_tokens,
            step_ms=step_ms,
            stalled_others_ms=r.stalled_others_ms,
            mean_context=r.mean_context,
            pass_ms=pass_ms,
            passes=passes,
            extra_wait_ms=extra_wait,
            overhead_ms=overhead,
            reused_tokens=r.reused_tokens,
            placed_ahead=max(0, len(work) - position) if position is not None else 0,
            slot_ms=max(0.0, r.last_token_ms - r.queue_ms),
        )

    # ---- learning ----------------------------------------------------------------------------
    def observe(self, obs: Observation) -> dict[str, float]:
        """Learn from one finished request; returns the prediction errors recorded (ms).

        Prefill is learned from the node's own account of the wait (``node_queue_ms``: its
        TTFT less the prompt's compute) when it gives one, whatever else ran; otherwise only
        from requests predicted to start at once with little else running (their TTFT is then
        mostly their own prefill). Decode ms/token is fitted against
        the mean batch the request was predicted to decode in and the mean context its steps
        were predicted to attend to, less the stall per token the prediction put between its
        steps (other requests' prefill chunks).
        """
        k = self.knobs
        rates = self.rates.get(obs.node_id)
        if rates is None:
            rates = self.rates[obs.node_id] = NodeRates()
        est = obs.estimate
        net = max(0.0, obs.net_rtt_ms)

        uncached = obs.prompt_tokens - obs.cached_tokens
        if obs.ttft_ms is not None and uncached >= 1:
            server_ms = obs.ttft_ms - net
            others = 0.0
            if est is not None:
                others = max(0.0, est.ttft_ms - est.rtt_ms - est.overhead_ms - est.own_prefill_ms)
                if est.in_hand > 0 and obs.node_queue_ms is not None:  # kept: busy_wait
                    replayed = others - est.extra_wait_ms  # the replay's own wait
                    waits = rates.busy_wait_ms.setdefault(
                        self._load_bucket(est.in_hand), _RecentMedian()
                    )
                    waits.add(obs.node_queue_ms - replayed)
            prefill_ms: float | None = None
            if obs.node_ttft_ms is not None and k.request_overhead:
                gateway_ms = max(0.0, server_ms - obs.node_ttft_ms)
                rates.gateway_ms.add(gateway_ms)
                server_ms -= gateway_ms  # the node's own from here
            idle = est is not None and est.in_hand == 0
            if obs.node_queue_ms is not None and k.request_overhead and idle:
                rates.admission_ms.add(obs.node_queue_ms)
            if obs.node_queue_ms is not None:  # the node's account: exact
                prefill_ms = max(server_ms - obs.node_queue_ms, 0.5)
            elif est is None or others <= 0.25 * max(server_ms, 1e-3):
                prefill_ms = max(server_ms - others, 0.25 * server_ms, 0.5)
            passes = est.passes if est is not None else 0  # counted where prefill_pass applies
            if passes and prefill_ms is not None and est is not None:
                # the node's account of the prompt: beyond its tokens' predicted cost, what it
                # took is its passes, alone or beside decode rows
                pass_of = rates.alone_pass_ms if est.in_hand == 0 else rates.beside_pass_ms
                if obs.node_queue_ms is not None:
                    tokens_ms = est.own_prefill_ms - est.pass_ms
                    pass_of.add(max(0.0, prefill_ms - tokens_ms) / passes)
                # the rates are the tokens' own: less the passes it paid (a tenth at least: a
                # pass taken too long must not teach that tokens are free), at the node's own
                # pass once learned (this prompt's included)
                paid = est.pass_ms
                if pass_of.n >= k.min_alone_samples:
                    paid = passes * pass_of.value
                prefill_ms = max(prefill_ms - paid, 0.1 * prefill_ms, 0.5)
            if prefill_ms is not None:
                rates.prefill_fit.add(float(uncached), float(obs.cached_tokens), prefill_ms)
                if uncached >= k.min_prefill_tokens:
                    rates.prefill_tokens_per_s.add(1000.0 * uncached / prefill_ms, k.rate_alpha)

        ttft_at_gateway = obs.ttft_ms
        if ttft_at_gateway is None and est is not None:
            ttft_at_gateway = est.ttft_ms - est.rtt_ms + net
        if ttft_at_gateway is not None and obs.completion_tokens >= k.min_decode_tokens:
            per_token = (obs.e2e_ms - ttft_at_gateway) / (obs.completion_tokens - 1)
            if est is not None and est.step_ms > 0:
                # the decode steps' own time: less the stall that was predicted between them
                stall = max(0.0, est.decode_ms_per_token - est.step_ms)
                per_token = max(per_token - stall, 0.3 * per_token)
            if per_token > 0:
                batch = est.mean_batch if est else 1.0
                context = est.mean_context if est else float(obs.prompt_tokens)
                if obs.decode_batch is not None and k.measured_decode_batch:
                    # the context its steps read grows with their rows
                    context *= obs.decode_batch / max(batch, 1.0)
                    batch = obs.decode_batch
                fit = self._decode_cost(obs.node_id, obs.kind)
                own = per_token - (fit.per_context_ms * context if fit is not None else 0.0)
                rates.decode_ms_per_token_b1.add(
                    max(own, 0.3 * per_token) / self.batch_factor(obs.kind, batch, obs.node_id),
                    k.rate_alpha,
                )
                rates.decode_fit.add(batch - 1.0, context, per_token)
        if obs.prompt_tokens > 0:
            rates.prompt_tokens.add(float(obs.prompt_tokens), k.rate_alpha)
        if obs.completion_tokens > 0:
            rates.output_tokens.add(float(obs.completion_tokens), k.rate_alpha)

        errors: dict[str, float] = {}
        if est is not None:
            tier = obs.kind.value
            # Compare like with like: the gateway measures the gateway-to-node RTT, not the
            # client's, so the prediction's RTT term is swapped for it.
            offset = net - est.rtt_ms
            if obs.ttft_ms is not None:
                errors["ttft"] = self.errors.add(
                    "ttft", tier, est.ttft_ms + offset, obs.ttft_ms, k.error_alpha
                )
            errors["e2e"] = self.errors.add(
                "e2e", tier, est.e2e_ms + offset, obs.e2e_ms, k.error_alpha
            )
        return errors

    def snapshot(self, nodes: Mapping[str, NodeState] | None = None) -> dict[str, dict[str, float]]:
        """Learned rates per node (and the blended ones when the node's state is given)."""
        out: dict[str, dict[str, float]] = {}
        for node_id, r in sorted(self.rates.items()):
            row = {
                "measured_prefill_tokens_per_s": r.prefill_tokens_per_s.value,
                "prefill_samples": float(r.prefill_tokens_per_s.n),
                "measured_decode_ms_per_token_b1": r.decode_ms_per_token_b1.value,
                "decode_samples": float(r.decode_ms_per_token_b1.n),
                "mean_output_tokens": r.output_tokens.value,
                "gateway_overhead_ms": r.gateway_ms.value,
                "node_admission_ms": r.admission_ms.value,
            }
            node = (nodes or {}).get(node_id)
            if node is not None:
                row["prefill_tokens_per_s"] = self.prefill_tokens_per_s(node)
                row["decode_ms_per_token_b1"] = self.decode_ms_per_token_b1(node)
                row["batch_slope"] = self.batch_slope(node)
                row["decode_ms_per_context_token"] = self.context_cost(node)
                fixed, per_token, per_cached = self.prefill_cost(node)
                row["prefill_fixed_ms"] = fixed
                row["prefill_ms_per_token"] = per_token
                row["prefill_ms_per_cached_token"] = per_cached
            out[node_id] = row
        return out
