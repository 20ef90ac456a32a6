"""Where a new request goes in the queue of a node that takes the gateway's order.

An edge keeps prefixes in its slots, and a request whose prompt it holds computes a block or
two where the requests queued ahead compute whole prompts. Left to itself the node lets such a
request pass its queue (``routing.admission``), which breaks the predictions already made for
the requests it passes, and the replay cannot know in advance which ones it will pass. A node
that takes the gateway's order (``NodeState.gateway_order``) admits and prefills in the order
the gateway gives instead, and the gateway places the new request ahead only of the waiting
requests that have room for it: their predictions hold, and its own is made at its place.

Invariants:
- The requests that hold a slot (the first ``slots`` of the queue) are never passed, nor is
  any request ahead of one that may not be passed (the queue keeps its order otherwise).
- A request is passed only by one holding ``PREFIX_FIRST_MIN_BLOCKS`` more leading blocks on
  the node than it does (the node's own rule), and only while what passes it adds to its wait,
  counted as each passer's time in a slot, stays within ``room - 1`` times its predicted time
  to first token, and it has not waited past that prediction already.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from routing.admission import PREFIX_FIRST_MIN_BLOCKS


@dataclass(frozen=True, slots=True)
class Queued:
    """A request of ours in hand on the node, as a pass judges it."""

    held_blocks: int  # leading blocks of its prompt the node held for it when it was sent
    predicted_ttft_ms: float  # its predicted time to first token, from its dispatch
    waited_ms: float  # since its dispatch
    delayed_ms: float  # what requests placed ahead of it since have added to its wait
    started: bool  # its first token has been seen: it holds a slot


def place(
    queue: Sequence[Queued], slots: int, held_blocks: int, hold_ms: float, room: float
) -> int:
    """How many of ``queue`` (in the node's order) the new request goes behind:
    ``len(queue)`` to go last. ``held_blocks`` are the leading blocks of its prompt the node
    holds, ``hold_ms`` its time in a slot (what each request it passes waits more)."""
    k = len(queue)
    while k > max(0, slots):
        w = queue[k - 1]
        if w.started or held_blocks < w.held_blocks + PREFIX_FIRST_MIN_BLOCKS:
            break
        if w.waited_ms > w.predicted_ttft_ms:
            break
        if w.delayed_ms + hold_ms > (room - 1.0) * w.predicted_ttft_ms:
            break
        k -= 1
    return k
