"""Every node reports its Node API version in NodeState; a gateway's router skips nodes of
another major version and says so (a warning once per node and version, and the reason
``api_version`` among the nodes left out)."""

from __future__ import annotations

import logging

import pytest

from routing.fleet.state import NODE_API_VERSION, NodeState, api_compatible, api_major
from routing.policies import NoRoute
from tests.test_routing_policies import cloud, edge, profile, router, view


def test_versions_compare_by_major() -> None:
    major = api_major(NODE_API_VERSION)
    assert major is not None
    assert api_compatible(f"{major}.7") and not api_compatible(f"{major + 1}.0")
    assert not api_compatible("garbage") and api_major("garbage") is None


def test_a_state_without_the_field_reads_as_the_first_version() -> None:
    state = edge().model_dump(mode="json")
    del state["api_version"]
    assert NodeState.model_validate(state).api_version == "1.0"


def test_router_skips_another_major_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    newer = f"{api_major(NODE_API_VERSION) + 1}.0"
    fleet = view(edge(api_version=newer), cloud())
    r = router()
    with caplog.at_level(logging.WARNING, logger="routing.router"):
        d = r.decide(profile(40), fleet)
        r.decide(profile(40), fleet)
    assert d.node_id == "cloud-us"  # the edge would have won (tests.test_routing_policies)
    _, left_out = r.candidates(profile(40), fleet)
    assert left_out == {"edge-eu": "api_version"}
    warnings = [rec.getMessage() for rec in caplog.records if "edge-eu" in rec.getMessage()]
    assert len(warnings) == 1 and f"Node API {newer}" in warnings[0]
    with pytest.raises(NoRoute) as err:
        r.decide(profile(40), view(edge(api_version=newer)))
    assert err.value.code == "unavailable"
