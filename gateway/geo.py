"""Where a client is: a geoip2 City or Country database, mapped onto the fleet's region names.

Invariants:
- Construction opens and checks the database; a missing, unreadable, corrupt or unsupported
  file raises :class:`GeoDatabaseError` naming the file and the cause, so a bad deployment
  fails at start-up, not on the first request. The check decodes the first ``check_records``
  records of the file (all of them in a small file).
- :meth:`GeoLocator.locate` never raises. Addresses that are not public (private, loopback,
  link-local, reserved, multicast, shared address space), not valid, not in the database, or
  without any usable location get the configured default region, and the result says why.
  A lookup that hits a corrupt record is logged once and answered with the default region.
- Mapping precedence: subdivision (``"US-CA"``, ISO 3166-2) > country (``"US"``) > continent
  (``"EU"``) > the region nearest to the record's coordinates (only when a ``nearest`` function
  is given and ``nearest_region`` is on; a Country database has no coordinates) > default.
- The database type is read from its metadata: a type naming ``Enterprise`` is read with
  ``enterprise()``, ``City`` with ``city()``, ``Country`` with ``country()``; any other type
  (ASN, ISP, ...) is refused.
- Lookups are cached (LRU, ``cache_size`` entries, keyed by the address text). The cache is
  per locator; the reader is thread-safe.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import geoip2.database
import geoip2.errors
import maxminddb
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.client_ip import parse_ip, parse_networks

log = logging.getLogger(__name__)

Kind = Literal["city", "enterprise", "country"]
Source = Literal["subdivision", "country", "continent", "nearest", "default"]
NearestFn = Callable[[float, float], "str | None"]

_OPEN_ERRORS = (
    OSError,
    ValueError,
    RuntimeError,
    TypeError,
)  # InvalidDatabaseError is a RuntimeError


class GeoDatabaseError(RuntimeError):
    """The geo database could not be used; the message names the file and the cause."""

    def __init__(self, path: Path | str, cause: str) -> None:
        super().__init__(f"geo database {str(path)!r} cannot be used: {cause}")
        self.path = str(path)
        self.cause = cause


class GeoConfig(BaseModel):
    """The ``geo`` section of the gateway config.

    Example::

        geo:
          database: /var/lib/GeoIP/GeoLite2-City.mmdb
          default_region: eu-west
          countries: {US: us-east, CA: us-east, DE: eu-central, GB: eu-west-2}
          subdivisions: {US-CA: us-west, US-WA: us-west}
          continents: {EU: eu-west, AS: ap-southeast}
          nearest_region: true
          trusted_proxies: [10.0.0.0/8]
    """

    model_config = ConfigDict(extra="forbid")

    database: Path | None = Field(
        default=None, description="a geoip2 City or Country .mmdb; none: every client is default"
    )
    default_region: str = Field(default="local", min_length=1)
    countries: dict[str, str] = Field(default_factory=dict, description="ISO country -> region")
    subdivisions: dict[str, str] = Field(
        default_factory=dict, description="ISO 3166-2 code (US-CA) -> region"
    )
    continents: dict[str, str] = Field(default_factory=dict, description="continent -> region")
    nearest_region: bool = Field(
        default=True, description="unmapped clients with coordinates go to the nearest region"
    )
    mode: Literal["auto", "memory"] = "auto"
    cache_size: int = Field(default=65_536, ge=0)
    check_records: int = Field(default=2_000, ge=0, description="records decoded at start-up")
    trusted_proxies: list[str] = Field(
        default_factory=list, description="CIDRs whose X-Forwarded-For is believed"
    )

    @field_validator("countries", "subdivisions", "continents")
    @classmethod
    def _upper_keys(cls, v: dict[str, str]) -> dict[str, str]:
        return {k.strip().upper(): r for k, r in v.items()}

    @field_validator("trusted_proxies")
    @classmethod
    def _valid_cidrs(cls, v: list[str]) -> list[str]:
        parse_networks(v)
        return v


@dataclass(frozen=True, slots=True)
class GeoResult:
    """Where one client address was placed, and on what grounds.

    ``reason`` is set only when ``source == "default"``: ``no_database``, ``no_address``,
    ``invalid_address``, ``not_public``, ``not_found``, ``no_location`` (the record has neither
    a country nor coordinates), ``unmapped`` or ``lookup_error``.
    """

    region: str
    source: Source
    reason: str | None = None
    country: str | None = None
    continent: str | None = None
    subdivision: str | None = None
    latitude: float | None = None
    longitude: float | None = None


def _open_reader(path: Path, mode: str) -> geoip2.database.Reader:
    if not path.exists():
        raise GeoDatabaseError(path, "the file does not exist")
    if not path.is_file():
        raise GeoDatabaseError(path, "not a regular file")
    mode_id = geoip2.database.MODE_MEMORY if mode == "memory" else geoip2.database.MODE_AUTO
    try:
        return geoip2.database.Reader(str(path), mode=mode_id)
    except _OPEN_ERRORS as exc:
        raise GeoDatabaseError(path, f"not a valid MaxMind DB file ({exc})") from exc


def _check_records(path: Path, limit: int) -> None:
    """Decode up to ``limit`` records so a corrupt data section fails now, not per request."""
    if limit <= 0:
        return
    try:
        with maxminddb.open_database(str(path), maxminddb.MODE_AUTO) as reader:
            for n, _ in enumerate(reader, start=1):
                if n >= limit:
                    break
    except _OPEN_ERRORS as exc:
        raise GeoDatabaseError(path, f"corrupt data section ({exc})") from exc


def _kind_of(db_type: str) -> Kind | None:
    if "Enterprise" in db_type:
        return "enterprise"
    if "City" in db_type:
        return "city"
    if "Country" in db_type:
        return "country"
    return None


class GeoLocator:
    """Maps client addresses to region names (see the module invariants).

    ``nearest(lat, lon)`` names the region closest to a point (``RegionTable.nearest`` fits);
    it is used for clients no configured mapping covers.
    """

    def __init__(self, config: GeoConfig, nearest: NearestFn | None = None) -> None:
        self.config = config
        self.default_region = config.default_region
        self._nearest = nearest if config.nearest_region else None
        self._reader: geoip2.database.Reader | None = None
        self._kind: Kind | None = None
        self.database_type: str | None = None
        self.lookup_errors = 0
        if config.database is not None:
            path = config.database
            reader = _open_reader(path, config.mode)
            try:
                db_type = str(reader.metadata().database_type)
                kind = _kind_of(db_type)
                if kind is None:
                    raise GeoDatabaseError(
                        path, f"database type {db_type!r} is neither a City nor a Country database"
                    )
                _check_records(path, config.check_records)
            except BaseException:
                reader.close()
                raise
            self._reader, self._kind, self.database_type = reader, kind, db_type
        self._cached: Callable[[str | None], GeoResult] = (
            functools.lru_cache(maxsize=config.cache_size)(self._locate)
            if config.cache_size
            else self._locate
        )

    # ---- public ------------------------------------------------------------------------------
    def locate(self, ip: str | None) -> GeoResult:
        """Where ``ip`` is (never raises)."""
        return self._cached(ip)

    def region_for(self, ip: str | None) -> str:
        return self._cached(ip).region

    def cache_info(self) -> Any:
        info = getattr(self._cached, "cache_info", None)
        return info() if info else None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def regions(self) -> set[str]:
        """Every region name the configuration can produce (to check against the region table)."""
        c = self.config
        return {
            c.default_region,
            *c.countries.values(),
            *c.subdivisions.values(),
            *c.continents.values(),
        }

    # ---- lookup ------------------------------------------------------------------------------
    def _default(self, reason: str, **fields: Any) -> GeoResult:
        return GeoResult(region=self.default_region, source="default", reason=reason, **fields)

    def _locate(self, ip: str | None) -> GeoResult:
        if self._reader is None:
            return self._default("no_database")
        if ip is None:
            return self._default("no_address")
        addr = parse_ip(ip)
        if addr is None:
            return self._default("invalid_address")
        if not addr.is_global or addr.is_multicast:
            return self._default("not_public")
        try:
            if self._kind == "city":
                rec: Any = self._reader.city(addr)
            elif self._kind == "enterprise":
                rec = self._reader.enterprise(addr)
            else:
                rec = self._reader.country(addr)
        except geoip2.errors.AddressNotFoundError:
            return self._default("not_found")
        except ValueError:
            # The address is valid, so this is an IPv6 address in an IPv4-only database.
            return self._default("not_found")
        except (RuntimeError, TypeError) as exc:  # a corrupt record
            self.lookup_errors += 1
            if self.lookup_errors == 1:
                log.warning("geo database %s: lookup failed (%s)", self.config.database, exc)
            return self._default("lookup_error")
        return self._place(rec)

    def _place(self, rec: Any) -> GeoResult:
        country = rec.country.iso_code or rec.registered_country.iso_code
        continent = rec.continent.code
        subdivision: str | None = None
        lat = lon = None
        if self._kind != "country":
            sub = rec.subdivisions.most_specific.iso_code
            if country and sub:
                subdivision = f"{country}-{sub}"
            lat, lon = rec.location.latitude, rec.location.longitude
        fields: dict[str, Any] = {
            "country": country,
            "continent": continent,
            "subdivision": subdivision,
            "latitude": lat,
            "longitude": lon,
        }
        c = self.config
        rules: tuple[tuple[Source, str | None, dict[str, str]], ...] = (
            ("subdivision", subdivision, c.subdivisions),
            ("country", country, c.countries),
            ("continent", continent, c.continents),
        )
        for source, key, table in rules:
            if key and key in table:
                return GeoResult(region=table[key], source=source, **fields)
        if self._nearest is not None and lat is not None and lon is not None:
            region = self._nearest(lat, lon)
            if region:
                return GeoResult(region=region, source="nearest", **fields)
        if not country and not continent and lat is None:
            return self._default("no_location", **fields)
        return self._default("unmapped", **fields)
