"""Headers a node's reply carries for the gateway (the node-to-gateway side of the contract).

``x-edgecloud-cached-tokens`` and ``x-edgecloud-measured-ttft-ms`` (the node's time from the
request's arrival to its first token) come with every 200. A reply sent whole has its headers
sent at the first token and its JSON body at the last, marked by :data:`HEADERS_AT_FIRST_TOKEN`:
a gateway then knows the prompt was prefilled when the headers arrive (its latency model
learns the request's progress, as it does from a stream), and measures the time to first
token itself. Without the mark (an older node) it reads ``x-edgecloud-node-e2e-ms`` instead.
"""

from __future__ import annotations

HEADERS_AT_FIRST_TOKEN = "x-edgecloud-headers-at-first-token"
