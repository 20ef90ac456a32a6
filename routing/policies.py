"""Routing policies: each orders the eligible candidates and explains its choice as a Decision.

Invariants:
- A policy sees only eligible candidates (the router has filtered out nodes that do not serve
  the model, cannot fit the request, are stale or have an open circuit) and every candidate
  carries its latency estimate, so every Decision reports predicted TTFT/e2e whatever the policy.
- ``Decision.fallbacks`` holds every other candidate, in the order to retry them; the chosen
  node is never among them.
- Policies are deterministic given their inputs (ties break on node id), except ``round_robin``,
  whose only state is its counter.
- ``latency`` hard-codes no prompt-length rule: short requests land on the edge only when the
  estimates say the edge finishes them sooner.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from routing.fleet.state import NodeKind, NodeState
from routing.latency import Estimate
from routing.policy_config import PolicyConfig
from routing.profile import RequestProfile


class NoRoute(LookupError):
    """No node can take the request. ``reasons`` maps node id to why it was left out.

    ``code`` is ``unknown_model`` (no node serves it), ``too_long`` (no node that serves it has
    the context), ``unsupported`` (none that serves it lists what it needs: ``param`` names
    the request field, e.g. ``response_format``, ``logprobs`` or ``n``), or ``unavailable``
    (they exist but are down, open or excluded by the policy).
    """

    def __init__(
        self,
        code: str,
        message: str,
        reasons: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reasons = reasons or {}
        self.param = param


@dataclass(frozen=True, slots=True)
class Candidate:
    node: NodeState
    estimate: Estimate

    @property
    def node_id(self) -> str:
        return self.node.id

    @property
    def tier(self) -> NodeKind:
        return self.node.kind

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "node": self.node.id,
            "tier": self.node.kind.value,
            "region": self.node.region,
            "url": self.node.url,
            "predicted_ttft_ms": round(e.ttft_ms, 2),
            "predicted_e2e_ms": round(e.e2e_ms, 2),
            "rtt_ms": round(e.rtt_ms, 2),
            "overhead_ms": round(e.overhead_ms, 2),
            "queue_ms": round(e.queue_ms, 2),
            "prefill_ms": round(e.prefill_ms, 2),
            "decode_ms_per_token": round(e.decode_ms_per_token, 3),
            "cached_tokens": e.cached_tokens,
            "uncached_tokens": e.uncached_tokens,
            "prefill_tokens_per_s": round(1000.0 * e.uncached_tokens / e.prefill_ms, 1)
            if e.prefill_ms > 0
            else None,
            "batch": e.batch,
            "in_hand": e.in_hand,
            "load": round(e.load, 3),
            "stalled_others_ms": round(e.stalled_others_ms, 2),
        }


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes, why, and what is predicted for it."""

    node: NodeState
    estimate: Estimate
    policy: str
    reason: str  # short, machine-readable (a metrics label)
    why: str  # the policy's rule, in words (``detail`` adds the numbers)
    fallbacks: tuple[Candidate, ...] = ()
    stale_view: bool = False
    expected_output_tokens: float = 0.0
    prompt_tokens: int = 0

    @property
    def node_id(self) -> str:
        return self.node.id

    @property
    def url(self) -> str:
        return self.node.url

    @property
    def tier(self) -> NodeKind:
        return self.node.kind

    @property
    def predicted_ttft_ms(self) -> float:
        return self.estimate.ttft_ms

    @property
    def predicted_e2e_ms(self) -> float:
        return self.estimate.e2e_ms

    @property
    def cached_tokens(self) -> int:
        return self.estimate.cached_tokens

    @property
    def detail(self) -> str:
        """One human sentence with the numbers behind the choice (built only when asked)."""
        text = f"{self.why}; chose {_describe(self.chosen)}"
        if self.fallbacks:
            text += f"; next {_describe(self.fallbacks[0])}"
        if self.stale_view:
            text += "; fleet view is stale (store unreachable)"
        return text

    @property
    def chosen(self) -> Candidate:
        return Candidate(self.node, self.estimate)

    def candidates(self) -> list[Candidate]:
        """The chosen node first, then the fallbacks: the order to try them in."""
        return [self.chosen, *self.fallbacks]

    def headers(self) -> dict[str, str]:
        """The decision's ``x-edgecloud-*`` response headers (the gateway adds measured ones)."""
        return {
            "x-edgecloud-node": self.node.id,
            "x-edgecloud-tier": self.node.kind.value,
            "x-edgecloud-reason": self.reason,
            "x-edgecloud-predicted-ttft-ms": f"{self.estimate.ttft_ms:.1f}",
            "x-edgecloud-predicted-e2e-ms": f"{self.estimate.e2e_ms:.1f}",
            "x-edgecloud-predicted-queue-ms": f"{self.estimate.queue_ms:.1f}",
            "x-edgecloud-predicted-prefill-ms": f"{self.estimate.own_prefill_ms:.1f}",
            "x-edgecloud-in-hand": str(self.estimate.in_hand),
            "x-edgecloud-expected-output-tokens": f"{self.expected_output_tokens:.1f}",
            "x-edgecloud-cached-tokens": str(self.estimate.cached_tokens),
            "x-edgecloud-credited-tokens": str(self.estimate.cached_tokens),
        }

    def to_dict(self) -> dict[str, Any]:
        """The JSON answer of ``POST /v1/route``."""
        return {
            "node": self.node.id,
            "tier": self.node.kind.value,
            "url": self.node.url,
            "policy": self.policy,
            "reason": self.reason,
            "detail": self.detail,
            "predicted_ttft_ms": round(self.estimate.ttft_ms, 2),
            "predicted_e2e_ms": round(self.estimate.e2e_ms, 2),
            "cached_tokens": self.estimate.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "expected_output_tokens": round(self.expected_output_tokens, 1),
            "stale_view": self.stale_view,
            "candidates": [c.to_dict() for c in self.candidates()],
        }


@dataclass(frozen=True, slots=True)
class PolicyInput:
    """What a policy decides from."""

    profile: RequestProfile
    candidates: Sequence[Candidate]  # non-empty, eligible, sorted by node id
    config: PolicyConfig
    stale_view: bool = False


class Policy(Protocol):
    name: str

    def decide(self, inp: PolicyInput) -> Decision: ...


# ---- helpers -----------------------------------------------------------------------------------
def _by_e2e(c: Candidate) -> tuple[float, float, str]:
    return (c.estimate.e2e_ms, c.estimate.ttft_ms, c.node.id)


def _by_ttft(c: Candidate) -> tuple[float, float, str]:
    return (c.estimate.ttft_ms, c.estimate.e2e_ms, c.node.id)


def _is_cloud(c: Candidate) -> bool:
    return c.node.kind in (NodeKind.CLOUD, NodeKind.OPENAI)


def _describe(c: Candidate) -> str:
    e = c.estimate
    return (
        f"{c.node.id} ({c.node.kind.value}, {c.node.region}): ttft {e.ttft_ms:.0f} ms "
        f"= rtt {e.rtt_ms:.0f} + queue {e.queue_ms:.0f} + prefill {e.prefill_ms:.0f} "
        + (f"+ overhead {e.overhead_ms:.0f} " if e.overhead_ms > 0 else "")
        + f"({e.uncached_tokens} uncached, {e.cached_tokens} cached tokens); "
        f"e2e {e.e2e_ms:.0f} ms at {e.decode_ms_per_token:.1f} ms/token, batch {e.batch}"
        + (f"; holds up others {e.stalled_others_ms:.0f} ms" if e.stalled_others_ms > 0 else "")
        + (
            f"; {e.reused_tokens:.0f} tokens of prefill taken from a request in hand"
            if e.reused_tokens > 0
            else ""
        )
    )


def _decision(
    name: str, inp: PolicyInput, ordered: Sequence[Candidate], reason: str, why: str
) -> Decision:
    first = ordered[0]
    return Decision(
        node=first.node,
        estimate=first.estimate,
        policy=name,
        reason=reason,
        why=why,
        fallbacks=tuple(ordered[1:]),
        stale_view=inp.stale_view,
        expected_output_tokens=inp.profile.expected_output_on(first.node.kind),
        prompt_tokens=inp.profile.prompt_tokens,
    )


# ---- policies ----------------------------------------------------------------------------------
STREAM_E2E_BOUND = 2.0
"""Under ``objective: auto`` a stream goes to no node whose predicted e2e exceeds this many
times the least predicted e2e among the candidates (it may come last among the fallbacks)."""


@dataclass
class LatencyPolicy:
    """Least predicted end-to-end time; for streams under ``objective: auto``, the least
    predicted TTFT among the nodes predicted to finish within ``STREAM_E2E_BOUND`` times the
    soonest (a first token a little sooner never buys an answer that ends far later); plus
    ``interference_weight`` times the delay the request's prefill would add to the requests
    decoding on the node: greedy for each request alone, a long prompt would land where its
    own prefill is fastest and stall every answer streaming there."""

    name: str = "latency"

    def decide(self, inp: PolicyInput) -> Decision:
        objective = inp.config.objective
        guard = objective == "auto" and inp.profile.stream
        if objective == "auto":
            objective = "ttft" if inp.profile.stream else "e2e"
        w = inp.config.interference_weight

        def key(c: Candidate, by=_by_ttft if objective == "ttft" else _by_e2e):
            first, second, node = by(c)
            return (first + w * c.estimate.stalled_others_ms, second, node)

        bound = math.inf
        if guard:
            bound = STREAM_E2E_BOUND * min(c.estimate.e2e_ms for c in inp.candidates)
        near = [c for c in inp.candidates if c.estimate.e2e_ms <= bound]
        far = [c for c in inp.candidates if c.estimate.e2e_ms > bound]
        ordered = sorted(near, key=key) + sorted(far, key=lambda c: key(c, _by_e2e))
        why = f"least predicted {objective}"
        if w > 0:
            why += f" + {w:g} x the delay to requests decoding there"
        if far:
            why += (
                f" among the nodes predicted to finish within {STREAM_E2E_BOUND:g}x the soonest"
                f" ({', '.join(c.node.id for c in far)} left last: predicted e2e over"
                f" {bound:.0f} ms)"
            )
        return _decision(self.name, inp, ordered, f"latency_{objective}", why)


@dataclass
class ThresholdPolicy:
    """Baseline: prompts up to ``threshold.prompt_tokens`` go to the edge, longer ones to cloud."""

    name: str = "threshold"

    def decide(self, inp: PolicyInput) -> Decision:
        cut = inp.config.threshold.prompt_tokens
        short = inp.profile.prompt_tokens <= cut
        ordered = sorted(inp.candidates, key=_by_e2e)
        preferred = [c for c in ordered if _is_cloud(c) != short]
        others = [c for c in ordered if _is_cloud(c) == short]
        tier = "edge" if short else "cloud"
        reason = f"threshold_{'short' if short else 'long'}"
        if not preferred:
            reason = f"threshold_no_{tier}"
        why = f"prompt {inp.profile.prompt_tokens} tokens {'<=' if short else '>'} {cut}: {tier}"
        return _decision(self.name, inp, preferred + others, reason, why)


@dataclass
class RoundRobinPolicy:
    """Baseline: each eligible node in turn (by node id)."""

    name: str = "round_robin"
    _counter: itertools.count[int] = field(default_factory=itertools.count)

    def decide(self, inp: PolicyInput) -> Decision:
        cands = list(inp.candidates)
        i = next(self._counter) % len(cands)
        ordered = cands[i:] + cands[:i]
        return _decision(self.name, inp, ordered, "round_robin", f"turn {i} of {len(cands)}")


@dataclass
class LeastLoadedPolicy:
    """Baseline: lowest occupancy (running + waiting + in flight) / max_batch."""

    name: str = "least_loaded"

    def decide(self, inp: PolicyInput) -> Decision:
        ordered = sorted(inp.candidates, key=lambda c: (c.estimate.load, *_by_e2e(c)))
        return _decision(
            self.name,
            inp,
            ordered,
            "least_loaded",
            f"lowest occupancy {ordered[0].estimate.load:.2f}",
        )


@dataclass
class EdgeFirstPolicy:
    """Baseline: an edge node with room, else cloud, else a full edge node."""

    name: str = "edge_first"

    def decide(self, inp: PolicyInput) -> Decision:
        cap = inp.config.edge_first_max_load
        ordered = sorted(inp.candidates, key=_by_e2e)
        free = [c for c in ordered if not _is_cloud(c) and c.estimate.load < cap]
        cloud = [c for c in ordered if _is_cloud(c)]
        full = [c for c in ordered if not _is_cloud(c) and c.estimate.load >= cap]
        if free:
            return _decision(self.name, inp, free + cloud + full, "edge_first", "an edge has room")
        return _decision(self.name, inp, cloud + full, "edge_full", "no edge node has room")


@dataclass
class CloudOnlyPolicy:
    """Baseline: cloud (and external OpenAI-compatible) nodes only."""

    name: str = "cloud_only"

    def decide(self, inp: PolicyInput) -> Decision:
        ordered = sorted((c for c in inp.candidates if _is_cloud(c)), key=_by_e2e)
        if not ordered:
            raise NoRoute(
                "unavailable",
                "policy cloud_only: no cloud node can take this request",
                {c.node.id: "not a cloud node" for c in inp.candidates},
            )
        return _decision(self.name, inp, ordered, "cloud_only", "cloud only")


POLICIES: dict[str, Callable[[], Policy]] = {
    "latency": LatencyPolicy,
    "threshold": ThresholdPolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "edge_first": EdgeFirstPolicy,
    "cloud_only": CloudOnlyPolicy,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
