"""Pieces of the replies the gateway and nodes write: the ``usage`` object and model cards.

Invariant: ``total_tokens`` is prompt plus completion tokens, and the prompt's cached tokens
are reported as ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached},
    )


def model_card(model_id: str, owned_by: str = "edgecloud") -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": owned_by}
