"""Generated JSON schemas for structured-output tests and bench/structured.py: nested objects,
arrays, enums, numbers with bounds, required and optional fields, ``anyOf``; each with a
prompt asking for it. Deterministic: schema ``i`` is the same on every run."""

from __future__ import annotations

import json
import random
from typing import Any

_WORDS = [
    "name", "city", "title", "color", "status", "score", "count", "price", "tags", "owner",
    "level", "kind", "items", "notes", "year", "rating", "email", "size", "author", "label",
]  # fmt: skip
_ENUMS = [["red", "green", "blue"], ["low", "medium", "high"], ["cat", "dog"], ["yes", "no"]]


def _leaf(rng: random.Random) -> dict[str, Any]:
    pick = rng.randrange(6)
    if pick == 0:
        return {"type": "string", "maxLength": rng.choice([8, 16, 32])}
    if pick == 1:
        lo = rng.randrange(0, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randrange(1, 1000)}
    if pick == 2:
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if pick == 3:
        return {"type": "string", "enum": rng.choice(_ENUMS)}
    if pick == 4:
        return {"type": "boolean"}
    return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    pick = rng.randrange(10)
    if depth < 2 and pick < 2:
        return _object(rng, depth + 1)
    if depth < 2 and pick < 4:
        return {
            "type": "array",
            "items": _leaf(rng) if rng.random() < 0.7 else _object(rng, depth + 1),
            "maxItems": rng.choice([2, 3, 4]),
        }
    if pick == 4:
        return {"anyOf": [_leaf(rng), _leaf(rng)]}
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = rng.sample(_WORDS, rng.randrange(1, 5 if depth else 6))
    props = {k: _node(rng, depth) for k in keys}
    required = [k for k in keys if rng.random() < 0.7] or keys[:1]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def schema(i: int) -> dict[str, Any]:
    """Schema number ``i`` (an object at the top)."""
    return _object(random.Random(48_000 + i), 0)


def prompt(s: dict[str, Any]) -> str:
    """A user message asking for a JSON reply that follows ``s``."""
    return (
        "Reply with one JSON object that follows this JSON schema, and nothing else.\n"
        + json.dumps(s)
    )
