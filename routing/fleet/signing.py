"""Signed fleet records: a node's registration and NodeState, HMAC-signed with the node token.

Anyone who can write to the fleet's Redis could otherwise register a node of their own (another
URL under a new id) and receive traffic, prompts and the node token. A node given the node token
stores ``ecsig1:<hex HMAC-SHA256 of the state JSON>:<state JSON>``; a gateway given the same
token reads only records whose HMAC verifies, whose state is not older than its own TTL (plus
:data:`CLOCK_SKEW_S`), and whose URL its allow-list admits (when it has one). The HMAC covers
the whole state (id, URL, time), so a record copied under another id or replayed later names
the same node and time it did.

Invariants: :meth:`RecordSigner.open` never raises for any input; it returns the state JSON or
None. Comparison is constant-time.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
from collections.abc import Sequence

SIGNED_PREFIX = "ecsig1:"
CLOCK_SKEW_S = 5.0


class RecordSigner:
    """Signs and opens fleet records with one shared secret (the node token)."""

    def __init__(self, secret: str) -> None:
        self._key = secret.encode()

    def _mac(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()

    def sign(self, payload: str) -> str:
        """``payload`` (a state's JSON) with its signature in front."""
        return f"{SIGNED_PREFIX}{self._mac(payload)}:{payload}"

    def open(self, raw: str) -> str | None:
        """The signed payload of ``raw``, or None when it is unsigned or its HMAC is wrong."""
        if not raw.startswith(SIGNED_PREFIX):
            return None
        mac, sep, payload = raw[len(SIGNED_PREFIX) :].partition(":")
        if not sep or not hmac.compare_digest(mac, self._mac(payload)):
            return None
        return payload


def unsigned_payload(raw: str) -> str:
    """A record's state JSON, signed or not (a gateway without the node token reads both)."""
    if raw.startswith(SIGNED_PREFIX):
        return raw[len(SIGNED_PREFIX) :].partition(":")[2]
    return raw


def url_allowed(url: str, patterns: Sequence[str]) -> bool:
    """True when no allow-list is set, or ``url`` matches one of its shell patterns."""
    return not patterns or any(fnmatch.fnmatchcase(url, p) for p in patterns)
