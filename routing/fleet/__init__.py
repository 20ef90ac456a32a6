"""The fleet contract: NodeState and the store that holds every node's state."""

from routing.fleet.state import NodeKind, NodeState

__all__ = ["NodeKind", "NodeState"]
