"""Schedules of the cron service: when ticks happen, as timezone-aware UTC datetimes.

Three kinds, all frozen dataclasses:

- :class:`PeriodicTick` every ``period``, aligned to the Unix epoch in UTC (a one-hour period
  ticks on the hour, a one-day period at midnight UTC), so every installer computes the same
  instants whenever it starts;
- :class:`DailySchedule` at given wall-clock times of day in a time zone;
- :class:`CronSchedule` a cron expression, parsed by ``croniter``, in a time zone.

Wall-clock schedules (daily and cron) name local times. Two kinds of local time need a rule when
the clocks change, and the rule is the same for both kinds:

- a time that does not exist (spring forward, e.g. 03:30 in Europe/Bucharest on the last Sunday
  of March) is **shifted forward by the length of the gap**: it fires at 04:30 local time, the
  instant it would have had under the old offset (``fold=0`` in PEP 495 terms);
- a time that exists twice (fall back, e.g. 03:30 on the last Sunday of October) **fires once**,
  at its first occurrence (``fold=0``, the summer-time instant).

So a daily job fires exactly once every day, and a job every N minutes stays every N minutes of
real time across the spring gap, while the repeated hour in autumn is not run twice. A job that
must follow elapsed time through the autumn hour as well should use :class:`PeriodicTick` or a
cron expression in ``UTC``.

Tick times have whole-second precision: they name the message keys.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, ClassVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ._time import LONGEST, require_aware, require_duration
from .errors import InvalidArgument

__all__ = ["CronSchedule", "DailySchedule", "PeriodicTick", "Schedule"]

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO = timedelta(microseconds=1)
_SECOND = timedelta(seconds=1)


class Schedule(abc.ABC):
    """When ticks happen. Subclasses are frozen dataclasses, so configurations hash stably."""

    kind: ClassVar[str]

    @abc.abstractmethod
    def canonical(self) -> dict[str, Any]:
        """A JSON-ready description that is equal exactly for equivalent schedules."""

    @abc.abstractmethod
    def between(self, start: datetime, end: datetime, limit: int | None = None) -> list[datetime]:
        """Tick times ``t`` with ``start <= t < end``, ascending, at most ``limit`` of them."""

    @abc.abstractmethod
    def latest_before(self, end: datetime, not_before: datetime) -> datetime | None:
        """The latest tick ``t`` with ``not_before <= t < end``, or None."""


def _bounds(start: datetime, end: datetime) -> tuple[datetime, datetime]:
    return require_aware(start, "start"), require_aware(end, "end")


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise InvalidArgument(f"limit must be a positive integer or None, got {limit!r}")


@dataclass(frozen=True)
class PeriodicTick(Schedule):
    """A tick every ``period`` (whole seconds, at least one), aligned to the epoch in UTC."""

    period: timedelta
    kind: ClassVar[str] = "periodic"

    def __post_init__(self) -> None:
        require_duration(self.period, "period", most=LONGEST)
        if self.period < _SECOND or self.period % _SECOND:
            raise InvalidArgument(
                f"period must be a whole number of seconds, at least one; got {self.period}"
            )

    def canonical(self) -> dict[str, Any]:
        return {"kind": self.kind, "period_seconds": self.period // _SECOND}

    def between(self, start: datetime, end: datetime, limit: int | None = None) -> list[datetime]:
        start, end = _bounds(start, end)
        _check_limit(limit)
        p = self.period // _MICRO
        k = -(-((start - EPOCH) // _MICRO) // p)  # ceiling: the first tick at or after start
        ticks: list[datetime] = []
        tick = EPOCH + k * self.period
        while tick < end and (limit is None or len(ticks) < limit):
            ticks.append(tick)
            tick += self.period
        return ticks

    def latest_before(self, end: datetime, not_before: datetime) -> datetime | None:
        not_before, end = _bounds(not_before, end)
        k = ((end - EPOCH) // _MICRO - 1) // (self.period // _MICRO)
        tick = EPOCH + k * self.period
        return tick if tick >= not_before else None


def _zone(tz: Any) -> ZoneInfo:
    if not isinstance(tz, str) or not tz:
        raise InvalidArgument(f"tz must be an IANA time zone name like 'Europe/Bucharest': {tz!r}")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidArgument(f"unknown time zone {tz!r}: {exc}") from None


def _local(instant: datetime, zone: ZoneInfo) -> datetime:
    """The naive wall-clock time of an instant in ``zone``."""
    return instant.astimezone(zone).replace(tzinfo=None, fold=0)


def _to_utc(wall: datetime, zone: ZoneInfo) -> datetime:
    """A naive wall-clock time as a UTC instant: gaps shift forward, repeats take the first."""
    return wall.replace(tzinfo=zone, fold=0).astimezone(UTC)


def _margin(zone: ZoneInfo, start: datetime, end: datetime) -> timedelta:
    """How far the wall clock may stray from ``instant + offset`` near the window, plus an hour.

    Candidates are walked in wall-clock time; this widens the walk so that ticks moved across
    an offset change (up to a whole day when a zone jumps the date line) are still seen.
    """
    samples = (start - timedelta(days=2), start, end, end + timedelta(days=2))
    offsets = [s.astimezone(zone).utcoffset() or timedelta(0) for s in samples]
    return max(offsets) - min(offsets) + timedelta(hours=1)


class _WallClockSchedule(Schedule):
    """Shared walk for schedules that name wall-clock times in a zone (see the module doc)."""

    tz: str

    @property
    def zone(self) -> ZoneInfo:
        return _zone(self.tz)

    @abc.abstractmethod
    def _forward(self, wall: datetime) -> Iterator[datetime]:
        """Naive wall-clock times ``>= wall``, ascending, without end."""

    @abc.abstractmethod
    def _backward(self, wall: datetime) -> Iterator[datetime]:
        """Naive wall-clock times ``< wall``, descending, without end."""

    def between(self, start: datetime, end: datetime, limit: int | None = None) -> list[datetime]:
        start, end = _bounds(start, end)
        _check_limit(limit)
        if start >= end:
            return []
        zone = self.zone
        margin = _margin(zone, start, end)
        stop = _local(end, zone) + margin
        found: set[datetime] = set()
        cutoff = end  # once ``limit`` ticks are found: the latest of them, kept or bettered
        for wall in self._forward(_local(start, zone) - margin):
            if wall >= stop:
                break
            tick = _to_utc(wall, zone)
            if not start <= tick < cutoff or tick in found:
                continue
            found.add(tick)
            if limit is not None and len(found) >= limit:
                if len(found) > limit:
                    found.remove(max(found))
                # Later walls can still map before the cutoff (gap shifts): walk one margin on.
                cutoff = max(found)
                stop = min(stop, _local(cutoff, zone) + margin)
        return sorted(found)

    def latest_before(self, end: datetime, not_before: datetime) -> datetime | None:
        not_before, end = _bounds(not_before, end)
        if not_before >= end:
            return None
        zone = self.zone
        margin = _margin(zone, not_before, end)
        floor = _local(not_before, zone) - margin
        best: datetime | None = None
        for wall in self._backward(_local(end, zone) + margin):
            if wall < floor:
                break
            tick = _to_utc(wall, zone)
            if not_before <= tick < end and (best is None or tick > best):
                best = tick
                floor = max(floor, _local(best, zone) - margin)
        return best


def _times(hours: Iterable[Any]) -> tuple[time, ...]:
    if isinstance(hours, (time, str, bytes)):
        raise InvalidArgument("hours must be a sequence of datetime.time values")
    result: set[time] = set()
    for value in hours:
        if not isinstance(value, time):
            raise InvalidArgument(f"hours must hold datetime.time values, got {value!r}")
        if value.tzinfo is not None:
            raise InvalidArgument(f"hours are wall-clock times in tz; drop the tzinfo of {value}")
        if value.microsecond:
            raise InvalidArgument(f"hours have whole-second precision: {value}")
        result.add(value.replace(fold=0))
    if not result:
        raise InvalidArgument("a daily schedule needs at least one time of day")
    return tuple(sorted(result))


@dataclass(frozen=True)
class DailySchedule(_WallClockSchedule):
    """Every day at the given wall-clock times (``time(2, 30)``...) in the time zone ``tz``.

    The times are stored sorted and without duplicates, so equal sets of times hash alike.
    """

    hours: tuple[time, ...]
    tz: str = "UTC"
    kind: ClassVar[str] = "daily"

    def __post_init__(self) -> None:
        object.__setattr__(self, "hours", _times(self.hours))
        _zone(self.tz)

    def canonical(self) -> dict[str, Any]:
        return {"kind": self.kind, "tz": self.tz, "hours": [h.isoformat() for h in self.hours]}

    def _forward(self, wall: datetime) -> Iterator[datetime]:
        day = wall.date()
        while day < date.max:
            for hour in self.hours:
                moment = datetime.combine(day, hour)
                if moment >= wall:
                    yield moment
            day += timedelta(days=1)

    def _backward(self, wall: datetime) -> Iterator[datetime]:
        day = wall.date()
        while day > date.min:
            for hour in reversed(self.hours):
                moment = datetime.combine(day, hour)
                if moment < wall:
                    yield moment
            day -= timedelta(days=1)


def _croniter() -> Any:
    try:
        from croniter import croniter  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ImportError(
            "CronSchedule needs the croniter package: pip install 'sqla_delayedq[cron]'"
        ) from exc
    return croniter


@dataclass(frozen=True)
class CronSchedule(_WallClockSchedule):
    """A cron expression (``"*/15 9-17 * * mon-fri"``, ``"@daily"``) in the time zone ``tz``.

    Parsed by ``croniter``, so its syntax is croniter's: five fields, an optional sixth for
    seconds, ``@hourly``-style aliases. Runs of whitespace are normalised before hashing.
    """

    expression: str
    tz: str = "UTC"
    kind: ClassVar[str] = "cron"

    def __post_init__(self) -> None:
        if not isinstance(self.expression, str) or not self.expression.strip():
            raise InvalidArgument("a cron expression must be a non-empty string")
        expression = " ".join(self.expression.split())
        if not _croniter().is_valid(expression):
            raise InvalidArgument(f"invalid cron expression {self.expression!r}")
        object.__setattr__(self, "expression", expression)
        _zone(self.tz)

    def canonical(self) -> dict[str, Any]:
        return {"kind": self.kind, "tz": self.tz, "expression": self.expression}

    def _walk(self, wall: datetime, backward: bool) -> Iterator[datetime]:
        it = _croniter()(self.expression, wall if backward else wall - _SECOND)
        step = it.get_prev if backward else it.get_next
        while True:
            try:
                moment: datetime = step(datetime)
            except (ValueError, OverflowError):  # croniter's errors are ValueErrors
                return  # no further match (e.g. "0 0 30 2 *") or the calendar's end
            if backward or moment >= wall:
                yield moment

    def _forward(self, wall: datetime) -> Iterator[datetime]:
        return self._walk(wall, backward=False)

    def _backward(self, wall: datetime) -> Iterator[datetime]:
        return self._walk(wall, backward=True)
