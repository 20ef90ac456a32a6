"""The routing entry point: ``Router.decide(profile, view) -> Decision``, and its feedback loop.

A request's life as the router sees it::

    profile = build_profile(body, formatter, ..., outputs=router.outputs)
    decision = router.decide(profile, await store.view(profile.block_hashes), exclude=open_circuits)
    for cand in decision.candidates():            # retry order
        ticket = router.begin(decision, cand)      # counts it in flight on that node
        ...proxy...
        router.finish(ticket, measured)           # learn rates, output length, record errors

Invariants:
- Eligible = serves the model, ``prompt + max_tokens`` fits the node's context, lists every
  capability the request needs (``RequestProfile.needs``: grammar, logprobs, prompt
  logprobs) and takes its ``n`` (``NodeState.max_n``), in the view
  (the store only returns fresh nodes, or its last view when it is unreachable), and not in
  ``exclude`` (open circuits). Nothing else filters; policies only order.
- Every request this gateway has in flight on a node is replayed as work in hand there
  (``routing.ledger.DispatchLedger.work``: its remaining prefill and decode steps, from its prediction and its
  first token when seen), including those sent after the node's state was taken, so a burst
  does not pile onto one node between heartbeats; the node's own running and waiting counts
  beyond what it had seen of ours stand for other gateways' requests.
- A config change (hot reload) takes effect at the next ``decide``; learned rates, RTT
  measurements and output-length statistics are kept.
- Pure: no I/O; time comes from the injected ``clock`` (wall time, like NodeState.timestamp).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from routing.blocks import BLOCK_SIZE
from routing.fleet.state import NODE_API_VERSION, Capability, NodeState, api_compatible
from routing.fleet.store import FleetView
from routing.latency import Estimate, LatencyModel, Observation
from routing.latency.priors import prompt_cost
from routing.ledger import DispatchLedger
from routing.output_length import OutputLengthEstimator
from routing.policies import Candidate, Decision, NoRoute, Policy, PolicyInput, make_policy
from routing.policy_config import ConfigSource, PolicyConfig
from routing.profile import RequestProfile
from routing.regions import RegionTable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Ticket:
    """One dispatch of one request to one node (from ``Router.begin``)."""

    id: int
    node: NodeState
    estimate: Estimate
    dispatched_at: float
    profile: RequestProfile | None = None


@dataclass(frozen=True, slots=True)
class Measured:
    """What the gateway measured for a finished request (times in ms, at the gateway).

    ``ttft_ms`` is ``None`` for replies that were not streamed; ``net_rtt_ms`` is the
    gateway-to-node RTT if measured (else the region table's estimate is used);
    ``node_queue_ms`` is what the node said the request waited before its first token (its
    time to first token less its own prompt's compute), when it said; ``node_ttft_ms`` its own
    time to first token (what the gateway measured beyond it and the RTT is the gateway's).
    """

    e2e_ms: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    ttft_ms: float | None = None
    net_rtt_ms: float | None = None
    node_queue_ms: float | None = None
    node_ttft_ms: float | None = None


class Router:
    """Holds the policy, the latency model, the region table and the output-length estimator."""

    def __init__(
        self,
        config: ConfigSource | PolicyConfig | None = None,
        *,
        model: LatencyModel | None = None,
        regions: RegionTable | None = None,
        outputs: OutputLengthEstimator | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(config, ConfigSource):
            self.source = config
        else:
            self.source = ConfigSource.fixed(config)
        cfg = self.source.current
        self.model = model if model is not None else LatencyModel()
        self.regions = regions if regions is not None else RegionTable(cfg.regions)
        self.outputs = (
            outputs if outputs is not None else OutputLengthEstimator(cfg.expected_output)
        )
        self.ledger = DispatchLedger()
        self.clock = clock
        self._ids = itertools.count(1)
        self._policies: dict[str, Policy] = {}
        self._cfg: PolicyConfig | None = None
        self._warned_api: set[tuple[str, str]] = set()  # (node, version) already logged
        self._sync()

    # ---- config ------------------------------------------------------------------------------
    @property
    def config(self) -> PolicyConfig:
        self._sync()
        assert self._cfg is not None
        return self._cfg

    def _sync(self) -> None:
        cfg = self.source.current
        if cfg is self._cfg:
            return
        if self._cfg is not None:
            self.regions.configure(cfg.regions)
            self.outputs.configure(cfg.expected_output)
        self._cfg = cfg

    def reload_if_changed(self) -> bool:
        """Cheap per-request check of the policy file (see ``ConfigSource.check``)."""
        return self.source.check()

    def policy(self, name: str | None = None) -> Policy:
        """The policy instance for ``name`` (default: the configured one); kept across calls."""
        name = name or self.config.policy
        pol = self._policies.get(name)
        if pol is None:
            pol = self._policies[name] = make_policy(name)
        return pol

    # ---- deciding ----------------------------------------------------------------------------
    def candidates(
        self, profile: RequestProfile, view: FleetView, exclude: Collection[str] = ()
    ) -> tuple[list[Candidate], dict[str, str]]:
        """Eligible nodes with their estimates (sorted by id), and why the others are not."""
        self._sync()  # a reloaded config takes effect here
        now = self.clock()
        out: list[Candidate] = []
        left_out: dict[str, str] = {}
        need = profile.context_needed
        for node in view.nodes:
            if not api_compatible(node.api_version):
                left_out[node.id] = "api_version"
                self._warn_incompatible(node)
            elif profile.model not in node.models and (
                profile.model_identity not in node.model_identities.values()
            ):
                left_out[node.id] = "model"
            elif need > node.max_context:
                left_out[node.id] = "context"
            elif lacking(profile, node):
                left_out[node.id] = "capability"
            elif node.id in exclude:
                left_out[node.id] = "excluded"
            else:
                out.append(Candidate(node, self._estimate(self.model, node, profile, view, now)))
        out.sort(key=lambda c: c.node.id)
        return out, left_out

    def _warn_incompatible(self, node: NodeState) -> None:
        """Log once per node and version that it is skipped for its Node API major version."""
        key = (node.id, node.api_version)
        if key not in self._warned_api:
            self._warned_api.add(key)
            log.warning(
                "skipping node %s: it speaks Node API %s, this gateway %s (another major "
                "version); upgrade one of them (docs/deploy.md: rolling upgrades)",
                node.id,
                node.api_version,
                NODE_API_VERSION,
            )

    def _estimate(
        self,
        model: LatencyModel,
        node: NodeState,
        profile: RequestProfile,
        view: FleetView,
        now: float,
    ) -> Estimate:
        """``model``'s estimate of ``profile`` on ``node`` from the fleet view and the ledger."""
        client_region = profile.client_region or self.config.default_region
        seen = self.ledger.in_flight_at(node.id, node.timestamp)
        # other gateways' requests: the node's count beyond ours when it was taken, or what
        # the other workers on this gateway's in-flight board hold there now, if more
        extra = max(0, node.running + node.waiting - seen, view.others_in_flight.get(node.id, 0))
        credited = min(view.prefix_blocks.get(node.id, 0), len(profile.reusable_hashes))
        echo = profile.prompt_logprobs  # every position computed: no prefix reuse, dearer tokens
        if echo:
            credited = 0
        if (
            credited
            and node.prefix_in_slots
            and not extra
            and self.ledger.slots_taken_without(
                node.id, profile.reusable_hashes[:credited], node.max_batch
            )
        ):
            # every slot went to a prompt without it since: what kept it was overwritten,
            # which the index hears only from the node's next events
            credited = 0
        return model.estimate(
            node,
            prompt_tokens=profile.prompt_tokens,
            cached_tokens=credited * BLOCK_SIZE,
            expected_output_tokens=profile.expected_output_on(node.kind),
            rtt_ms=self.regions.rtt_ms(client_region, node.region),
            extra_inflight=extra,
            ahead=self.ledger.work(node.id, now),
            shared_prefix=self.ledger.shared_prefix(node.id, profile.reusable_hashes)
            if node.prefix_cache and not echo
            else None,
            newcomer=self.ledger.typical(node.id, now),
            choices=profile.choices,
            prompt_cost=prompt_cost(node) if echo else 1.0,
        )

    def decide(
        self,
        profile: RequestProfile,
        view: FleetView,
        *,
        exclude: Collection[str] = (),
        policy: str | None = None,
    ) -> Decision:
        """Choose a node for ``profile`` (raises :class:`NoRoute` when none can take it)."""
        cands, left_out = self.candidates(profile, view, exclude)
        if not cands:
            reasons = set(left_out.values())
            if not left_out or reasons == {"model"}:
                raise NoRoute("unknown_model", f"no node serves model {profile.model!r}", left_out)
            if "capability" in reasons and reasons <= {"model", "context", "capability"}:
                raise NoRoute(
                    "unsupported",
                    f"no node serving {profile.model!r} serves " + describe_needs(profile),
                    left_out,
                    param=unmet_param(
                        profile, [n for n in view.nodes if left_out.get(n.id) == "capability"]
                    ),
                )
            if reasons <= {"model", "context"}:
                raise NoRoute(
                    "too_long",
                    f"{profile.context_needed} tokens (prompt {profile.prompt_tokens} + "
                    f"max_tokens) exceed the context of every node serving {profile.model!r}",
                    left_out,
                )
            raise NoRoute(
                "unavailable", f"no node serving {profile.model!r} is available now", left_out
            )
        cfg = self.config
        inp = PolicyInput(profile, cands, cfg, view.stale)
        pol = self._policies.get(policy or cfg.policy)
        return (pol or self.policy(policy)).decide(inp)

    # ---- feedback ----------------------------------------------------------------------------
    def begin(
        self,
        decision: Decision,
        candidate: Candidate | None = None,
        profile: RequestProfile | None = None,
    ) -> Ticket:
        """Count a dispatch to ``candidate`` (default: the chosen node) as in flight."""
        cand = candidate or decision.chosen
        now = self.clock()
        ticket = Ticket(next(self._ids), cand.node, cand.estimate, now, profile)
        out = profile.expected_output_on(cand.node.kind) if profile is not None else 0.0
        hashes = profile.reusable_hashes if profile is not None else ()
        rows = profile.choices if profile is not None else 1
        self.ledger.add(cand.node.id, now, ticket.id, cand.estimate, out, hashes, rows)
        return ticket

    def first_token(self, ticket: Ticket) -> None:
        """The node sent the ticket's first token: its prefill is over (refines ``work``)."""
        self.ledger.first_token(ticket.id, self.clock())

    def progress(self, ticket: Ticket, tokens: int) -> None:
        """``tokens`` completion tokens of the ticket's stream have been relayed: how far its
        decode is (refines ``work``)."""
        self.ledger.progress(ticket.id, tokens)

    def finish(self, ticket: Ticket, measured: Measured | None = None) -> dict[str, float]:
        """End a dispatch. With ``measured`` (a successful request) the model learns from it.

        Returns the prediction errors recorded (``ttft``/``e2e``, measured - predicted, ms).
        Idempotent: a ticket finished twice is learned from once.
        """
        now = self.clock()
        if not self.ledger.remove(ticket.node.id, ticket.dispatched_at, ticket.id, now):
            return {}
        if measured is None:
            return {}
        # the rows it decoded beside: this gateway's requests on the node while it decoded
        # (itself included, at most the node's slots)
        ttft = measured.ttft_ms if measured.ttft_ms is not None else ticket.estimate.ttft_ms
        span_s = (measured.e2e_ms - ttft) / 1000.0
        # n choices: usage counts every choice's tokens; each row decoded its share, beside
        # the others (the latency model and the output lengths learn per row)
        choices = ticket.profile.choices if ticket.profile is not None else 1
        completion = -(-measured.completion_tokens // choices)
        decode_batch = None
        if span_s > 0:
            rows = self.ledger.mean_in_flight(ticket.node.id, now - span_s, now)
            decode_batch = min(max(1.0, rows), float(max(1, ticket.node.max_batch)))
        net = measured.net_rtt_ms
        if net is None:
            net = self.regions.rtt_ms(self.config.home_region, ticket.node.region)
        echo = ticket.profile is not None and ticket.profile.prompt_logprobs
        obs = Observation(
            prompt_cost=prompt_cost(ticket.node) if echo else 1.0,
            node_id=ticket.node.id,
            kind=ticket.node.kind,
            prompt_tokens=measured.prompt_tokens,
            cached_tokens=measured.cached_tokens,
            completion_tokens=completion,
            e2e_ms=measured.e2e_ms,
            ttft_ms=measured.ttft_ms,
            net_rtt_ms=net,
            node_queue_ms=measured.node_queue_ms,
            node_ttft_ms=measured.node_ttft_ms,
            decode_batch=decode_batch,
            estimate=ticket.estimate,
        )
        errors = self.model.observe(obs)
        if ticket.profile is not None:
            p = ticket.profile
            self.outputs.observe(
                p.api_key,
                p.route,
                completion,
                p.max_tokens,
                p.first_block,
                p.prompt_key,
                ticket.node.kind,
                p.last_message_key,
                p.prompt_tokens,
            )
        return errors

    def in_flight(self, node_id: str) -> int:
        return self.ledger.in_flight(node_id)


# each capability a request may need, first to last in a 400's ``param``, and its field
_NEED_PARAMS = (
    (Capability.GRAMMAR, "response_format"),
    (Capability.LOGPROBS, "logprobs"),
    (Capability.PROMPT_LOGPROBS, "logprobs"),  # with echo
)


def lacking(profile: RequestProfile, node: NodeState) -> list[str]:
    """What ``node`` lacks to serve ``profile``: capability names, and ``n`` where its
    ``max_n`` is below the request's choices (empty: it serves it)."""
    out = sorted(profile.needs - set(node.capabilities))
    if profile.choices > node.max_n:
        out.append("n")
    return out


def unmet_param(profile: RequestProfile, nodes: Collection[NodeState]) -> str:
    """The request field to name when ``nodes`` (those left out for capabilities) cannot
    serve ``profile``: the first need some of them lack, a grammar's before logprobs, ``n``
    last."""
    missing = {m for node in nodes for m in lacking(profile, node)}
    for cap, param in _NEED_PARAMS:
        if cap in missing:
            return "tools" if cap == Capability.GRAMMAR and profile.tools else param
    return "n" if "n" in missing else "logprobs"


def describe_needs(profile: RequestProfile) -> str:
    """What ``profile`` asks beyond plain sampling, in words (for a NoRoute message)."""
    words = {
        Capability.GRAMMAR: "grammar (tools)" if profile.tools else "grammar (response_format)"
    }
    parts = [words.get(c, c) for c in sorted(profile.needs)]
    if profile.choices > 1:
        parts.append(f"n={profile.choices}")
    return ", ".join(parts) or "this request"
