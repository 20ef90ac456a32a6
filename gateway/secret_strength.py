"""Which secrets are too weak to accept (salts, API keys, node tokens).

Invariants:
- A secret shorter than :data:`MIN_SECRET_CHARS` characters, or one of :data:`WEAK_KEYS`, is
  refused; the refusal's message never contains the secret.
"""

from __future__ import annotations

from gateway.api_keys import KEY_PREFIX

MIN_SECRET_CHARS = 16
# Keys refused whatever the salt (the config holds hashes only: these are hashed and compared).
WEAK_KEYS: tuple[str, ...] = (
    "", "admin", "administrator", "root", "password", "passw0rd", "secret", "changeme",
    "change-me", "default", "test", "testing", "demo", "key", "apikey", "api-key", "api_key",
    "token", "letmein", "qwerty", "guest", "user", "1234", "12345", "123456", "12345678",
    "123456789", "0000", "sk-", KEY_PREFIX, "sk-ec-test", "sk-test", "none", "null",
)  # fmt: skip


def check_node_token(token: str) -> str:
    """The token, if strong enough to share between gateway and nodes; else ValueError."""
    if len(token) < MIN_SECRET_CHARS or token.lower() in WEAK_KEYS:
        raise ValueError(
            f"the node token must have at least {MIN_SECRET_CHARS} characters and not be a "
            "well-known word (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token
