"""The cron service: schedules, install passes, configuration changes, exact prefixes, races.

Every database test runs on SQLite, PostgreSQL and MariaDB with an injected clock; the race
between installer processes runs on the two servers. Deliveries are counted in lists.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, time, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import sqla_delayedq
from sqla_delayedq import DelayedQueue, InvalidArgument, MessageFilter, cron, is_transient
from sqla_delayedq.cron import (
    PREFIX_MAX,
    CatchUp,
    CronConfig,
    CronSchedule,
    CronService,
    CronTick,
    DailySchedule,
    InstallResult,
    PeriodicTick,
    install,
    install_tick,
    list_cron,
    tick_key,
    uninstall,
    uninstall_tick,
)
from sqla_delayedq.serializers import BytesSerializer
from tests.fix_db import Backend
from tests.fix_queue import FakeClock

T0 = datetime(2030, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)  # FakeClock's default start
HOUR = timedelta(hours=1)
BUCHAREST = "Europe/Bucharest"
R = TypeVar("R")


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


# -- helpers ------------------------------------------------------------------------------


def retrying(fn: Callable[[], R], attempts: int = 30) -> R:
    """Run one transaction, again when the database reports a transient error (deadlock...)."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:
            if attempt == attempts - 1 or not is_transient(exc):
                raise
    raise AssertionError("unreachable")


def run_install(
    make_session: Callable[[], Session], queue: DelayedQueue[Any], config: CronConfig, **kw: Any
) -> InstallResult:
    def once() -> InstallResult:
        with make_session() as s, s.begin():
            return install_tick(s, queue, config, **kw)

    return retrying(once)


def drain(make_session: Callable[[], Session], queue: DelayedQueue[Any]) -> list[str]:
    """Take and acknowledge every due message, one transaction each; the keys, in order."""
    keys: list[str] = []

    def take_one() -> str | None:
        with make_session() as s, s.begin():
            envelope = queue.try_poll(s)
            if envelope is None:
                return None
            assert queue.ack(s, envelope)
            return envelope.key

    while (key := retrying(take_one)) is not None:
        keys.append(key)
    return keys


def stored_keys(backend: Backend, queue: DelayedQueue[Any], prefix: str) -> list[str]:
    """Tick keys of ``prefix`` stored in ``queue`` (state row excluded), sorted."""
    with backend.Session() as s:
        found = queue.search(s, MessageFilter(key_prefix=prefix + "/"), limit=10_000)
    return sorted(
        m.key
        for m in found
        if re.fullmatch(re.escape(prefix) + r"/[0-9a-f]{12}/\d{8}T\d{6}Z", m.key)
    )


def key_time(key: str) -> datetime:
    return datetime.strptime(key.rsplit("/", 1)[1], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)


def walk(
    backend: Backend,
    queue: DelayedQueue[Any],
    clock: FakeClock,
    config: CronConfig,
    until: datetime,
    step: timedelta = HOUR,
    **kw: Any,
) -> list[str]:
    """Install and consume at every step of the clock up to ``until``; every delivery."""
    delivered: list[str] = []
    while True:
        run_install(backend.Session, queue, config, **kw)
        delivered += drain(backend.Session, queue)
        if clock() >= until:
            return delivered
        clock.advance(step)


# -- configurations and schedules (no database) ---------------------------------------------


def test_config_hash_is_deterministic_short_and_tracks_schedule_and_payload() -> None:
    hourly = CronConfig("reports", PeriodicTick(HOUR))
    assert hourly.config_hash == "441c3f096257"  # stable across processes and releases
    assert re.fullmatch(r"[0-9a-f]{12}", hourly.config_hash)
    assert CronConfig("other", PeriodicTick(timedelta(minutes=60))).config_hash == (
        hourly.config_hash
    )
    assert CronConfig("reports", PeriodicTick(HOUR), catch_up=CatchUp.LATEST).config_hash == (
        hourly.config_hash
    )
    assert CronConfig("r", PeriodicTick(2 * HOUR)).config_hash != hourly.config_hash
    assert CronConfig("r", PeriodicTick(HOUR), {"a": 1}).config_hash != hourly.config_hash
    assert (
        CronConfig("r", PeriodicTick(HOUR), {"a": 1, "b": 2}).config_hash
        == CronConfig("r", PeriodicTick(HOUR), {"b": 2, "a": 1}).config_hash
    )
    daily = DailySchedule((time(9), time(2, 30), time(9)), tz=BUCHAREST)
    assert daily.hours == (time(2, 30), time(9))
    assert (
        CronConfig("d", daily).config_hash
        == CronConfig("d", DailySchedule((time(2, 30), time(9)), BUCHAREST)).config_hash
    )
    assert (
        CronConfig("d", daily).config_hash
        != CronConfig("d", DailySchedule((time(2, 30), time(9)), "UTC")).config_hash
    )
    assert CronSchedule("0  3 *  * *").expression == "0 3 * * *"
    assert (
        CronConfig("c", CronSchedule("0  3 * * *")).config_hash
        == CronConfig("c", CronSchedule("0 3 * * *")).config_hash
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: CronConfig("", PeriodicTick(HOUR)),
        lambda: CronConfig("a/", PeriodicTick(HOUR)),
        lambda: CronConfig("p" * (PREFIX_MAX + 1), PeriodicTick(HOUR)),
        lambda: CronConfig(7, PeriodicTick(HOUR)),  # type: ignore[arg-type]
        lambda: CronConfig("a", "0 * * * *"),  # type: ignore[arg-type]
        lambda: CronConfig("a", PeriodicTick(HOUR), {"x": {1, 2}}),
        lambda: CronConfig("a", PeriodicTick(HOUR), catch_up="sometimes"),  # type: ignore[arg-type]
        lambda: PeriodicTick(timedelta(0)),
        lambda: PeriodicTick(timedelta(seconds=-5)),
        lambda: PeriodicTick(timedelta(milliseconds=1500)),
        lambda: PeriodicTick(3600),  # type: ignore[arg-type]
        # Accepted, then its ticks (epoch + k * period) overflowed past year 9999.
        lambda: PeriodicTick(timedelta(days=3_000_000)),
        # Accepted, then every pass (now + lookahead) failed with an OverflowError.
        lambda: CronService(DelayedQueue("c"), [], lookahead=timedelta.max),
        # An OverflowError before (a timedelta of 1e300 seconds).
        lambda: CronService(DelayedQueue("c"), []).interval_seconds(1e300),
        lambda: DailySchedule(()),
        lambda: DailySchedule((time(3, 0, 0, 5),)),
        lambda: DailySchedule((time(3, tzinfo=UTC),)),
        lambda: DailySchedule(("03:00",)),  # type: ignore[arg-type]
        lambda: DailySchedule((time(3),), tz="Mars/Olympus_Mons"),
        lambda: CronSchedule("61 * * * *"),
        lambda: CronSchedule("every day"),
        lambda: CronSchedule("0 3 * * *", tz=""),
        lambda: tick_key("a", "nothex", T0),
        lambda: tick_key("a", "0123456789ab", datetime(2030, 1, 1)),
        lambda: PeriodicTick(HOUR).between(datetime(2030, 1, 1), T0),
        lambda: CronTick.from_payload({"cron": "a"}),
    ],
)
def test_bad_input_is_rejected_before_any_sql(make: Callable[[], Any]) -> None:
    with pytest.raises(InvalidArgument):
        make()


def test_periodic_ticks_are_aligned_to_the_epoch() -> None:
    every_hour = PeriodicTick(HOUR)
    assert every_hour.between(T0, T0 + 3 * HOUR) == [utc(2030, 1, 1, h) for h in (13, 14, 15)]
    assert every_hour.between(utc(2030, 1, 1, 12), utc(2030, 1, 1, 14)) == [
        utc(2030, 1, 1, 12),
        utc(2030, 1, 1, 13),
    ]
    assert every_hour.between(T0, T0 + 10 * HOUR, limit=2) == [
        utc(2030, 1, 1, 13),
        utc(2030, 1, 1, 14),
    ]
    assert every_hour.latest_before(utc(2030, 1, 1, 12), T0 - 5 * HOUR) == utc(2030, 1, 1, 11)
    assert every_hour.latest_before(T0, utc(2030, 1, 1, 12)) == utc(2030, 1, 1, 12)
    assert every_hour.latest_before(T0, T0) is None
    week = PeriodicTick(timedelta(days=7)).between(utc(2030, 1, 1), utc(2030, 1, 8))
    assert week == [utc(2030, 1, 3)]  # the epoch was a Thursday


DAILY_BUCHAREST = DailySchedule((time(2, 30), time(3, 30), time(9)), tz=BUCHAREST)
CRON_BUCHAREST = CronSchedule("30 3 * * *", tz=BUCHAREST)

# 2030-03-31: 03:00 EET -> 04:00 EEST; 03:30 does not exist and fires at 04:30 EEST (01:30Z).
# 2030-10-27: 04:00 EEST -> 03:00 EET; 03:30 happens twice and fires once, in EEST (00:30Z).
DST_CASES = {
    ("daily", "spring"): (
        DAILY_BUCHAREST,
        utc(2030, 3, 29, 12),
        utc(2030, 4, 1, 12),
        [
            utc(2030, 3, 30, 0, 30),
            utc(2030, 3, 30, 1, 30),
            utc(2030, 3, 30, 7),
            utc(2030, 3, 31, 0, 30),
            utc(2030, 3, 31, 1, 30),
            utc(2030, 3, 31, 6),
            utc(2030, 3, 31, 23, 30),
            utc(2030, 4, 1, 0, 30),
            utc(2030, 4, 1, 6),
        ],
    ),
    ("daily", "autumn"): (
        DAILY_BUCHAREST,
        utc(2030, 10, 25, 12),
        utc(2030, 10, 28, 12),
        [
            utc(2030, 10, 25, 23, 30),
            utc(2030, 10, 26, 0, 30),
            utc(2030, 10, 26, 6),
            utc(2030, 10, 26, 23, 30),
            utc(2030, 10, 27, 0, 30),
            utc(2030, 10, 27, 7),
            utc(2030, 10, 28, 0, 30),
            utc(2030, 10, 28, 1, 30),
            utc(2030, 10, 28, 7),
        ],
    ),
    ("cron", "spring"): (
        CRON_BUCHAREST,
        utc(2030, 3, 29, 12),
        utc(2030, 4, 1, 12),
        [utc(2030, 3, 30, 1, 30), utc(2030, 3, 31, 1, 30), utc(2030, 4, 1, 0, 30)],
    ),
    ("cron", "autumn"): (
        CRON_BUCHAREST,
        utc(2030, 10, 25, 12),
        utc(2030, 10, 28, 12),
        [utc(2030, 10, 26, 0, 30), utc(2030, 10, 27, 0, 30), utc(2030, 10, 28, 1, 30)],
    ),
}


@pytest.mark.parametrize("case", sorted(DST_CASES), ids="-".join)
def test_wall_clock_schedules_across_dst(case: tuple[str, str]) -> None:
    schedule, start, end, expected = DST_CASES[case]
    assert schedule.between(start, end) == expected
    assert schedule.between(start, end, limit=4) == expected[:4]
    assert schedule.latest_before(end, start) == expected[-1]
    assert schedule.latest_before(expected[1], start) == expected[0]
    assert schedule.latest_before(expected[0], start) is None


def test_sub_hourly_cron_keeps_real_time_through_the_gap_and_skips_the_repeated_hour() -> None:
    every_half_hour = CronSchedule("*/30 * * * *", tz=BUCHAREST)
    spring = every_half_hour.between(utc(2030, 3, 30, 23), utc(2030, 3, 31, 3))
    assert spring == [utc(2030, 3, 30, 23) + k * timedelta(minutes=30) for k in range(8)]
    autumn = every_half_hour.between(utc(2030, 10, 26, 23), utc(2030, 10, 27, 3))
    assert autumn == [
        utc(2030, 10, 26, 23),
        utc(2030, 10, 26, 23, 30),
        utc(2030, 10, 27, 0),  # 03:00 EEST
        utc(2030, 10, 27, 0, 30),  # 03:30 EEST; 03:00 and 03:30 EET do not fire again
        utc(2030, 10, 27, 2),  # 04:00 EET
        utc(2030, 10, 27, 2, 30),
    ]


def test_cron_expression_that_never_matches_yields_nothing() -> None:
    never = CronSchedule("0 0 30 2 *")
    assert never.between(utc(2030, 1, 1), utc(2031, 1, 1)) == []
    assert never.latest_before(utc(2030, 1, 1), utc(2000, 1, 1)) is None


def test_tick_payload_round_trips() -> None:
    tick = CronTick("reports", "0123456789ab", utc(2030, 1, 1, 12), {"report": "daily"}, True)
    payload = tick.to_payload()
    assert payload == {
        "cron": "reports",
        "config": "0123456789ab",
        "scheduled_for": "2030-01-01T12:00:00Z",
        "data": {"report": "daily"},
        "caught_up": True,
    }
    assert CronTick.from_payload(payload) == tick
    assert tick.key == "reports/0123456789ab/20300101T120000Z"


# -- install passes ---------------------------------------------------------------------------


def test_periodic_ticks_are_created_once_and_delivered_once(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    config = CronConfig("hourly", PeriodicTick(HOUR), {"job": "sync"})
    h = config.config_hash

    first = run_install(backend.Session, queue, config, lookahead=3 * HOUR)
    assert (first.created, first.removed, first.replaced) == (3, 0, True)
    assert first.installed_until == T0 + 3 * HOUR
    assert stored_keys(backend, queue, "hourly") == [
        f"hourly/{h}/20300101T130000Z",
        f"hourly/{h}/20300101T140000Z",
        f"hourly/{h}/20300101T150000Z",
    ]
    again = run_install(backend.Session, queue, config, lookahead=3 * HOUR)
    assert (again.created, again.removed, again.replaced) == (0, 0, False)

    with backend.Session() as s:
        info = queue.get(s, f"hourly/{h}/20300101T130000Z")
    assert info is not None
    assert info.scheduled_at == utc(2030, 1, 1, 13)
    assert info.payload == {
        "cron": "hourly",
        "config": h,
        "scheduled_for": "2030-01-01T13:00:00Z",
        "data": {"job": "sync"},
    }

    delivered = walk(backend, queue, clock, config, until=T0 + 10 * HOUR, lookahead=3 * HOUR)
    assert delivered == [f"hourly/{h}/20300101T{12 + k:02d}0000Z" for k in range(1, 11)]
    assert stored_keys(backend, queue, "hourly") == [
        f"hourly/{h}/20300101T{hour}0000Z" for hour in (23,)
    ] + [f"hourly/{h}/20300102T{hour:02d}0000Z" for hour in (0, 1)]


@pytest.mark.parametrize("case", sorted(DST_CASES), ids="-".join)
def test_wall_clock_schedules_deliver_once_per_tick_across_dst(
    backend: Backend, case: tuple[str, str]
) -> None:
    schedule, start, end, expected = DST_CASES[case]
    clock = FakeClock(start)
    queue: DelayedQueue[Any] = DelayedQueue("cron-dst", clock=clock)
    config = CronConfig("dst", schedule)
    delivered = walk(backend, queue, clock, config, until=end, lookahead=6 * HOUR)
    assert delivered == [tick_key("dst", config.config_hash, at) for at in expected]


def test_cron_expression_ticks(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    config = CronConfig("six-hourly", CronSchedule("0 */6 * * *"))
    delivered = walk(backend, queue, clock, config, until=T0 + 48 * HOUR, lookahead=12 * HOUR)
    expected = [utc(2030, 1, 1, 18)] + [
        utc(2030, 1, d, h) for d in (2, 3) for h in (0, 6, 12, 18) if utc(2030, 1, d, h) <= clock()
    ]
    assert [key_time(k) for k in delivered] == expected


def test_a_lagging_installer_does_not_recreate_a_delivered_tick(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    behind: DelayedQueue[Any] = DelayedQueue("cron", clock=FakeClock(T0))
    config = CronConfig("lag", PeriodicTick(HOUR))
    run_install(backend.Session, queue, config, lookahead=2 * HOUR)
    clock.advance(HOUR)
    assert [key_time(k) for k in drain(backend.Session, queue)] == [utc(2030, 1, 1, 13)]
    assert run_install(backend.Session, behind, config, lookahead=2 * HOUR).created == 0
    assert run_install(backend.Session, queue, config, lookahead=2 * HOUR).created == 1
    assert [key_time(k) for k in stored_keys(backend, queue, "lag")] == [
        utc(2030, 1, 1, 14),
        utc(2030, 1, 1, 15),
    ]


def test_a_pass_that_loses_the_race_to_create_the_state_row_keeps_the_winners_progress(
    backend: Backend,
    clock: FakeClock,
    make_queue: Callable[..., DelayedQueue[Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queue = make_queue("cron")
    loser: DelayedQueue[Any] = DelayedQueue("cron", clock=FakeClock(T0))
    config = CronConfig("race", PeriodicTick(HOUR))
    run_install(backend.Session, queue, config, lookahead=2 * HOUR)  # the winner: 13:00, 14:00
    clock.advance(HOUR)
    assert [key_time(k) for k in drain(backend.Session, queue)] == [utc(2030, 1, 1, 13)]

    # The loser looked for the state row before the winner committed and found none; its own
    # insert then found the winner's row. It must go on from the winner's progress.
    real_read = cron._read_state
    looks: list[str] = []

    def read_too_early(*args: Any) -> Any:
        looks.append("look")
        return None if len(looks) == 1 else real_read(*args)

    monkeypatch.setattr(cron, "_read_state", read_too_early)
    result = run_install(backend.Session, loser, config, lookahead=2 * HOUR)
    assert len(looks) == 2
    assert (result.created, result.removed) == (0, 0)
    assert [key_time(k) for k in stored_keys(backend, queue, "race")] == [utc(2030, 1, 1, 14)]


def test_max_ticks_caps_a_pass_and_the_next_pass_continues(
    backend: Backend, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    config = CronConfig("fast", PeriodicTick(timedelta(seconds=1)))
    first = run_install(backend.Session, queue, config, lookahead=HOUR, max_ticks=100)
    second = run_install(backend.Session, queue, config, lookahead=HOUR, max_ticks=100)
    assert (first.created, second.created) == (100, 100)
    assert first.installed_until == utc(2030, 1, 1, 12, 1, 40) + timedelta(microseconds=1)
    times = [key_time(k) for k in stored_keys(backend, queue, "fast")]
    assert times == [utc(2030, 1, 1, 12, 0, 1) + k * timedelta(seconds=1) for k in range(200)]


def test_ticks_a_capped_pass_left_behind_are_created_late_not_skipped(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    """A pass stopped by ``max_ticks`` short of its look-ahead; by the next pass some of what it
    left is already past. Those ticks were owed (an installer was running), so they are created
    then, due at once: every second is delivered exactly once."""
    queue = make_queue("cron")
    config = CronConfig("fast", PeriodicTick(timedelta(seconds=1)))
    delivered: list[str] = []
    for step in (timedelta(minutes=2), timedelta(minutes=1), timedelta(minutes=1), None):
        run_install(backend.Session, queue, config, lookahead=timedelta(minutes=10), max_ticks=100)
        delivered += drain(backend.Session, queue)
        if step is not None:
            clock.advance(step)
    assert clock() == T0 + timedelta(minutes=4)
    assert Counter(delivered).most_common(1)[0][1] == 1
    start = utc(2030, 1, 1, 12, 0, 1)
    assert sorted(key_time(k) for k in delivered) == [
        start + k * timedelta(seconds=1) for k in range(240)
    ]


def test_longest_prefix_fills_the_key_column(
    backend: Backend, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    prefix = "p" * PREFIX_MAX
    assert run_install(backend.Session, queue, CronConfig(prefix, PeriodicTick(HOUR))).created == 1
    [key] = stored_keys(backend, queue, prefix)
    assert len(key) == 200


def test_queue_must_store_json(backend: Backend) -> None:
    queue: DelayedQueue[Any] = DelayedQueue("raw", serializer=BytesSerializer())
    with backend.Session() as s, pytest.raises(InvalidArgument, match="JSON"):
        install_tick(s, queue, CronConfig("x", PeriodicTick(HOUR)))


# -- configuration changes and uninstall ------------------------------------------------------


def test_changed_configuration_replaces_future_ticks_and_keeps_in_flight_ones(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    hourly = CronConfig("job", PeriodicTick(HOUR))
    half_hourly = CronConfig("job", PeriodicTick(timedelta(minutes=30)))
    a, b = hourly.config_hash, half_hourly.config_hash
    run_install(backend.Session, queue, hourly, lookahead=3 * HOUR)  # 13:00, 14:00, 15:00
    clock.advance(timedelta(hours=2, seconds=0.5))  # 14:00:00.62: 13:00 and 14:00 are due
    with backend.Session() as s, s.begin():
        taken = queue.try_poll(s)  # 13:00 is now in flight; 14:00 stays due
    assert taken is not None and taken.key == f"job/{a}/20300101T130000Z"

    result = run_install(backend.Session, queue, half_hourly, lookahead=3 * HOUR)
    assert (result.replaced, result.removed, result.created) == (True, 1, 6)
    assert stored_keys(backend, queue, "job") == sorted(
        [
            f"job/{a}/20300101T130000Z",  # in flight: kept, its consumer can still ack it
            f"job/{a}/20300101T140000Z",  # due under the old configuration: kept
            *(f"job/{b}/20300101T{t}00Z" for t in ("1430", "1500", "1530", "1600", "1630", "1700")),
        ]
    )
    again = run_install(backend.Session, queue, half_hourly, lookahead=3 * HOUR)
    assert (again.replaced, again.removed, again.created) == (False, 0, 0)
    with backend.Session() as s, s.begin():
        assert queue.ack(s, taken)
    assert drain(backend.Session, queue) == [f"job/{a}/20300101T140000Z"]

    # Back to the hourly configuration: the half-hourly future ticks go, generation restarts now.
    back = run_install(backend.Session, queue, hourly, lookahead=3 * HOUR)
    assert (back.replaced, back.removed, back.created) == (True, 6, 3)
    assert [key_time(k) for k in stored_keys(backend, queue, "job")] == [
        utc(2030, 1, 1, h) for h in (15, 16, 17)
    ]


@pytest.mark.parametrize("old_tick", ["due", "in_flight", "delivered"])
def test_a_change_whose_pass_runs_at_a_tick_instant_fires_that_tick_once(
    backend: Backend,
    clock: FakeClock,
    make_queue: Callable[..., DelayedQueue[Any]],
    old_tick: str,
) -> None:
    """The tick at the instant of the change is due: it stays the old configuration's, and the
    new one starts after it, whether that tick is waiting, taken or already handled."""
    queue = make_queue("cron")
    old = CronConfig("report", PeriodicTick(HOUR))
    new = CronConfig("report", PeriodicTick(HOUR), {"format": "pdf"})
    a, b = old.config_hash, new.config_hash
    clock.set(utc(2030, 1, 1, 12, 30))
    run_install(backend.Session, queue, old, lookahead=HOUR)  # 13:00
    clock.set(utc(2030, 1, 1, 13))
    delivered: list[str] = []
    taken = None
    if old_tick != "due":
        with backend.Session.begin() as s:
            taken = queue.try_poll(s)
        assert taken is not None
        delivered.append(taken.key)
        if old_tick == "delivered":
            with backend.Session.begin() as s:
                assert queue.ack(s, taken)

    result = run_install(backend.Session, queue, new, lookahead=HOUR)  # exactly at 13:00
    assert (result.replaced, result.removed, result.created) == (True, 0, 0)
    if old_tick == "in_flight":
        assert taken is not None
        with backend.Session.begin() as s:
            assert queue.ack(s, taken)
    delivered += walk(backend, queue, clock, new, until=utc(2030, 1, 1, 15), lookahead=HOUR)
    assert delivered == [
        f"report/{a}/20300101T130000Z",
        f"report/{b}/20300101T140000Z",
        f"report/{b}/20300101T150000Z",
    ]


def deliver_each_minute(
    backend: Backend, queue: DelayedQueue[Any], clock: FakeClock, minutes: tuple[int, ...]
) -> list[Any]:
    """The payloads of what is due at half past each of ``minutes`` past 12:00, taken and
    acknowledged minute by minute."""
    delivered: list[Any] = []
    for minute in minutes:
        clock.set(utc(2030, 1, 1, 12, minute, 30))
        with backend.Session.begin() as s:
            while (env := queue.try_poll(s)) is not None:
                assert queue.ack(s, env)
                delivered.append(env.payload)
    return delivered


def test_a_change_by_a_pass_that_waited_for_the_lock_fires_each_tick_once(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    """A pass with a new configuration waits for the state row (another installer holds it; on
    SQLite, any writer). Meanwhile the old configuration's tick falls due and is delivered. The
    pass must not then create that instant again for the new configuration."""
    queue = make_queue("cron")
    old = CronConfig("report", PeriodicTick(timedelta(minutes=1)), {"v": 1})
    new = CronConfig("report", PeriodicTick(timedelta(minutes=1)), {"v": 2})
    clock.set(utc(2030, 1, 1, 12, 0, 30))
    run_install(backend.Session, queue, old, lookahead=timedelta(minutes=5))
    blocker = backend.Session()
    blocker.begin()
    if backend.name == "sqlite":
        blocker.connection()  # the writer lock, as any writer holds it
    else:
        install_tick(blocker, queue, old, lookahead=timedelta(minutes=5))  # holds the state row
    results: list[InstallResult] = []
    deploy = threading.Thread(
        target=lambda: results.append(
            run_install(backend.Session, queue, new, lookahead=timedelta(minutes=5))
        )
    )
    deploy.start()
    try:
        deploy.join(1.0)  # the deploy's pass is waiting for the lock
        assert deploy.is_alive()
        clock.set(utc(2030, 1, 1, 12, 1))  # the old configuration's tick falls due
        delivered: list[Any] = []
        if backend.name == "sqlite":  # the writer is the consumer itself
            env = queue.try_poll(blocker)
            assert env is not None and queue.ack(blocker, env)
            delivered.append(env.payload)
        else:
            with backend.Session.begin() as s:
                env = queue.try_poll(s)
                assert env is not None and queue.ack(s, env)
                delivered.append(env.payload)
        blocker.commit()
    finally:
        blocker.close()
        deploy.join(60)
    assert results and results[0].replaced
    delivered += deliver_each_minute(backend, queue, clock, (1, 2, 3))
    runs = [(p["scheduled_for"], p.get("data")) for p in delivered]
    assert runs == [
        ("2030-01-01T12:01:00Z", {"v": 1}),
        ("2030-01-01T12:02:00Z", {"v": 2}),
        ("2030-01-01T12:03:00Z", {"v": 2}),
    ]


def test_a_change_whose_delete_waits_for_a_transactional_handler_fires_each_tick_once(
    server_backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    """A deploy changes the configuration while a transactional handler holds an old tick.
    On MariaDB the pass's delete of the old future ticks waited for that row after the pass
    had read the time; meanwhile the next old tick fell due and was delivered, and the new
    configuration, starting from the time read before the wait, fired the same instant again
    (found in review: 5 runs of 5)."""
    backend = server_backend
    queue = make_queue("cron")
    old = CronConfig("report", PeriodicTick(timedelta(minutes=1)), {"v": 1})
    new = CronConfig("report", PeriodicTick(timedelta(minutes=1)), {"v": 2})
    clock.set(utc(2030, 1, 1, 12, 0, 30))
    run_install(backend.Session, queue, old, lookahead=timedelta(minutes=5))
    clock.set(utc(2030, 1, 1, 12, 1, 30))
    delivered: list[Any] = []
    holding, release = threading.Event(), threading.Event()

    def slow(env: Any, session: Session) -> None:  # a transactional handler of the 12:01 tick
        delivered.append(env.payload)
        holding.set()
        release.wait(30)

    def hold() -> None:
        with backend.Session.begin() as s:
            queue.process_one(s, slow)

    holder = threading.Thread(target=hold)
    holder.start()
    results: list[InstallResult] = []
    deploy = threading.Thread(
        target=lambda: results.append(
            run_install(backend.Session, queue, new, lookahead=timedelta(minutes=5))
        )
    )
    try:
        assert holding.wait(10)
        deploy.start()
        deploy.join(1.0)  # on MariaDB the deploy's pass waits for the handler's row
        clock.set(utc(2030, 1, 1, 12, 2))  # the old configuration's next tick falls due
        with backend.Session.begin() as s:
            env = queue.try_poll(s)
            if env is not None:  # taken before the pass locked it
                assert queue.ack(s, env)
                delivered.append(env.payload)
    finally:
        release.set()
        holder.join(30)
        deploy.join(60)
    assert results and results[0].replaced
    delivered += deliver_each_minute(backend, queue, clock, (2, 3, 4))
    runs = [p["scheduled_for"] for p in delivered]
    assert sorted(runs) == [f"2030-01-01T12:0{m}:00Z" for m in range(1, 5)], runs


def test_uninstall_removes_exactly_the_named_configuration(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    x = CronConfig("x", PeriodicTick(HOUR))
    y = CronConfig("y", DailySchedule((time(18), time(20)), tz=BUCHAREST))
    x_next = CronConfig("x", PeriodicTick(HOUR), {"v": 2})
    run_install(backend.Session, queue, x, lookahead=12 * HOUR)
    run_install(backend.Session, queue, y, lookahead=12 * HOUR)
    y_keys = stored_keys(backend, queue, "y")
    assert len(y_keys) == 2 and len(stored_keys(backend, queue, "x")) == 12

    clock.advance(HOUR)
    with backend.Session() as s, s.begin():
        taken = queue.try_poll(s)
    assert taken is not None and taken.key.startswith(f"x/{x.config_hash}/")
    run_install(backend.Session, queue, x_next, lookahead=12 * HOUR)  # x's future ticks replaced

    with backend.Session() as s, s.begin():
        # The old configuration only: its in-flight tick stays, the new one is untouched.
        assert uninstall_tick(s, queue, "x", x.config_hash) == 0
        assert uninstall_tick(s, queue, "y", "000000000000") == 0
    assert stored_keys(backend, queue, "y") == y_keys
    assert len(stored_keys(backend, queue, "x")) == 1 + 12
    with backend.Session() as s, s.begin():
        assert uninstall(s, queue, x_next) == 12
    assert stored_keys(backend, queue, "x") == [taken.key]
    assert stored_keys(backend, queue, "y") == y_keys
    with backend.Session() as s:
        assert [(i.prefix, i.current) for i in list_cron(s, queue)] == [("y", True)]
    with backend.Session() as s, s.begin():
        assert queue.ack(s, taken)
        assert uninstall_tick(s, queue, "y") == 2
        assert list_cron(s, queue) == []


@pytest.mark.parametrize("target", ["a_b", "a%b"])
def test_like_wildcards_in_prefixes_are_escaped(
    backend: Backend, make_queue: Callable[..., DelayedQueue[Any]], target: str
) -> None:
    queue = make_queue("cron")
    others = ["axb", "aXb", "A_B", "a!b", "a\\b", "a_b" if target == "a%b" else "a%b", "ab"]
    for prefix in [*others, target]:
        run_install(backend.Session, queue, CronConfig(prefix, PeriodicTick(HOUR)))
    before = {p: stored_keys(backend, queue, p) for p in others}
    assert all(len(keys) == 1 for keys in before.values())

    changed = run_install(
        backend.Session, queue, CronConfig(target, PeriodicTick(timedelta(minutes=30)))
    )
    assert (changed.removed, changed.created) == (1, 2)
    with backend.Session() as s, s.begin():
        assert uninstall_tick(s, queue, target) == 2
    assert {p: stored_keys(backend, queue, p) for p in others} == before
    with backend.Session() as s:
        assert sorted(i.prefix for i in list_cron(s, queue)) == sorted(others)


def test_a_prefix_does_not_own_longer_prefixes_that_start_with_it(
    backend: Backend, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    nested = ["r/0123456789ab", "r/daily", "r/0123456789ab/20300101T130000Z", "rr"]
    for prefix in ["r", *nested]:
        run_install(backend.Session, queue, CronConfig(prefix, PeriodicTick(HOUR)))
    before = {p: stored_keys(backend, queue, p) for p in nested}
    run_install(backend.Session, queue, CronConfig("r", PeriodicTick(HOUR), {"v": 2}))
    with backend.Session() as s, s.begin():
        assert uninstall_tick(s, queue, "r") == 1
    assert {p: stored_keys(backend, queue, p) for p in nested} == before
    with backend.Session() as s:
        assert sorted(i.prefix for i in list_cron(s, queue)) == sorted(nested)


# -- catch-up ----------------------------------------------------------------------------------


def test_catch_up_skip_resumes_with_the_next_tick(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    config = CronConfig("skip", PeriodicTick(HOUR), catch_up=CatchUp.SKIP)
    run_install(backend.Session, queue, config, lookahead=2 * HOUR)  # 13:00, 14:00
    clock.advance(10 * HOUR)  # nothing ran from 12:00 to 22:00
    result = run_install(backend.Session, queue, config, lookahead=2 * HOUR)
    assert (result.created, result.caught_up) == (2, None)
    delivered = drain(backend.Session, queue)
    assert [key_time(k) for k in delivered] == [utc(2030, 1, 1, 13), utc(2030, 1, 1, 14)]
    assert [key_time(k) for k in stored_keys(backend, queue, "skip")] == [
        utc(2030, 1, 1, 23),
        utc(2030, 1, 2, 0),
    ]


def test_catch_up_latest_delivers_the_latest_missed_tick_once(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    config = CronConfig("latest", PeriodicTick(HOUR), catch_up="latest")  # type: ignore[arg-type]
    assert config.catch_up is CatchUp.LATEST
    run_install(backend.Session, queue, config, lookahead=2 * HOUR)
    clock.advance(10 * HOUR)
    result = run_install(backend.Session, queue, config, lookahead=2 * HOUR)
    assert (result.created, result.caught_up) == (3, utc(2030, 1, 1, 22))
    again = run_install(backend.Session, queue, config, lookahead=2 * HOUR)
    assert (again.created, again.caught_up) == (0, None)

    with backend.Session() as s:
        info = queue.get(s, tick_key("latest", config.config_hash, utc(2030, 1, 1, 22)))
    assert info is not None and CronTick.from_payload(info.payload).caught_up
    delivered = drain(backend.Session, queue)
    assert [key_time(k) for k in delivered] == [utc(2030, 1, 1, h) for h in (13, 14, 22)]


# -- listing -----------------------------------------------------------------------------------


def test_list_cron_reports_configurations_next_ticks_and_counts(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    old = CronConfig("billing", PeriodicTick(HOUR))
    new = CronConfig("billing", PeriodicTick(HOUR), {"v": 2})
    nightly = CronConfig("nightly", DailySchedule((time(3),), tz=BUCHAREST))
    run_install(backend.Session, queue, old, lookahead=3 * HOUR)
    run_install(backend.Session, queue, nightly, lookahead=24 * HOUR)
    clock.advance(HOUR)
    with backend.Session() as s, s.begin():
        taken = queue.try_poll(s)
    assert taken is not None
    run_install(backend.Session, queue, new, lookahead=3 * HOUR)

    with backend.Session() as s:
        infos = list_cron(s, queue)
        assert list_cron(s, queue, "nightly") == [i for i in infos if i.prefix == "nightly"]
        assert CronService(queue, [new, nightly]).installed(s) == infos
    assert [(i.prefix, i.config_hash, i.current) for i in infos] == [
        ("billing", new.config_hash, True),
        ("billing", old.config_hash, False),
        ("nightly", nightly.config_hash, True),
    ]
    current, leftover, daily = infos
    assert current.schedule == {"kind": "periodic", "period_seconds": 3600}
    assert current.catch_up == "skip"
    assert current.installed_at == clock()
    assert current.installed_until == clock() + 3 * HOUR
    assert (current.next_tick, current.last_tick) == (utc(2030, 1, 1, 14), utc(2030, 1, 1, 16))
    assert current.counts.scheduled == 3 and current.counts.pending == 3
    assert leftover.counts.in_flight == 1 and leftover.counts.pending == 1
    assert leftover.next_tick is None and leftover.schedule is None
    assert daily.schedule == {"kind": "daily", "tz": BUCHAREST, "hours": ["03:00:00"]}
    assert daily.next_tick == utc(2030, 1, 2, 1)  # 03:00 EET


# -- many installers at once ----------------------------------------------------------------

RACE_QUEUE = "cron-race"
RACE_PREFIX = "race"
RACE_START = utc(2030, 1, 1, 12)
RACE_PERIOD = timedelta(minutes=1)
RACE_LOOKAHEAD = 5 * RACE_PERIOD
RACE_CONFIG = CronConfig(RACE_PREFIX, PeriodicTick(RACE_PERIOD), {"race": True})


def race_installer(
    make_session: Callable[[], Session], offset: timedelta, steps: int, start: Callable[[], Any]
) -> tuple[list[str], int]:
    """One installer-and-consumer walking its own clock through ``steps`` ticks.

    Returns the keys it delivered and how many ticks its passes created.
    """
    clock = FakeClock(RACE_START + offset)
    queue: DelayedQueue[Any] = DelayedQueue(RACE_QUEUE, clock=clock)
    delivered: list[str] = []
    created = 0

    def take_due() -> list[str]:
        with make_session() as s, s.begin():
            envelopes = queue.try_poll_many(s, 10)
            assert queue.ack_many(s, envelopes) == len(envelopes)
            return [e.key for e in envelopes]

    start()
    for _ in range(steps):
        created += run_install(make_session, queue, RACE_CONFIG, lookahead=RACE_LOOKAHEAD).created
        while keys := retrying(take_due):
            delivered += keys  # after the commit: a rolled-back take is not a delivery
        clock.advance(RACE_PERIOD)
    return delivered, created


def race_process(url: str, offset_seconds: float, steps: int, barrier: Any, out: Any) -> None:
    """Entry point of a spawned installer process: its own engine, its own clock."""
    engine = sqla_delayedq.create_engine(url)
    try:
        delivered, created = race_installer(
            sessionmaker(engine), timedelta(seconds=offset_seconds), steps, barrier.wait
        )
        out.put(("ok", delivered, created))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}", 0))
    finally:
        engine.dispose()


def check_race(backend: Backend, delivered: list[str], created: int, steps: int) -> None:
    """Every tick was created once and delivered once, and none is missing."""
    clock = FakeClock(RACE_START + steps * RACE_PERIOD + RACE_LOOKAHEAD + RACE_PERIOD)
    delivered += drain(backend.Session, DelayedQueue(RACE_QUEUE, clock=clock))
    counts = Counter(delivered)
    assert [k for k, n in counts.items() if n > 1] == []
    assert created == len(delivered)
    times = sorted(key_time(k) for k in delivered)
    assert times[0] <= RACE_START + RACE_PERIOD
    assert times[-1] >= RACE_START + steps * RACE_PERIOD
    assert all(b - a == RACE_PERIOD for a, b in itertools.pairwise(times)), "a tick is missing"
    assert all(k.startswith(f"{RACE_PREFIX}/{RACE_CONFIG.config_hash}/") for k in delivered)
    with backend.Session() as s:
        assert queue_count(s) == 1  # only the state row is left


def queue_count(s: Session) -> int:
    return DelayedQueue(RACE_QUEUE).count(s)


def test_threads_installing_at_once_create_and_deliver_each_tick_once(backend: Backend) -> None:
    threads, steps = 6, 40
    barrier = threading.Barrier(threads)
    delivered: list[str] = []
    created: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        try:
            got, made = race_installer(
                backend.Session, timedelta(seconds=7 * i), steps, barrier.wait
            )
            with lock:
                delivered.extend(got)
                created.append(made)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert errors == []
    check_race(backend, delivered, sum(created), steps)


@pytest.mark.slow
def test_processes_installing_at_once_create_and_deliver_each_tick_once(
    server_backend: Backend,
) -> None:
    processes, steps = 4, 200
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes)
    out = ctx.Queue()
    url = server_backend.url.render_as_string(hide_password=False)
    procs = [
        ctx.Process(target=race_process, args=(url, 15.0 * i, steps, barrier, out))
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [r for r in results if r[0] != "ok"] == []
    delivered = [key for _, keys, _ in results for key in keys]
    check_race(server_backend, delivered, sum(made for _, _, made in results), steps)


# -- the background installer -----------------------------------------------------------------


def test_background_installer_survives_an_outage_and_stops(
    backend: Backend, clock: FakeClock, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    config = CronConfig("bg", PeriodicTick(timedelta(minutes=1)))
    unreachable = sa.create_engine(
        "postgresql+psycopg://postgres@127.0.0.1:1/none", poolclass=sa.NullPool
    )
    outage = threading.Event()
    outage.set()

    def sessions() -> Session:
        return Session(unreachable) if outage.is_set() else backend.Session()

    with pytest.raises(InvalidArgument, match="shorter than the look-ahead"):
        install(sessions, queue, config, interval=timedelta(minutes=5), lookahead=HOUR / 12)
    handle = install(sessions, queue, config, interval=0.05, lookahead=timedelta(minutes=5))
    try:
        assert handle.wait_for_passes(3, timeout=30)
        assert handle.running and handle.successes == 0 and handle.consecutive_failures >= 3
        assert isinstance(handle.last_error, sa.exc.OperationalError)

        outage.clear()
        assert handle.wait_for_passes(handle.passes + 2, timeout=30)
        assert handle.consecutive_failures == 0 and handle.successes >= 1
        assert len(stored_keys(backend, queue, "bg")) == 5

        clock.advance(timedelta(minutes=2))
        handle.trigger()
        assert handle.wait_for_passes(handle.passes + 2, timeout=30)
        assert len(stored_keys(backend, queue, "bg")) == 7
    finally:
        assert handle.stop(timeout=5)
        unreachable.dispose()
    assert not handle.running
    passes = handle.passes
    handle.trigger()
    assert handle.passes == passes


def test_service_rejects_two_configurations_of_one_prefix(
    make_queue: Callable[..., DelayedQueue[Any]],
) -> None:
    queue = make_queue("cron")
    with pytest.raises(InvalidArgument, match="share the prefix"):
        CronService(
            queue, [CronConfig("a", PeriodicTick(HOUR)), CronConfig("a", PeriodicTick(2 * HOUR))]
        )


def test_service_run_once_installs_each_configuration_in_its_own_transaction(
    backend: Backend, make_queue: Callable[..., DelayedQueue[Any]]
) -> None:
    queue = make_queue("cron")
    service = CronService(
        queue,
        [CronConfig("one", PeriodicTick(HOUR)), CronConfig("two", CronSchedule("*/20 * * * *"))],
        lookahead=HOUR,
    )
    results = service.run_once(backend.Session)
    assert [(r.prefix, r.created) for r in results] == [("one", 1), ("two", 3)]
    with backend.Session() as s, s.begin():
        assert service.uninstall(s) == 4
        assert service.installed(s) == []


# -- the documentation ------------------------------------------------------------------------


def test_docs_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = Path(__file__).resolve().parent.parent / "docs" / "cron.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "cron_docs"}
    for block in blocks:
        exec(compile(block, str(doc), "exec"), namespace)
    with contextlib.suppress(Exception):
        namespace["engine"].dispose()


@pytest.fixture(autouse=True)
def _no_leftover_threads() -> Iterator[None]:
    before = {t.name for t in threading.enumerate()}
    yield
    leftover = {t.name for t in threading.enumerate() if t.name.startswith("sqla_delayedq-cron")}
    assert leftover <= before
