"""Cache scopes: which tenants may share prefix-cache blocks, and the salt that says so.

A request's prefix block hashes are seeded by its model and its cache scope
(:func:`routing.blocks.scope_seed`), in the gateway's index and in both engines (the node
gets the salt in ``x-edgecloud-cache-salt``), so one scope's prefixes are never credited,
reused or reported to another.

Invariants:
- ``cache_scope: key`` (the default) gives every key its own scope; ``team`` one per team
  (a key without a team is its own); ``global`` one for everyone (no salt).
- The anonymous identity (authentication off: the embedded default) is one scope with the
  empty salt, so its hashes are the model's own and nothing is added to the request path.
- A salt is an HMAC of the scope's name under the deployment's secret (``auth.salt``): it
  cannot be derived from a key's or team's name without that secret. Salts are cached per
  identity name (bounded).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

from gateway.auth import KeyIdentity

CacheScope = Literal["key", "team", "global"]

_MAX_CACHED = 10_000


class CacheScopes:
    """The cache salt of each caller, under one ``cache_scope`` setting and secret."""

    def __init__(self, scope: CacheScope, secret: str) -> None:
        self.scope = scope
        self._secret = secret.encode()
        self._salts: dict[tuple[str, str | None], str] = {}

    def scope_name(self, who: KeyIdentity) -> str | None:
        """The name of ``who``'s scope (None: the one shared scope)."""
        if self.scope == "global" or who.source == "anonymous":
            return None
        if self.scope == "team" and who.team:
            return f"team:{who.team}"
        return f"key:{who.name}"

    def salt(self, who: KeyIdentity) -> str:
        """``who``'s cache salt: the empty string for the one shared scope."""
        cache_key = (who.name, who.team)
        found = self._salts.get(cache_key)
        if found is not None:
            return found
        name = self.scope_name(who)
        salt = (
            ""
            if name is None
            else hmac.new(
                self._secret, b"cache-scope:" + name.encode(), hashlib.sha256
            ).hexdigest()[:32]
        )
        if len(self._salts) >= _MAX_CACHED:
            self._salts.clear()
        self._salts[cache_key] = salt
        return salt
