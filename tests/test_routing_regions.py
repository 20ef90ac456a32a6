"""RegionTable: great-circle RTT estimates, overrides, and correction by measurement."""

from __future__ import annotations

import pytest

from routing.regions import Region, RegionKnobs, RegionTable, RttOverride, great_circle_km


def test_great_circle_distance():
    london, new_york = Region("l", 51.5074, -0.1278), Region("n", 40.7128, -74.0060)
    assert great_circle_km(london, new_york) == pytest.approx(5570, rel=0.01)
    assert great_circle_km(london, london) == 0.0


def test_estimates_are_symmetric_and_grow_with_distance():
    t = RegionTable()
    assert t.rtt_ms("eu-west", "eu-west") == 2.0
    assert t.rtt_ms("eu-west", "us-east") == t.rtt_ms("us-east", "eu-west")
    # Dublin - Virginia is about 5,450 km: 2 * 5450 * 1.5 / 200 + 2 = 84 ms.
    assert t.rtt_ms("eu-west", "us-east") == pytest.approx(84, abs=3)
    assert t.rtt_ms("eu-west", "eu-central") < t.rtt_ms("eu-west", "us-east")
    assert t.rtt_ms("eu-west", "us-east") < t.rtt_ms("eu-west", "ap-southeast-2")
    assert t.rtt_ms("eu-west", "atlantis") == 80.0  # unknown region
    assert t.rtt_ms("atlantis", "atlantis") == 2.0


def test_config_regions_and_overrides():
    knobs = RegionKnobs(
        table={"office-paris": (48.86, 2.35)},
        rtt_overrides=[RttOverride(a="us-east", b="eu-west", ms=70.0)],
        unknown_rtt_ms=120.0,
    )
    t = RegionTable(knobs)
    assert t.rtt_ms("eu-west", "us-east") == 70.0
    assert t.rtt_ms("office-paris", "eu-west-3") == pytest.approx(2.0, abs=1.0)
    assert t.rtt_ms("x", "eu-west") == 120.0
    t.observe("us-east", "eu-west", 500.0)
    assert t.rtt_ms("eu-west", "us-east") == 70.0  # an override is never corrected


def test_measurements_correct_the_pair_and_everything_unmeasured():
    t = RegionTable()
    est_us = t.rtt_ms("eu-west", "us-east")
    est_ap = t.rtt_ms("eu-west", "ap-northeast")
    t.observe("us-east", "eu-west", 2 * est_us)
    assert t.rtt_ms("eu-west", "us-east") == pytest.approx(2 * est_us)
    assert t.correction == pytest.approx(2.0)
    assert t.rtt_ms("eu-west", "ap-northeast") == pytest.approx(2 * est_ap)
    t.observe("eu-west", "us-east", est_us)  # EWMA with alpha 0.2
    assert t.rtt_ms("eu-west", "us-east") == pytest.approx(1.8 * est_us)
    assert t.correction == pytest.approx(1.8)
    # Reconfiguring (hot reload) keeps what was measured.
    t.configure(RegionKnobs(unknown_rtt_ms=90.0))
    assert t.rtt_ms("eu-west", "us-east") == pytest.approx(1.8 * est_us)
    t.observe("eu-west", "us-east", float("nan"))  # ignored
    assert t.rtt_ms("eu-west", "us-east") == pytest.approx(1.8 * est_us)


def test_nearest_region():
    t = RegionTable()
    assert t.nearest(52.52, 13.40) == "eu-central"  # Berlin
    assert t.nearest(35.0, 135.8) == "ap-northeast"  # Kyoto
    assert t.nearest(52.52, 13.40, among=["us-east", "eu-west"]) == "eu-west"
    assert t.nearest(0, 0, among=[]) is None
