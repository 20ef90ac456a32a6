"""The client's IP address: the socket peer, or what a trusted proxy says in X-Forwarded-For.

Invariants:
- ``X-Forwarded-For`` is read only when the socket peer is inside one of the configured trusted
  proxy networks. From any other peer the header is ignored, so a client cannot spoof its
  address (and so its region) by sending the header itself.
- When the peer is trusted, the header is walked right to left (nearest hop first); trusted hops
  are skipped and the first untrusted address is the client. If every hop is trusted, the
  leftmost one is the client. A malformed entry stops the walk: everything to its left was
  written by someone we cannot vouch for, so the last good hop is returned.
- Addresses come back normalized (``ipaddress`` text form; IPv4-mapped IPv6 becomes IPv4; a
  port or IPv6 brackets are removed). A peer that is not an IP address (a Unix socket, a test
  client) comes back as is, or ``None`` when the server gave no peer at all.
- Run uvicorn with ``proxy_headers=False``: its own proxy-header middleware trusts loopback by
  default and would rewrite the peer before this module sees it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

XFF_HEADER = b"x-forwarded-for"


def parse_networks(cidrs: Iterable[str]) -> tuple[IPNetwork, ...]:
    """Parse CIDRs (or bare addresses, taken as /32 or /128); raise ``ValueError`` on a bad one."""
    out: list[IPNetwork] = []
    for raw in cidrs:
        try:
            out.append(ipaddress.ip_network(raw.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"invalid trusted proxy network {raw!r}: {exc}") from exc
    return tuple(out)


def parse_ip(text: str) -> IPAddress | None:
    """One address as proxies write it (``1.2.3.4``, ``1.2.3.4:80``, ``[::1]:80``, ``::1``).

    Returns ``None`` for anything else (``unknown``, an obfuscated RFC 7239 name, garbage).
    """
    s = text.strip().strip('"')
    if not s:
        return None
    if s.startswith("["):
        end = s.find("]")
        if end < 0:
            return None
        s = s[1:end]
    elif s.count(":") == 1:  # IPv4 with a port
        s = s.split(":", 1)[0]
    s = s.split("%", 1)[0]  # an IPv6 zone id says nothing about the client
    try:
        ip = ipaddress.ip_address(s)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class ClientIPResolver:
    """Finds the client address of a request, given the trusted proxy networks.

    ``trusted_proxies`` empty (the default) means X-Forwarded-For is never used.
    """

    def __init__(self, trusted_proxies: Sequence[str] = ()) -> None:
        self.trusted: tuple[IPNetwork, ...] = parse_networks(trusted_proxies)

    def is_trusted(self, ip: IPAddress) -> bool:
        return any(ip.version == net.version and ip in net for net in self.trusted)

    def resolve(self, peer: str | None, forwarded_for: Sequence[str] = ()) -> str | None:
        """The client address from the socket peer and the X-Forwarded-For header values.

        ``forwarded_for`` holds every X-Forwarded-For header of the request, in order (a
        request may carry several; they are one comma-separated list).
        """
        if peer is None:
            return None
        peer_ip = parse_ip(peer)
        if peer_ip is None:
            return peer
        if not self.trusted or not forwarded_for or not self.is_trusted(peer_ip):
            return str(peer_ip)
        hops = [h for value in forwarded_for for h in value.split(",")]
        client = peer_ip
        for raw in reversed(hops):
            if not raw.strip():
                continue
            hop = parse_ip(raw)
            if hop is None:
                break
            client = hop
            if not self.is_trusted(hop):
                break
        return str(client)

    def from_scope(self, scope: Mapping[str, Any]) -> str | None:
        """The client address of an ASGI HTTP or WebSocket scope."""
        peer_info = scope.get("client")
        peer = str(peer_info[0]) if peer_info else None
        if not self.trusted:
            return self.resolve(peer)
        values = [
            v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == XFF_HEADER
        ]
        return self.resolve(peer, values)
