"""Headers a node's reply carries for the gateway (the node-to-gateway side of the contract).

``x-edgecloud-cached-tokens`` and ``x-edgecloud-measured-ttft-ms`` (the node's time from the
request's arrival to its first token) come with every 200. A reply sent whole has its headers
sent at the first token and its JSON body at the last, marked by :data:`HEADERS_AT_FIRST_TOKEN`:
a gateway then knows the prompt was prefilled when the headers arrive (its latency model
learns the request's progress, as it does from a stream), and measures the time to first
token itself. Without the mark (an older node) it reads ``x-edgecloud-node-e2e-ms`` instead.

:data:`PREFILL_MS_HEADER`, from an engine that measures it (both of ours), is the compute time
of the request's own prompt chunks (the cloud's: its share of the mixed steps that ran them,
beyond their decode rows' time); the rest of the node's time to first token is waiting (for a
slot, behind other prompts, beside their decode steps): :func:`node_wait_ms`. The gateway's
latency model learns prefill rates from the compute alone, however busy the node was.

The other way, :data:`ORDER_AT_HEADER` gives a request its place in a node's queue: the node
queues it as if it had arrived then (its clock's equivalent of that wall-clock time, at most
:data:`ORDER_MAX_AHEAD_S` back and never later than its arrival), so a node fed by one
gateway admits and prefills in the order that gateway's replay assumes, whatever the order
its requests' bodies were read and tokenized in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

HEADERS_AT_FIRST_TOKEN = "x-edgecloud-headers-at-first-token"
PREFILL_MS_HEADER = "x-edgecloud-prefill-ms"
NODE_TTFT_HEADER = "x-edgecloud-measured-ttft-ms"
# gateway -> node: the request's place in the node's queue, as wall-clock seconds (when the
# gateway sent it, or just before requests it placed it ahead of: ``routing.passes``)
ORDER_AT_HEADER = "x-edgecloud-order-at"
ORDER_MAX_AHEAD_S = 60.0  # the furthest back a place is taken


def order_at(headers: Mapping[str, str]) -> float | None:
    """The request's place in the queue (wall-clock seconds) from :data:`ORDER_AT_HEADER`;
    None when not sent. Raises ValueError for a value that is not a finite number."""
    raw = headers.get(ORDER_AT_HEADER)
    if raw is None:
        return None
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(raw)
    return value


def queue_time(at: float, wall_now: float, mono_now: float) -> float:
    """The place ``at`` (wall-clock seconds) as a node's monotonic arrival time, read at the
    same moment as ``wall_now`` and ``mono_now``: never later than now, at most
    :data:`ORDER_MAX_AHEAD_S` back."""
    return mono_now - min(max(0.0, wall_now - at), ORDER_MAX_AHEAD_S)


def _ms(headers: Mapping[str, str], name: str) -> float | None:
    """Header ``name`` as a time in ms: None unless sent and at least 0 (not NaN)."""
    try:
        ms = float(headers[name])
    except (KeyError, ValueError):
        return None
    return ms if ms >= 0 else None


def node_ttft_ms(headers: Mapping[str, str]) -> float | None:
    """The node's own time to first token (ms, from its request's arrival), None unless the
    node sent a finite one."""
    ttft = _ms(headers, NODE_TTFT_HEADER)
    return ttft if ttft != float("inf") else None


def node_wait_ms(headers: Mapping[str, str]) -> float | None:
    """The node's time to first token less its own prompt's compute (ms, at least 0); None
    unless the node sent both."""
    ttft, prefill = _ms(headers, NODE_TTFT_HEADER), _ms(headers, PREFILL_MS_HEADER)
    if ttft is None or prefill is None:
        return None
    return max(0.0, ttft - prefill)
