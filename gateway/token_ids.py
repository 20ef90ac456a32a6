"""Token ids in a node's SSE stream, for the gateway only (mid-stream resume).

A gateway that may have to resume a stream on another node asks a node for the token ids
behind the text it streams with the request header ``x-edgecloud-token-ids: 1``. A node that
honours it answers with the same header and puts, in front of each content event's ``data:``
line, an SSE comment line::

    : ids 791,2583,30
    data: {"id": ..., "choices": [{"delta": {"content": " the cat"}, ...}]}

Invariants:
- The ids of one event are those whose text that event completes: every id before them went
  out in earlier events; ids that have produced no text yet (an incomplete UTF-8 character,
  a special token) wait for the event whose text they complete.
- A line ending in `` ~`` means the node holds back text after this event (the start of a
  stop string, maybe): the text sent so far does not end on a token boundary there, so a
  stream cut at that point cannot be resumed exactly.
- It is a comment: an SSE client ignores it; the gateway strips it before relaying anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

TOKEN_IDS_HEADER = "x-edgecloud-token-ids"
PREFIX = b": ids "


def ids_line(ids: Sequence[int], clean: bool = True) -> bytes:
    """The comment line (with its newline) that goes in front of an event's ``data:`` line."""
    return PREFIX + ",".join(map(str, ids)).encode() + (b"\n" if clean else b" ~\n")


def take_ids(event: bytes) -> tuple[list[int], bool, bytes] | None:
    """``(ids, clean, the event without the line)`` when ``event`` starts with an ids line,
    else None."""
    if not event.startswith(PREFIX):
        return None
    end = event.find(b"\n")
    if end < 0:
        return None
    line = event[len(PREFIX) : end]
    clean = not line.endswith(b" ~")
    if not clean:
        line = line[:-2]
    try:
        ids = [int(x) for x in line.split(b",")] if line else []
    except ValueError:
        return None
    return ids, clean, event[end + 1 :]
