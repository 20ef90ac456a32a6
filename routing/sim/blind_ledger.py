""":class:`BlindLedger`, the in-flight ledger of the staleness study's "without the correction":
the simulator swaps it in for each router's when ``count_in_flight=False``. Invariant: it keeps
its entries, so ``Router.finish`` learns as with the real ledger, but every read of what is in
flight or expected reports nothing, so decisions see only the nodes' last pushed counts.
"""

from __future__ import annotations

from routing.backlog import Arrivals, Work
from routing.ledger import DispatchLedger


class BlindLedger(DispatchLedger):
    """A ledger that keeps its entries (so ``finish`` learns) but tells ``candidates``
    nothing about them: decisions see only the node's last pushed counts."""

    def in_flight(self, node_id: str) -> int:
        return 0

    def since(self, node_id: str, t: float) -> int:
        return 0

    def work(self, node_id: str, now: float, *args: object, **kwargs: object) -> list[Work]:
        """Nothing in hand, however read (the signature accepts every call of the ledger's
        own, so that a new way of reading it cannot break the blind one)."""
        return []

    def arrivals(self, *args: object, **kwargs: object) -> Arrivals | None:
        """Nothing expected, whatever is asked (the signature accepts every call of the
        ledger's own)."""
        return None
