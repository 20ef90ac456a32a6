"""What the latency model has measured on each node, and the rates it reads from that.

Invariants:
- Every rate is a blend of what the model measured (EWMA per node over finished requests) and
  what the node reports about itself; the kind's priors are used only while it has neither.
  Measurements take over as samples accumulate, but the node's self-report keeps
  ``SELF_REPORT_WEIGHT`` so a sudden change on the node shows.
- A node with nothing measured or reported borrows what its peers measured (same kind, device
  and models: replicas of one deployment) before the priors: a fresh replica must not look
  slower than its busy twin, or it never gets the traffic that would measure it.
- Decode time scales with the batch and the context its rows attend to: a step of ``b`` rows
  over ``n`` tokens of context takes ``ms(1) * (1 + slope * (b - 1)) + c * n``; rates are
  stored normalized to batch 1 and no context.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from routing.backlog import EngineShape
from routing.ewma import Ewma
from routing.fleet.state import NodeKind, NodeState
from routing.latency.fits import DecodeCost, DecodeFit, PrefillFit, RecentMedian
from routing.latency.priors import (
    RATE_ALPHA,
    SELF_REPORT_WEIGHT,
    SERVICE_OUTPUT_TOKENS,
    WARMUP_SAMPLES,
    kind_priors,
)


def _ewma() -> Ewma:
    return Ewma(RATE_ALPHA)


@dataclass(slots=True)
class NodeRates:
    """What the model measured on one node (decode normalized to batch 1)."""

    prefill_tokens_per_s: Ewma = field(default_factory=_ewma)
    decode_ms_per_token_b1: Ewma = field(default_factory=_ewma)
    output_tokens: Ewma = field(default_factory=_ewma)
    prompt_tokens: Ewma = field(default_factory=_ewma)  # of the requests it served
    decode_fit: DecodeFit = field(default_factory=DecodeFit)  # ms/token on batch and context
    # a prompt's own time to first token: fixed cost + per uncached token + per cached token
    prefill_fit: PrefillFit = field(default_factory=PrefillFit)
    # the gateway's time to first token less the RTT less the node's own
    gateway_ms: RecentMedian = field(default_factory=RecentMedian)
    # the node's wait before its engine started a request it took with nothing in hand
    admission_ms: RecentMedian = field(default_factory=RecentMedian)


_NO_RATES = NodeRates()  # what a node never measured has (read only, never updated)


def _finite(x: float, fallback: float) -> float:
    return x if math.isfinite(x) and x > 0 else fallback


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class RateBook:
    """Per-node measured rates, with the peers and priors they fall back on."""

    def __init__(self) -> None:
        self.rates: dict[str, NodeRates] = {}
        self._peer_group: dict[str, tuple[object, ...]] = {}  # node id -> its deployment
        self._groups: dict[tuple[object, ...], set[str]] = {}

    def forget(self, node_id: str) -> None:
        self.rates.pop(node_id, None)
        group = self._peer_group.pop(node_id, None)
        if group is not None:
            self._groups[group].discard(node_id)

    def of(self, node_id: str) -> NodeRates:
        """The node's rates, created empty on first use (for learning)."""
        rates = self.rates.get(node_id)
        if rates is None:
            rates = self.rates[node_id] = NodeRates()
        return rates

    # ---- peers -------------------------------------------------------------------------------
    def _register(self, node: NodeState) -> tuple[object, ...]:
        """The node's deployment (kind, device, models), remembered for its peers."""
        group = self._peer_group.get(node.id)
        if group is None:
            group = (node.kind, node.device, tuple(sorted(node.models)))
            self._peer_group[node.id] = group
            self._groups.setdefault(group, set()).add(node.id)
        return group

    def _peer_ids(self, node: NodeState) -> set[str]:
        return self._groups.get(self._register(node), set()) - {node.id}

    def _peer_rates(self, node_id: str) -> list[NodeRates]:
        """The rates of the node's peers, by node id (an order that does not depend on string
        hashing, so means over peers and the first peer with a fit repeat from run to run)."""
        group = self._peer_group.get(node_id)
        members = sorted(self._groups.get(group, ())) if group is not None else []
        return [r for i in members if i != node_id and (r := self.rates.get(i))]

    # ---- rates -------------------------------------------------------------------------------
    def _assumed_slope(self, node_id: str | None, kind: NodeKind) -> float:
        """The prior slope for the node's kind and, once the node was seen, its device."""
        group = self._peer_group.get(node_id) if node_id is not None else None
        device = str(group[1]) if group is not None else None
        return kind_priors(kind, device).batch_slope

    def _slope(self, node_id: str | None, kind: NodeKind) -> float:
        assumed = self._assumed_slope(node_id, kind)
        if node_id is not None:
            own = self.rates.get(node_id)
            for rates in [own, *self._peer_rates(node_id)]:  # its own fit, else a peer's
                fit = rates.decode_fit.solve(assumed) if rates is not None else None
                if fit is not None and fit.slope_fitted and fit.b1_ms > 0:
                    return min(max(fit.per_row_ms / fit.b1_ms, 0.0), 2.0)
        return assumed

    def batch_factor(self, kind: NodeKind, batch: float, node_id: str | None = None) -> float:
        return 1.0 + self._slope(node_id, kind) * max(0.0, batch - 1.0)

    def batch_slope(self, node: NodeState) -> float:
        """Relative decode slowdown per extra row: fitted on this node's (or a peer's)
        observations once they span several batch sizes, else the prior."""
        self._register(node)
        return self._slope(node.id, node.kind)

    def decode_cost(self, node_id: str, kind: NodeKind) -> DecodeCost | None:
        rates = self.rates.get(node_id)
        if rates is None:
            return None
        fit = rates.decode_fit.solve(self._assumed_slope(node_id, kind))
        return fit if fit is not None and fit.b1_ms > 0 else None

    def context_cost(self, node: NodeState) -> float:
        """Decode ms per token of context (summed over a step's rows): fitted on this node's
        requests once their contexts spread, else a peer's, else 0."""
        for node_id in [node.id, *sorted(self._peer_ids(node))]:
            fit = self.decode_cost(node_id, node.kind)
            if fit is not None and fit.per_context_ms > 0:
                return fit.per_context_ms
        return 0.0

    @staticmethod
    def _blend(measured: Ewma, reported: float, default: float) -> float:
        if measured.n == 0:
            return reported if reported > 0 else default
        if reported <= 0:
            return measured.value
        w = (1.0 - SELF_REPORT_WEIGHT) * min(1.0, measured.n / WARMUP_SAMPLES)
        return w * measured.value + (1.0 - w) * reported

    def prefill_tokens_per_s(self, node: NodeState) -> float:
        self._register(node)
        rates = self.rates.get(node.id) or _NO_RATES
        default = kind_priors(node.kind, node.device).prefill_tokens_per_s
        if rates.prefill_tokens_per_s.n == 0 and node.prefill_tokens_per_s <= 0:
            peers = self._peer_rates(node.id)
            seen = [r.prefill_tokens_per_s.value for r in peers if r.prefill_tokens_per_s.n]
            default = _mean(seen) or default
        value = self._blend(rates.prefill_tokens_per_s, node.prefill_tokens_per_s, default)
        return _finite(value, default)

    def decode_ms_per_token_b1(self, node: NodeState) -> float:
        """Decode ms/token of one sequence at batch 1 (the node's report is normalized)."""
        self._register(node)  # its device: the batch slope it is assumed to have
        rates = self.rates.get(node.id) or _NO_RATES
        default = kind_priors(node.kind, node.device).decode_ms_per_token
        reported = node.decode_ms_per_token / self.batch_factor(
            node.kind, max(1, node.running), node.id
        )
        measured = rates.decode_ms_per_token_b1
        fit = self.decode_cost(node.id, node.kind)
        if fit is not None:  # the fit's intercept is batch 1 itself
            measured = Ewma(RATE_ALPHA, fit.b1_ms, measured.n)
        if measured.n == 0 and reported <= 0:
            peers = self._peer_rates(node.id)
            seen = [r.decode_ms_per_token_b1.value for r in peers if r.decode_ms_per_token_b1.n]
            default = _mean(seen) or default
        return _finite(self._blend(measured, reported, default), default)

    def mean_prompt_tokens(self, node_id: str) -> float:
        """Prompt tokens of a typical request on the node (0 until one is seen)."""
        rates = self.rates.get(node_id)
        return rates.prompt_tokens.value if rates is not None else 0.0

    def mean_output_tokens(self, node_id: str) -> float:
        rates = self.rates.get(node_id)
        if rates is None or rates.output_tokens.n == 0:
            return SERVICE_OUTPUT_TOKENS
        return max(1.0, rates.output_tokens.value)

    # ---- costs beyond the engine's rates -----------------------------------------------------
    def overhead_ms(self, node_id: str, idle: bool) -> float:
        """What a request on the node takes beyond its engine and the RTT, as learned: the
        gateway's share and, when the node has nothing in hand (``idle``), the node's own
        before its engine starts it. A node not yet measured is taken at the mean of those
        that are (measuring a node never makes it look dearer than an unknown one)."""
        own = self.rates.get(node_id)

        def learned(part: Callable[[NodeRates], RecentMedian]) -> float:
            if own is not None and part(own).n:
                return part(own).value
            return _mean([part(r).value for r in self.rates.values() if part(r).n])

        gateway = learned(lambda r: r.gateway_ms)
        return gateway + (learned(lambda r: r.admission_ms) if idle else 0.0)

    def prefill_cost(self, node: NodeState) -> tuple[float, float, float]:
        """(fixed ms, ms per uncached token, ms per cached token) of a prompt's own time to
        first token: fitted on this node's requests once their lengths spread, else the
        blended rate with the fixed cost through those requests' mean, and 0."""
        rates = self.rates.get(node.id)
        per_token = 1000.0 / self.prefill_tokens_per_s(node)
        if rates is None:
            return 0.0, per_token, 0.0
        fit = rates.prefill_fit.solve()
        if fit is not None and fit[1] > 0:
            return max(0.0, fit[0]), fit[1], fit[2]
        return rates.prefill_fit.fixed_at(per_token), per_token, 0.0

    def shape(self, node: NodeState) -> EngineShape:
        """The node's engine as :func:`routing.backlog.replay` runs it."""
        priors = kind_priors(node.kind, node.device)
        self._register(node)
        fixed, per_token, per_cached = self.prefill_cost(node)
        chunk = node.prefill_chunk or priors.prefill_chunk
        b1, slope = self.decode_ms_per_token_b1(node), self.batch_slope(node)
        return EngineShape(
            slots=max(1, node.max_batch),
            chunk_tokens=chunk,
            chunk_tokens_decoding=node.prefill_chunk_decoding or chunk,
            prefill_ms_per_token=per_token,
            decode_step_ms_b1=b1,
            batch_slope=slope,
            prefill_fixed_ms=fixed,
            cached_token_ms=per_cached,
            mixed_steps=priors.mixed_steps,
            catch_up=node.prefix_catch_up,
            decode_ms_per_context_token=self.context_cost(node),
        )
