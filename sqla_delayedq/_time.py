"""UTC time: the column type, validation of arguments, and the injectable clock.

The API takes and returns timezone-aware UTC datetimes. Storage keeps microseconds on every
backend (``timestamptz`` on PostgreSQL, ``DATETIME(6)`` on MariaDB/MySQL, ISO text on SQLite),
the same precision as Python's ``datetime``, so every value round-trips exactly and an identical
re-offer compares equal.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sqlalchemy import DateTime
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

from ._engine import Family, family
from .errors import InvalidArgument


def _utc_zones() -> frozenset[tzinfo]:
    """Zones that are UTC under another name (none where there is no time zone database)."""
    zones: set[tzinfo] = set()
    for name in ("UTC", "Etc/UTC", "Etc/UCT", "UCT", "Etc/Universal", "Zulu"):
        try:
            zones.add(ZoneInfo(name))
        except (ZoneInfoNotFoundError, ValueError):
            continue
    return frozenset(zones)


#: A value in one of these needs no conversion, only relabelling as UTC.
_UTC_ZONES = _utc_zones()

Clock = Callable[[], datetime]
"""A zero-argument callable returning the current time as an aware datetime."""


def system_clock() -> datetime:
    """The wall clock, in UTC."""
    return datetime.now(UTC)


def require_aware(value: datetime, name: str = "datetime") -> datetime:
    """Return ``value`` in UTC; reject naive datetimes with :class:`InvalidArgument`."""
    if not isinstance(value, datetime):
        raise InvalidArgument(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(
            f"{name} is a naive datetime ({value.isoformat()}); pass an aware one, "
            "e.g. datetime.now(timezone.utc)"
        )
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise InvalidArgument(f"{name} ({value.isoformat()}) is out of range in UTC") from None


def require_duration(
    value: timedelta, name: str, *, allow_zero: bool = False, most: timedelta | None = None
) -> timedelta:
    """Validate a lease or delay: a ``timedelta`` that is positive (or zero when allowed), and
    at most ``most`` when given."""
    if not isinstance(value, timedelta):
        raise InvalidArgument(f"{name} must be a timedelta, got {type(value).__name__}")
    if value < timedelta(0) or (value == timedelta(0) and not allow_zero):
        raise InvalidArgument(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    if most is not None and value > most:
        raise InvalidArgument(f"{name} must be at most {most.days} days, got {value}")
    return value


#: The longest duration added to or taken from the current time (a lease, a retention, an
#: aging, a look-ahead, a rate's period): from any time between the years 1000 and 9000 the
#: result is still a time a datetime holds (years 1 to 9999), and MariaDB's ``DATETIME`` too.
#: A longer one was accepted and then failed every take, prune or pass with an OverflowError.
LONGEST = timedelta(days=365_000)


def require_lease(value: timedelta, name: str = "lease") -> timedelta:
    """Validate a lease (a queue's, a registration's, a take's or an extension's): positive,
    and at most :data:`LONGEST`."""
    return require_duration(value, name, most=LONGEST)


class DateTimeUTC(TypeDecorator[datetime]):
    """A timestamp column that only accepts aware datetimes and always returns UTC ones."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> Any:
        if family(dialect) is Family.MYSQL:
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(DateTime(timezone=True))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = require_aware(value)
        if family(dialect) is Family.POSTGRESQL:
            return value
        return value.replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        tz = value.tzinfo if isinstance(value, datetime) else False
        if tz is UTC:
            return value  # type: ignore[no-any-return]
        if tz in _UTC_ZONES:  # psycopg's ZoneInfo("Etc/UTC") on a server in UTC
            return value.replace(tzinfo=UTC)  # type: ignore[no-any-return]
        if tz is None:
            return value.replace(tzinfo=UTC)  # type: ignore[no-any-return]
        if tz is False:  # SQLite returns text when read through a raw expression
            return datetime.fromisoformat(value).replace(tzinfo=UTC)
        return value.astimezone(UTC)  # type: ignore[no-any-return]
