"""API keys and their stored form.

Invariants:
- Keys are never stored or logged, only ``hash_key(key, salt)``: ``hmac-sha256:<hex>``, an
  HMAC-SHA256 of the key under a per-deployment secret salt. Keys made by :func:`generate_key`
  carry 256 random bits, so a fast keyed hash is as strong as a slow one, and keeps the check
  at a few microseconds on the hot path.
- :func:`valid_hash` accepts exactly the form :func:`hash_key` makes (lower-cased, trimmed).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

KEY_PREFIX = "sk-ec-"
HASH_SCHEME = "hmac-sha256"
_HASH_RE = re.compile(rf"^{HASH_SCHEME}:[0-9a-f]{{64}}$")


def generate_key() -> str:
    """A new API key: ``sk-ec-`` and 43 URL-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str, salt: str) -> str:
    """The stored form of ``key`` under this deployment's ``salt`` (``hmac-sha256:<hex>``)."""
    digest = hmac.new(salt.encode(), key.encode(), hashlib.sha256).hexdigest()
    return f"{HASH_SCHEME}:{digest}"


def valid_hash(v: str) -> str:
    """``v`` normalised if it is a stored key form (``hmac-sha256:<64 hex>``); else ValueError."""
    v = v.strip().lower()
    if not _HASH_RE.match(v):
        raise ValueError(f"key_hash must look like '{HASH_SCHEME}:<64 hex digits>' (see hash_key)")
    return v
