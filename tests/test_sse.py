"""Stream events survive the line splitters of real clients."""

from __future__ import annotations

import json

import httpx

from gateway.sse import sse_event


def test_an_event_with_unicode_line_separators_stays_one_line_for_httpx() -> None:
    """A token that decodes to U+2028, U+2029 or U+0085 (a random-weight model emits them; so
    can a real one) once cut the event in two for httpx's ``aiter_lines`` and so for
    ``edgecloud profile``; it is now escaped and decodes to the same text."""
    text = "a\u2028b\u2029c\x85d é ✓"
    body = sse_event({"choices": [{"text": text}]})
    lines = [ln for ln in httpx._decoders.LineDecoder().decode(body.decode()) if ln]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:])["choices"][0]["text"] == text
    assert "é ✓".encode() in body  # other text stays UTF-8, unescaped
