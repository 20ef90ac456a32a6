"""Server-sent events as the OpenAI streaming API writes them: ``data: <json>`` and a blank line.

The JSON keeps non-ASCII text as UTF-8, except the three characters that line splitters of
common clients take for line breaks although SSE does not (U+0085, U+2028, U+2029: Python's
``str.splitlines``, and so httpx's ``aiter_lines``): those are written as ``\\u`` escapes, so
a token that decodes to one of them cannot cut an event in two. The decoded JSON is the same.
"""

from __future__ import annotations

import json
from typing import Any

_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(obj: Any) -> bytes:
    """One ``data:`` event holding ``obj`` as compact JSON."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"
