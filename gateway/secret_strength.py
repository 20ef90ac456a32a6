"""Which secrets are too weak to accept (salts, API keys, node tokens).

A secret (a salt or a node token: what is configured in plain) is refused when any of these
holds, each a cheap sign that it was typed by a person rather than drawn at random:

- it is shorter than :data:`MIN_SECRET_CHARS` characters;
- it is one of :data:`WEAK_KEYS` or :data:`PUBLISHED_SECRETS` (an example once shown in this
  repository's docs);
- it uses fewer than :data:`MIN_CHAR_CLASSES` of the classes lower case, upper case, digits
  and others;
- it has fewer than :data:`MIN_DISTINCT_CHARS` distinct characters, or one character makes up
  more than a third of it;
- it is a shorter string repeated (``passwordpassword``, ``abcabcabc...``);
- once lower-cased with separators dropped, it contains a word of :data:`WEAK_WORDS`
  (``change-me-...``, ``MyPassword2024``).

A secret from ``secrets.token_urlsafe(32)`` (or ``token_hex(16)``) passes every rule with
overwhelming probability. API keys are stored hashed, so only :data:`WEAK_KEYS` can be
checked for them (by hashing each with the salt, :mod:`gateway.auth_config`).

Invariants: a refusal's message names the rule broken, never the secret.
"""

from __future__ import annotations

import re
from collections import Counter

from gateway.api_keys import KEY_PREFIX

MIN_SECRET_CHARS = 16
MIN_CHAR_CLASSES = 2
MIN_DISTINCT_CHARS = 6
GENERATE_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
# Keys refused whatever the salt (the config holds hashes only: these are hashed and compared).
WEAK_KEYS: tuple[str, ...] = (
    "", "admin", "administrator", "root", "password", "passw0rd", "secret", "changeme",
    "change-me", "default", "test", "testing", "demo", "key", "apikey", "api-key", "api_key",
    "token", "letmein", "qwerty", "guest", "user", "1234", "12345", "123456", "12345678",
    "123456789", "0000", "sk-", KEY_PREFIX, "sk-ec-test", "sk-test", "none", "null",
    "hunter2", "a", "1",
)  # fmt: skip
# Secrets once published in this repository's examples: known to everyone who read them.
PUBLISHED_SECRETS: frozenset[str] = frozenset({"change-me-to-a-long-random-salt-0123456789"})
# Words (6+ letters) that give a person-made secret away wherever they appear in it.
WEAK_WORDS: tuple[str, ...] = (
    "password", "passw0rd", "secret", "changeme", "changeit", "replaceme", "default",
    "example", "letmein", "qwerty", "administrator", "welcome", "dragon", "monkey",
    "sunshine", "iloveyou", "trustno1", "abcdef", "hunter",
)  # fmt: skip
_SEPARATORS = re.compile(r"[^0-9a-z]+")


def _classes(secret: str) -> int:
    return (
        any(c.islower() for c in secret)
        + any(c.isupper() for c in secret)
        + any(c.isdigit() for c in secret)
        + any(not c.isalnum() for c in secret)
    )


def _repeated(secret: str) -> bool:
    """True when ``secret`` is a shorter string repeated (its last copy may be cut short)."""
    n = len(secret)
    return any(secret[p:] == secret[: n - p] for p in range(1, n // 2 + 1))


def weakness(secret: str) -> str | None:
    """Why ``secret`` is too weak to use as a salt or node token (the rule it breaks, in
    words that never contain it), or None when it passes every rule of the module."""
    if len(secret) < MIN_SECRET_CHARS:
        return f"it must have at least {MIN_SECRET_CHARS} characters (it has {len(secret)})"
    if secret.lower() in WEAK_KEYS or secret in PUBLISHED_SECRETS:
        return "it is a well-known or published secret"
    if _classes(secret) < MIN_CHAR_CLASSES:
        return (
            f"it uses fewer than {MIN_CHAR_CLASSES} character classes (lower case, upper "
            "case, digits, others)"
        )
    counts = Counter(secret)
    if len(counts) < MIN_DISTINCT_CHARS or max(counts.values()) * 3 > len(secret):
        return "too few distinct characters, or one character repeated too often"
    if _repeated(secret):
        return "it is a shorter string repeated"
    bare = _SEPARATORS.sub("", secret.lower())
    if any(word in bare for word in WEAK_WORDS):
        return "it contains a common word"
    return None


def check_secret(secret: str, what: str) -> str:
    """``secret`` if it passes :func:`weakness`; else ValueError naming ``what`` (e.g.
    ``auth.salt``), the rule broken and how to make a strong one."""
    why = weakness(secret)
    if why is None:
        return secret
    raise ValueError(f"{what} is too weak: {why}; use a long random secret, e.g. {GENERATE_HINT}")


def check_node_token(token: str) -> str:
    """The token, if strong enough to share between gateway and nodes; else ValueError."""
    return check_secret(token, "the node token")
