"""The ``x-edgecloud-*`` headers a gateway reply carries: the decision, and what was measured.

Invariants:
- A reply from a node other than the decision's choice (failover) names the node that
  answered, its tier and its own estimates, with reason ``failover``.
- ``x-edgecloud-cached-tokens`` is what the answering node reported when it did, else what the
  router credited; ``x-edgecloud-credited-tokens`` is always what the router credited.
- ``x-edgecloud-prefill-ms`` is the answering node's own (its prompt's compute), passed on
  when it sent one; ``x-edgecloud-predicted-prefill-ms`` is what the router predicted for it;
  ``x-edgecloud-node-ttft-ms`` is the node's own time to first token (the gateway's and the
  network's share of what its client saw is the difference).
- A reply sent whole reports the time to first token its client would have seen streamed
  (:func:`ttft_of_whole_reply`), or none when the node sent no timings.
- What a caller sees of them is the operator's choice (``decision_headers``,
  :func:`hide_decision`): ``full``, all of them; ``minimal``, the tier, attempts and the
  request id; ``off``, the request id. Every figure is of the caller's own cache scope.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Literal

from gateway.front.upstream import UpstreamHeaders
from gateway.node_headers import HEADERS_AT_FIRST_TOKEN, NODE_TTFT_HEADER, PREFILL_MS_HEADER
from routing.policies import Candidate, Decision


def decision_headers(
    decision: Decision,
    cand: Candidate,
    node_headers: UpstreamHeaders,
    attempts: int,
    request_id: str,
    first_byte_ms: float,
) -> dict[str, str]:
    """The headers of a reply from ``cand`` after ``attempts`` tries, whose node's headers
    came ``first_byte_ms`` after the request arrived."""
    h = decision.headers()
    if cand.node.id != decision.node_id:
        est = cand.estimate
        h.update(
            {
                "x-edgecloud-node": cand.node.id,
                "x-edgecloud-tier": cand.node.kind.value,
                "x-edgecloud-reason": "failover",
                "x-edgecloud-predicted-ttft-ms": f"{est.ttft_ms:.1f}",
                "x-edgecloud-predicted-e2e-ms": f"{est.e2e_ms:.1f}",
                "x-edgecloud-predicted-queue-ms": f"{est.queue_ms:.1f}",
                "x-edgecloud-predicted-prefill-ms": f"{est.own_prefill_ms:.1f}",
                "x-edgecloud-in-hand": str(est.in_hand),
                "x-edgecloud-cached-tokens": str(est.cached_tokens),
                "x-edgecloud-credited-tokens": str(est.cached_tokens),
            }
        )
    node_cached = node_headers.get("x-edgecloud-cached-tokens")
    if node_cached is not None:
        h["x-edgecloud-cached-tokens"] = node_cached
    node_prefill = node_headers.get(PREFILL_MS_HEADER)
    if node_prefill is not None:  # the node's compute of the prompt: the rest was waiting
        h[PREFILL_MS_HEADER] = node_prefill
    node_ttft = node_headers.get(NODE_TTFT_HEADER)
    if node_ttft is not None:  # the node's own time to first token, from its request's arrival
        h["x-edgecloud-node-ttft-ms"] = node_ttft
    h["x-edgecloud-measured-ttft-ms"] = f"{first_byte_ms:.1f}"
    h["x-edgecloud-attempts"] = str(attempts)
    h["x-request-id"] = request_id
    return h


DecisionHeaders = Literal["full", "minimal", "off"]
_MINIMAL = frozenset(("x-edgecloud-tier", "x-edgecloud-attempts"))


def hide_decision(headers: MutableMapping[str, str], level: DecisionHeaders) -> None:
    """Remove from a reply's ``headers`` what a caller may not see at ``level``: at
    ``minimal`` every ``x-edgecloud-*`` header but the tier and attempts, at ``off`` all of
    them (the request id stays); at ``full`` nothing."""
    if level == "full":
        return
    keep = _MINIMAL if level == "minimal" else ()
    for name in [k for k in headers if k.lower().startswith("x-edgecloud-")]:
        if name.lower() not in keep:
            del headers[name]


def visible_route(out: dict[str, Any], level: DecisionHeaders) -> dict[str, Any]:
    """The ``POST /v1/route`` answer ``out`` a caller who is not an admin may see at
    ``level`` (``off`` is refused before: the route is for admins only)."""
    out.pop("url", None)
    for c in out.get("candidates", ()):
        c.pop("url", None)
    if level == "minimal":
        return {k: out[k] for k in ("tier", "client_region") if k in out}
    return out


def ttft_of_whole_reply(
    node_headers: UpstreamHeaders, e2e_ms: float, headers_ms: float | None = None
) -> float | None:
    """The time to first token of a reply sent whole, as the gateway's client would have seen
    it streamed: when the node sent its headers at the first token (``headers_ms``, measured
    here), that; from an older node, the gateway's end-to-end time less the node's time from
    first to last token (both from its headers; None when it sent neither)."""
    if headers_ms is not None and node_headers.get(HEADERS_AT_FIRST_TOKEN) == "1":
        return headers_ms
    try:
        node_ttft = float(node_headers["x-edgecloud-measured-ttft-ms"])
        node_e2e = float(node_headers["x-edgecloud-node-e2e-ms"])
    except (KeyError, ValueError):
        return None
    decode = node_e2e - node_ttft
    if not (0.0 <= decode <= e2e_ms):
        return None
    return e2e_ms - decode


def set_whole_reply_timings(
    hdrs: dict[str, str], node_headers: UpstreamHeaders, e2e_ms: float, headers_ms: float
) -> float | None:
    """Put a whole reply's measured e2e and TTFT in ``hdrs`` (``headers_ms``: when the node's
    headers arrived); return the TTFT (or None)."""
    ttft = ttft_of_whole_reply(node_headers, e2e_ms, headers_ms)
    hdrs["x-edgecloud-measured-e2e-ms"] = f"{e2e_ms:.1f}"
    if ttft is None:
        hdrs.pop("x-edgecloud-measured-ttft-ms", None)
    else:
        hdrs["x-edgecloud-measured-ttft-ms"] = f"{ttft:.1f}"
    return ttft
