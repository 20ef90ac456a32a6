"""Geo: client IP resolution (trusted proxies only) and geoip2 lookup into region names."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from gateway.client_ip import ClientIPResolver, parse_ip
from gateway.geo import GeoConfig, GeoDatabaseError, GeoLocator
from tests.conftest import SHARED_DATA

GEOIP_DIR = SHARED_DATA / "geoip"

# A tiny stand-in for RegionTable.nearest, so these tests do not depend on its tuning.
POINTS = {"eu-central": (50.1, 8.7), "ap-northeast-2": (37.6, 127.0), "ap-northeast": (35.7, 139.7)}


def nearest(lat: float, lon: float) -> str:
    return min(POINTS, key=lambda r: math.dist(POINTS[r], (lat, lon)))


def city(
    country: str | None = None,
    continent: str | None = None,
    lat: float | None = None,
    lon: float | None = None,
    sub: str | None = None,
) -> dict[str, object]:
    rec: dict[str, object] = {}
    if country:
        rec["country"] = {"iso_code": country, "names": {"en": country}}
    if continent:
        rec["continent"] = {"code": continent}
    if lat is not None:
        rec["location"] = {"latitude": lat, "longitude": lon, "accuracy_radius": 100}
    if sub:
        rec["subdivisions"] = [{"iso_code": sub}]
    return rec


@pytest.fixture(scope="module")
def written_city_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = MMDBWriter(
        ip_version=6,
        ipv4_compatible=True,
        database_type="GeoIP2-City",
        languages=["en"],
        description="edgecloud test city database",
    )
    w.insert_network(IPSet(["5.0.0.0/16"]), city("DE", "EU", 50.1, 8.7))
    w.insert_network(IPSet(["24.0.0.0/16"]), city("US", "NA", 37.4, -122.0, sub="CA"))
    w.insert_network(IPSet(["24.1.0.0/16"]), city("US", "NA", 40.7, -74.0, sub="NY"))
    w.insert_network(IPSet(["41.0.0.0/16"]), city("ZA", "AF", -33.9, 18.4))
    w.insert_network(IPSet(["49.0.0.0/16"]), city("KR", "AS", 37.5, 127.0))
    w.insert_network(IPSet(["62.0.0.0/16"]), {"traits": {"is_anonymous_proxy": True}})
    w.insert_network(IPSet(["77.0.0.0/16"]), {"registered_country": {"iso_code": "GB"}})
    w.insert_network(IPSet(["10.0.0.0/8"]), city("US", "NA", 40.7, -74.0))  # must be ignored
    w.insert_network(IPSet(["2a00:1450::/32"]), city("IE", "EU"))
    path = tmp_path_factory.mktemp("geo") / "test-city.mmdb"
    w.to_db_file(str(path))
    return path


def config(db: Path | None, **kw: object) -> GeoConfig:
    base: dict[str, object] = {
        "database": db,
        "default_region": "eu-west",
        "countries": {"de": "eu-central", "US": "us-east", "IE": "eu-west", "GB": "eu-west-2"},
        "subdivisions": {"US-CA": "us-west", "US-WA": "us-west"},
        "continents": {"AF": "af-south", "AS": "ap-east"},
        "nearest_region": False,
    }
    base.update(kw)
    return GeoConfig.model_validate(base)


def real_db(name: str) -> Path:
    path = GEOIP_DIR / name
    if not path.is_file():
        pytest.skip(f"MaxMind test database {name} not found in {GEOIP_DIR} (../shared/data/geoip)")
    return path


# ---- a database written in the test ------------------------------------------------------------
def test_written_city_db_places_clients_in_regions(written_city_db: Path) -> None:
    geo = GeoLocator(config(written_city_db))
    assert geo.database_type == "GeoIP2-City"
    r = geo.locate("5.0.3.4")
    assert (r.region, r.source, r.country, r.continent) == ("eu-central", "country", "DE", "EU")
    assert r.latitude == pytest.approx(50.1) and r.longitude == pytest.approx(8.7)
    # A subdivision mapping beats the country mapping; an unmapped subdivision uses the country.
    r = geo.locate("24.0.9.9")
    assert (r.region, r.source, r.subdivision) == ("us-west", "subdivision", "US-CA")
    assert (geo.locate("24.1.0.1").region, geo.locate("24.1.0.1").source) == ("us-east", "country")
    # Continent mapping for an unmapped country.
    assert (geo.locate("41.0.0.1").region, geo.locate("41.0.0.1").source) == (
        "af-south",
        "continent",
    )
    # Only the registered country is known.
    assert geo.locate("77.0.1.1").region == "eu-west-2"
    # IPv6 and an IPv4-mapped IPv6 address.
    assert geo.locate("2a00:1450:4001::1").region == "eu-west"
    assert geo.locate("::ffff:5.0.3.4").region == "eu-central"
    # A record with no country, no continent and no coordinates.
    r = geo.locate("62.0.0.5")
    assert (r.region, r.source, r.reason) == ("eu-west", "default", "no_location")
    # Not in the database at all.
    r = geo.locate("8.8.8.8")
    assert (r.region, r.reason) == ("eu-west", "not_found")


def test_nearest_region_for_unmapped_clients(written_city_db: Path) -> None:
    cfg = config(written_city_db, continents={}, nearest_region=True)
    geo = GeoLocator(cfg, nearest=nearest)
    r = geo.locate("49.0.0.1")  # KR, Seoul coordinates, no mapping
    assert (r.region, r.source) == ("ap-northeast-2", "nearest")
    # Without the nearest function (or with the knob off) it is the default.
    assert GeoLocator(cfg).locate("49.0.0.1").reason == "unmapped"
    off = GeoLocator(config(written_city_db, continents={}), nearest=nearest)
    assert off.locate("49.0.0.1").region == "eu-west"


@pytest.mark.parametrize(
    "ip",
    [
        "10.1.2.3",  # private, although the database has a record for it
        "192.168.1.20",
        "172.16.0.1",
        "127.0.0.1",
        "100.64.0.1",  # carrier-grade NAT
        "169.254.1.1",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fd00::1",
        "::ffff:10.1.2.3",
    ],
)
def test_non_public_addresses_get_the_default_region(written_city_db: Path, ip: str) -> None:
    r = GeoLocator(config(written_city_db)).locate(ip)
    assert (r.region, r.source, r.reason) == ("eu-west", "default", "not_public")
    assert r.country is None


def test_invalid_or_missing_address_and_no_database(written_city_db: Path) -> None:
    geo = GeoLocator(config(written_city_db))
    assert geo.locate("not-an-ip").reason == "invalid_address"
    assert geo.locate(None).reason == "no_address"
    none = GeoLocator(config(None))
    r = none.locate("5.0.3.4")
    assert (r.region, r.reason) == ("eu-west", "no_database")


def test_lookups_are_cached(written_city_db: Path) -> None:
    geo = GeoLocator(config(written_city_db, cache_size=8))
    for _ in range(3):
        assert geo.region_for("5.0.3.4") == "eu-central"
    info = geo.cache_info()
    assert (info.hits, info.misses, info.maxsize) == (2, 1, 8)


# ---- the real MaxMind test databases ------------------------------------------------------------
@pytest.mark.parametrize("name", ["GeoIP2-City-Test.mmdb", "GeoLite2-City-Test.mmdb"])
def test_real_city_databases(name: str) -> None:
    cfg = config(real_db(name), mode="memory", nearest_region=True, continents={})
    geo = GeoLocator(cfg, nearest=nearest)
    assert "City" in (geo.database_type or "")
    london = geo.locate("81.2.69.142")
    assert (london.region, london.country, london.continent) == ("eu-west-2", "GB", "EU")
    assert london.latitude == pytest.approx(51.5142)
    milton = geo.locate("216.160.83.57")  # Milton, Washington: the US-WA mapping
    assert (milton.region, milton.source, milton.subdivision) == ("us-west", "subdivision", "US-WA")
    tokyo = geo.locate("2001:218::1")  # JP, unmapped: nearest region by coordinates
    assert (tokyo.region, tokyo.source, tokyo.country) == ("ap-northeast", "nearest", "JP")
    assert geo.locate("8.8.8.8").reason == "not_found"
    assert geo.locate("192.168.0.1").reason == "not_public"


def test_real_country_database_has_no_coordinates() -> None:
    cfg = config(real_db("GeoLite2-Country-Test.mmdb"), nearest_region=True)
    geo = GeoLocator(cfg, nearest=nearest)
    assert geo.database_type == "GeoLite2-Country"
    r = geo.locate("89.160.20.115")  # SE, unmapped country, EU continent unmapped
    assert (r.region, r.source, r.reason, r.country) == ("eu-west", "default", "unmapped", "SE")
    assert r.latitude is None
    assert geo.locate("81.2.69.142").region == "eu-west-2"
    r = geo.locate("2001:218::1")  # JP, unmapped: continent AS; no coordinates to be nearest to
    assert (r.region, r.source, r.country) == ("ap-east", "continent", "JP")
    assert geo.locate("216.160.83.57").region == "us-east"  # no subdivisions in a Country db


# ---- start-up errors ---------------------------------------------------------------------------
def test_corrupt_database_is_a_clear_startup_error() -> None:
    path = real_db("GeoIP2-City-Test-Broken-Double-Format.mmdb")
    with pytest.raises(GeoDatabaseError) as exc:
        GeoLocator(config(path))
    msg = str(exc.value)
    assert "GeoIP2-City-Test-Broken-Double-Format.mmdb" in msg
    assert "corrupt" in msg
    assert exc.value.path == str(path)


def test_missing_garbage_or_wrong_type_database(tmp_path: Path) -> None:
    with pytest.raises(GeoDatabaseError, match="does not exist"):
        GeoLocator(config(tmp_path / "nope.mmdb"))
    garbage = tmp_path / "garbage.mmdb"
    garbage.write_bytes(b"this is not a MaxMind database" * 10)
    with pytest.raises(GeoDatabaseError, match=r"garbage\.mmdb.*not a valid MaxMind DB"):
        GeoLocator(config(garbage))
    with pytest.raises(GeoDatabaseError, match="not a regular file"):
        GeoLocator(config(tmp_path))
    w = MMDBWriter(ip_version=4, database_type="GeoLite2-ASN")
    w.insert_network(IPSet(["5.0.0.0/16"]), {"autonomous_system_number": 3320})
    asn = tmp_path / "asn.mmdb"
    w.to_db_file(str(asn))
    with pytest.raises(GeoDatabaseError, match="neither a City nor a Country"):
        GeoLocator(config(asn))


# ---- client IP ---------------------------------------------------------------------------------
def test_parse_ip_forms() -> None:
    assert str(parse_ip("203.0.113.9:5123")) == "203.0.113.9"
    assert str(parse_ip("[2001:db8::1]:443")) == "2001:db8::1"
    assert str(parse_ip(" 2001:db8::1 ")) == "2001:db8::1"
    assert str(parse_ip("::ffff:198.51.100.1")) == "198.51.100.1"
    assert parse_ip("unknown") is None
    assert parse_ip("_hidden") is None
    assert parse_ip("") is None


def test_resolver_walks_forwarded_for_right_to_left() -> None:
    res = ClientIPResolver(["10.0.0.0/8", "192.168.1.1", "fd00::/8"])
    # Untrusted peer: the header is ignored whatever it says.
    assert res.resolve("198.51.100.7", ["5.0.3.4"]) == "198.51.100.7"
    # Trusted peer: the nearest untrusted hop is the client; hops on the left are not believed.
    assert res.resolve("10.0.0.2", ["1.2.3.4, 5.0.3.4, 10.9.9.9"]) == "5.0.3.4"
    # Several header lines are one list.
    assert res.resolve("10.0.0.2", ["1.2.3.4", "5.0.3.4:8080"]) == "5.0.3.4"
    assert res.resolve("192.168.1.1", ["[2a00:1450::5]:443"]) == "2a00:1450::5"
    # Every hop trusted: the leftmost.
    assert res.resolve("10.0.0.2", ["10.1.1.1, 10.2.2.2"]) == "10.1.1.1"
    # A malformed hop stops the walk at the last good one.
    assert res.resolve("10.0.0.2", ["5.0.3.4, garbage, 10.3.3.3"]) == "10.3.3.3"
    assert res.resolve("10.0.0.2", []) == "10.0.0.2"
    assert res.resolve("fd00::5", ["24.0.1.1"]) == "24.0.1.1"
    # No peer, or a peer that is not an address.
    assert res.resolve(None, ["5.0.3.4"]) is None
    assert res.resolve("testclient", ["5.0.3.4"]) == "testclient"
    # No trusted proxies: never read.
    assert ClientIPResolver().resolve("10.0.0.2", ["5.0.3.4"]) == "10.0.0.2"


def test_bad_trusted_proxy_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"10\.0\.0\.0/33"):
        ClientIPResolver(["10.0.0.0/33"])
    with pytest.raises(ValueError, match=r"10\.0\.0\.0/33"):
        GeoConfig(trusted_proxies=["10.0.0.0/33"])


def _geo_app(geo: GeoLocator, resolver: ClientIPResolver) -> FastAPI:
    app = FastAPI()

    @app.get("/where")
    async def where(request: Request) -> dict[str, str | None]:
        ip = resolver.from_scope(request.scope)
        return {"ip": ip, "region": geo.region_for(ip)}

    return app


async def _where(app: FastAPI, peer: str, headers: dict[str, str]) -> dict[str, str]:
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        resp = await client.get("/where", headers=headers)
    assert resp.status_code == 200
    return resp.json()


async def test_spoofed_forwarded_for_is_ignored_through_an_app(written_city_db: Path) -> None:
    geo = GeoLocator(config(written_city_db))
    app = _geo_app(geo, ClientIPResolver(["10.0.0.0/8"]))
    spoof = {"X-Forwarded-For": "5.0.3.4"}
    # A client in the US (24.1/16) claims to be in Germany: ignored.
    assert await _where(app, "24.1.2.3", spoof) == {"ip": "24.1.2.3", "region": "us-east"}
    # The same header from our load balancer is believed.
    assert await _where(app, "10.0.0.9", spoof) == {"ip": "5.0.3.4", "region": "eu-central"}
    # A client can prepend a fake hop; the proxy appends the real peer, which wins.
    chain = {"X-Forwarded-For": "5.0.3.4, 24.0.5.5"}
    assert await _where(app, "10.0.0.9", chain) == {"ip": "24.0.5.5", "region": "us-west"}


def test_enterprise_database_is_read_like_a_city_one(tmp_path: Path) -> None:
    w = MMDBWriter(ip_version=4, database_type="GeoIP2-Enterprise")
    w.insert_network(IPSet(["24.0.0.0/16"]), city("US", "NA", 37.4, -122.0, sub="CA"))
    path = tmp_path / "enterprise.mmdb"
    w.to_db_file(str(path))
    geo = GeoLocator(config(path))
    r = geo.locate("24.0.1.1")
    assert (r.region, r.source, r.latitude) == ("us-west", "subdivision", pytest.approx(37.4))
    assert geo.locate("2a00:1450::1").reason == "not_found"  # IPv6 in an IPv4-only database
