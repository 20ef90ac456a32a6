"""Learning a node's rates from one finished request, against what was predicted for it.

Invariants:
- Prefill is learned from the node's own account of the wait when it gives one, whatever else
  ran; otherwise only from requests predicted to start at once with little else running.
- Decode ms/token is fitted against the rows the request decoded beside as this gateway saw
  them and the context its steps attended to, less the stall the prediction put between them.
- Predicted-vs-measured error is recorded for every observation that carries a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.fleet.state import NodeKind
from routing.latency.errors import PredictionErrors
from routing.latency.estimate import Estimate
from routing.latency.priors import (
    ERROR_ALPHA,
    MIN_DECODE_TOKENS,
    MIN_PREFILL_TOKENS,
)
from routing.latency.rates import NodeRates, RateBook


@dataclass(frozen=True, slots=True)
class Observation:
    """What the gateway measured about one finished request on one node (ms, at the gateway).

    ``ttft_ms`` is None when the reply was not streamed; ``net_rtt_ms`` is the gateway-to-node
    round trip included in the times; ``node_queue_ms`` the node's own account of the wait
    before the prompt's compute; ``node_ttft_ms`` its own time to first token; ``decode_batch``
    the mean rows it decoded beside, itself included (None: the prediction's).
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
    decode_batch: float | None = None
    prompt_cost: float = 1.0  # an uncached prompt token's cost in ordinary ones (echo: more)


def _learn_prefill(rates: NodeRates, obs: Observation, net: float) -> None:
    est = obs.estimate
    uncached = (obs.prompt_tokens - obs.cached_tokens) * obs.prompt_cost  # ordinary tokens
    if obs.ttft_ms is None or uncached < 1:
        return
    server_ms = obs.ttft_ms - net
    others = 0.0
    if est is not None:
        others = max(0.0, est.ttft_ms - est.rtt_ms - est.overhead_ms - est.own_prefill_ms)
    if obs.node_ttft_ms is not None:
        gateway_ms = max(0.0, server_ms - obs.node_ttft_ms)
        rates.gateway_ms.add(gateway_ms)
        server_ms -= gateway_ms  # the node's own from here
    if obs.node_queue_ms is not None and est is not None and est.in_hand == 0:
        rates.admission_ms.add(obs.node_queue_ms)
    prefill_ms: float | None = None
    if obs.node_queue_ms is not None:  # the node's account: exact
        prefill_ms = max(server_ms - obs.node_queue_ms, 0.5)
    elif est is None or others <= 0.25 * max(server_ms, 1e-3):
        prefill_ms = max(server_ms - others, 0.25 * server_ms, 0.5)
    if prefill_ms is None:
        return
    rates.prefill_fit.add(float(uncached), float(obs.cached_tokens), prefill_ms)
    if uncached >= MIN_PREFILL_TOKENS:
        rates.prefill_tokens_per_s.add(1000.0 * uncached / prefill_ms)


def _learn_decode(book: RateBook, rates: NodeRates, obs: Observation, net: float) -> None:
    est = obs.estimate
    ttft = obs.ttft_ms
    if ttft is None and est is not None:
        ttft = est.ttft_ms - est.rtt_ms + net
    if ttft is None or obs.completion_tokens < MIN_DECODE_TOKENS:
        return
    per_token = (obs.e2e_ms - ttft) / (obs.completion_tokens - 1)
    if est is not None and est.basis.step_ms > 0:
        stall = max(0.0, est.decode_ms_per_token - est.basis.step_ms)
        per_token = max(per_token - stall, 0.3 * per_token)
    if per_token <= 0:
        return
    batch = est.basis.mean_batch if est else 1.0
    context = est.basis.mean_context if est else float(obs.prompt_tokens)
    if obs.decode_batch is not None:
        context *= obs.decode_batch / max(batch, 1.0)  # the context read grows with the rows
        batch = obs.decode_batch
    fit = book.decode_cost(obs.node_id, obs.kind)
    own = per_token - (fit.per_context_ms * context if fit is not None else 0.0)
    factor = book.batch_factor(obs.kind, batch, obs.node_id)
    rates.decode_ms_per_token_b1.add(max(own, 0.3 * per_token) / factor)
    rates.decode_fit.add(batch - 1.0, context, per_token)


def learn(book: RateBook, errors: PredictionErrors, obs: Observation) -> dict[str, float]:
    """Learn from one finished request; returns the prediction errors recorded (ms)."""
    rates = book.of(obs.node_id)
    net = max(0.0, obs.net_rtt_ms)
    _learn_prefill(rates, obs, net)
    _learn_decode(book, rates, obs, net)
    if obs.prompt_tokens > 0:
        rates.prompt_tokens.add(float(obs.prompt_tokens))
    if obs.completion_tokens > 0:
        rates.output_tokens.add(float(obs.completion_tokens))
    out: dict[str, float] = {}
    est = obs.estimate
    if est is not None:
        tier = obs.kind.value
        # like with like: the gateway measures the gateway-to-node RTT, not the client's
        offset = net - est.rtt_ms
        if obs.ttft_ms is not None:
            out["ttft"] = errors.add("ttft", tier, est.ttft_ms + offset, obs.ttft_ms, ERROR_ALPHA)
        out["e2e"] = errors.add("e2e", tier, est.e2e_ms + offset, obs.e2e_ms, ERROR_ALPHA)
    return out
