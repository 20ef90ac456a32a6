"""The node token never travels in clear beyond loopback.

Every request the gateway sends to a node carries the node token. Over plain ``http://`` to a
host other than this machine anyone on the path could read it (and then run generations on any
node, or sign fleet records). :class:`PlainTokenGuard` is asked before every request to a node
(:class:`gateway.front.node_client.NodeClient`) and refuses it when all of these hold:

- a node token is set (without one nothing secret is sent);
- the URL's scheme is ``http`` (``https`` is TLS-protected);
- its host is not loopback (127.0.0.0/8, ``::1``, ``localhost``; any other host *name* counts
  as off loopback, since it may resolve anywhere);
- the operator did not set ``insecure_plain_nodes`` (a network trusted end to end).

A refused request fails with ``httpx.ConnectError`` before any byte is sent, so the node is
handled as an unreachable one (failover to the next candidate, its circuit opens, a clear 503
when no node is left); the refusal is logged once per URL and listed in :meth:`warnings`
(``/health``). The embedded default (nodes on 127.0.0.1) is never affected.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

import httpx

from gateway.front.config import is_loopback_host

log = logging.getLogger(__name__)

_MAX_URLS = 4096
_MAX_REFUSED = 256  # base URLs remembered (and logged) as refused; beyond, refused quietly


def _in_clear(url: str) -> bool:
    """True when ``url`` is plain HTTP to a host off loopback (an unparsable URL counts)."""
    try:
        u = urlsplit(url)
        host = u.hostname or ""
    except ValueError:
        return True
    return u.scheme.lower() != "https" and not is_loopback_host(host)


def refusal(url: str) -> str:
    """The message a refused request fails with (names the URL, never the token)."""
    return (
        f"refusing to send the node token in clear to {url} (plain http, not loopback): serve "
        "the node over https ($EDGECLOUD_NODE_TLS on the node, node_tls on the gateway) or, on "
        "a network you trust end to end, set insecure_plain_nodes: true"
    )


class PlainTokenGuard:
    """Decides, per node URL, whether a request carrying the node token may be sent."""

    def __init__(self, has_token: bool, allow_plain: bool) -> None:
        self.active = has_token and not allow_plain
        self._checked: dict[str, bool] = {}  # url -> refused
        self._refused: list[str] = []  # urls refused so far, in order, each once

    def check(self, url: str) -> None:
        """Raise ``httpx.ConnectError`` when a request to ``url`` would send the token in
        clear (see the module); the first refusal of a URL is logged."""
        if not self.active:
            return
        refused = self._checked.get(url)
        if refused is None:
            refused = self._note(url)
        if refused:
            raise httpx.ConnectError(refusal(url))

    def _note(self, url: str) -> bool:
        refused = _in_clear(url)
        if len(self._checked) >= _MAX_URLS:
            self._checked.clear()
        self._checked[url] = refused
        if refused:
            base = _base(url)
            if base not in self._refused and len(self._refused) < _MAX_REFUSED:
                self._refused.append(base)
                log.warning("%s", refusal(base))
        return refused

    def check_known(self, urls: Iterable[str]) -> None:
        """Note the configured node URLs at start, so a refused one is warned of at once."""
        if self.active:
            for url in urls:
                self._note(url)

    def warnings(self) -> list[str]:
        """One line per node base URL refused so far (for ``/health``)."""
        return [refusal(b) for b in self._refused[:32]]


def _base(url: str) -> str:
    """``scheme://host:port`` of a URL (a node's requests differ only in their path)."""
    try:
        u = urlsplit(url)
        return f"{u.scheme}://{u.netloc}"
    except ValueError:
        return url
