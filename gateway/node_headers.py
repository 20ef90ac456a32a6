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

The other way, :data:`CACHE_SALT_HEADER` on a request names its cache scope (an opaque value
the gateway derives per tenant, :mod:`gateway.cache_scope`); the node's engine hashes the
request's prefix blocks in that scope (:func:`routing.blocks.scope_seed`). Clients never set
it: the gateway builds every header it sends to a node.
"""

from __future__ import annotations

from collections.abc import Mapping

HEADERS_AT_FIRST_TOKEN = "x-edgecloud-headers-at-first-token"
PREFILL_MS_HEADER = "x-edgecloud-prefill-ms"
NODE_TTFT_HEADER = "x-edgecloud-measured-ttft-ms"
CACHE_SALT_HEADER = "x-edgecloud-cache-salt"
MAX_CACHE_SALT_CHARS = 128


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
