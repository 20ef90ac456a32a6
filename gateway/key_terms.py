"""A key's terms applied to one request: its fair-share tenant, its ``max_tokens`` default
and maximum, the priority it asks for within its key, and the real bound it is charged.

Invariants:
- ``max_tokens_default`` is written into a body naming neither ``max_tokens`` nor
  ``max_completion_tokens`` (so the node and the charge see the same bound); a body asking
  for more than ``max_tokens_limit`` is a 400 ``max_tokens_too_large``, never cut silently.
- The charged bound is prompt tokens plus, per choice, ``max_tokens``, or when absent the
  context the chosen node leaves after the prompt (what the node may really generate).
- A priority is an integer header in ``[-PRIORITY_LIMIT, PRIORITY_LIMIT]`` (higher first,
  within its own key only); anything else is a 400.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gateway.errors import bad_request
from gateway.fair_config import TeamEntry
from gateway.fair_share import Tenant
from routing.fleet.state import NodeState

if TYPE_CHECKING:
    from gateway.auth import KeyIdentity
    from routing.profile import RequestProfile

PRIORITY_HEADER = "x-edgecloud-priority"
PRIORITY_LIMIT = 1000
_MAX_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens")


def tenant_of(identity: KeyIdentity, teams: Mapping[str, TeamEntry]) -> Tenant:
    """The identity as fair share counts it (its team's terms from ``auth.teams``)."""
    team = teams.get(identity.team) if identity.team is not None else None
    return Tenant(
        key=identity.key_id,
        weight=identity.weight,
        max_concurrent=identity.max_concurrent,
        team=identity.team,
        team_weight=team.weight if team else 1.0,
        team_max_concurrent=team.max_concurrent if team else None,
    )


def apply_max_tokens(data: dict[str, Any], identity: KeyIdentity) -> dict[str, Any]:
    """``data`` with the key's ``max_tokens`` terms applied (see the module's invariants)."""
    default, limit = identity.max_tokens_default, identity.max_tokens_limit
    if default is None and limit is None:
        return data
    asked = [data[f] for f in _MAX_TOKEN_FIELDS if isinstance(data.get(f), int)]
    if not asked:
        if default is None:
            return data
        return {**data, "max_tokens": min(default, limit) if limit is not None else default}
    if limit is not None and max(asked) > limit:
        raise bad_request(
            f"max_tokens {max(asked)} is above this key's limit of {limit}",
            code="max_tokens_too_large",
            param="max_tokens",
        )
    return data


def priority_of(headers: Mapping[str, str]) -> int:
    """The request's priority within its key (0 when it names none)."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return 0
    try:
        value = int(raw.strip())
    except ValueError:
        value = PRIORITY_LIMIT + 1
    if abs(value) > PRIORITY_LIMIT:
        raise bad_request(
            f"{PRIORITY_HEADER} must be an integer from {-PRIORITY_LIMIT} to {PRIORITY_LIMIT}",
            code="invalid_priority",
        )
    return value


def charged_bound(prof: RequestProfile, node: NodeState) -> int:
    """Prompt tokens plus the completion the request may really produce on ``node``."""
    if prof.max_tokens is not None:
        completion = int(prof.max_tokens)
    else:
        completion = max(1, node.max_context - prof.prompt_tokens)
    return prof.prompt_tokens + completion * prof.choices


def fleet_slots(nodes: Iterable[NodeState]) -> int:
    """Requests the fleet runs at once: the sum of its nodes' ``max_batch``."""
    return sum(max(1, n.max_batch) for n in nodes)
