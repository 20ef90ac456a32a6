"""What every OpenAI body model shares: the strict base model, text without lone surrogates,
the ``unsupported_parameter`` error, and the bound on token counts.

Invariants: models are strict (wrong types are rejected, never coerced: ``"5"`` is not a
``max_tokens``) and accept unknown fields, ignoring them, so newer SDKs keep working; no
``Text`` holds a lone surrogate (``"\\ud800"`` in JSON has no UTF-8 form and no tokenization:
a 400 naming the field, as at OpenAI); a known field we cannot honour is accepted only with
its no-op value and otherwise fails with ``unsupported``, never silently ignored.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

INT32_MAX = 2**31 - 1
MAX_TOKENS_LIMIT = INT32_MAX  # max_tokens / max_completion_tokens; the node's context decides

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(value: str) -> str:
    """``value`` unchanged, or a ValueError if it holds a lone surrogate (no UTF-8 form)."""
    if not value.isascii() and _SURROGATE.search(value) is not None:
        raise ValueError("text must not contain lone surrogates (U+D800 to U+DFFF)")
    return value


Text = Annotated[str, AfterValidator(check_text)]


def unsupported(field: str, what: str) -> PydanticCustomError:
    """The error for a field we cannot honour (code ``unsupported_parameter``)."""
    return PydanticCustomError(
        "unsupported_parameter",
        "'{field}' is not supported: {what}",
        {"field": field, "what": what},
    )


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
