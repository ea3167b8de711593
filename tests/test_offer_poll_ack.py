"""Conformance: offer, poll and ack on every backend, inside the caller's transaction."""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, cast

import pytest
import sqlalchemy as sa

from sqla_delayedq import (
    BytesSerializer,
    DecodeError,
    DelayedMessage,
    DelayedQueueError,
    Delivery,
    EncodeError,
    Envelope,
    InvalidArgument,
    JsonSerializer,
    OfferMode,
    Outcome,
)
from sqla_delayedq.models import KEY_MAX, QUEUE_MAX
from tests.fix_queue import record_sql

T = cast(sa.Table, DelayedMessage.__table__)


@pytest.fixture
def backend(conformance_backend):
    """SQLite, PostgreSQL, MariaDB, and PostgreSQL through psycopg's async driver."""
    return conformance_backend


def row_count(backend, queue: str | None = None) -> int:
    with backend.engine.connect() as conn:
        stmt = sa.select(sa.func.count()).select_from(T)
        if queue:
            stmt = stmt.where(T.c.queue == queue)
        return conn.execute(stmt).scalar_one()


def test_offer_commits_with_the_callers_transaction(backend, make_queue):
    q = make_queue()
    with backend.Session() as s, s.begin():
        assert q.offer(s, "k1", {"n": 1}).outcome is Outcome.CREATED
    assert row_count(backend) == 1


def test_rolled_back_transaction_leaves_no_message(backend, make_queue):
    q = make_queue()
    with pytest.raises(RuntimeError), backend.Session() as s, s.begin():
        q.offer(s, "k1", {"n": 1})
        raise RuntimeError("the caller's own write failed")
    assert row_count(backend) == 0


def test_offer_modes_and_outcomes(backend, make_queue, clock):
    q = make_queue()
    at = clock() + timedelta(minutes=5)
    with backend.Session() as s, s.begin():
        assert q.offer(s, "k", {"v": 1}, at).outcome is Outcome.CREATED
        assert q.offer(s, "k", {"v": 1}, at).outcome is Outcome.IGNORED
        assert q.offer(s, "k", {"v": 2}, at, mode="skip").outcome is Outcome.IGNORED
        assert q.get(s, "k").payload == {"v": 1}
        later = at + timedelta(minutes=1)
        assert q.offer(s, "k", {"v": 1}, later).outcome is Outcome.UPDATED
        assert q.get(s, "k").scheduled_at == later
        assert (
            q.offer(s, "k", {"v": 3}, at, mode=OfferMode.KEEP_SCHEDULE).outcome is Outcome.UPDATED
        )
        info = q.get(s, "k")
        assert (info.payload, info.scheduled_at) == ({"v": 3}, later)
        assert q.offer(s, "k", {"v": 3}, at, mode="keep_schedule").outcome is Outcome.IGNORED
    assert row_count(backend) == 1


def test_offer_without_time_is_due_now_and_identical_reoffer_is_ignored(backend, make_queue, clock):
    q = make_queue()
    with backend.Session() as s, s.begin():
        assert q.offer(s, "k", {"a": 1}).outcome is Outcome.CREATED
        clock.advance(10)
        assert q.offer(s, "k", {"a": 1}).outcome is Outcome.IGNORED
        assert q.offer(s, "k", {"a": 2}).outcome is Outcome.UPDATED
        assert q.get(s, "k").scheduled_at == clock()


def test_generated_key(backend, make_queue):
    q = make_queue()
    with backend.Session() as s, s.begin():
        r = q.offer(s, None, {"x": 1})
        assert r.outcome is Outcome.CREATED and len(r.key) == 32
        assert q.contains(s, r.key)


def test_times_round_trip_exactly(backend, make_queue, clock):
    q = make_queue()
    at = datetime(2031, 3, 4, 5, 6, 7, 891011, tzinfo=timezone(timedelta(hours=2)))
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"x": 1}, at)
    with backend.Session() as s:
        info = q.get(s, "k")
        assert info.scheduled_at == at and info.scheduled_at.tzinfo == UTC
        assert info.scheduled_at.microsecond == 891011
        assert info.created_at == clock()
    with backend.Session() as s, s.begin():
        assert q.offer(s, "k", {"x": 1}, at).outcome is Outcome.IGNORED


def test_poll_order_is_schedule_then_id(backend, make_queue, clock):
    q = make_queue()
    now = clock()
    with backend.Session() as s, s.begin():
        q.offer(s, "late", 1, now - timedelta(seconds=1))
        q.offer(s, "early-b", 2, now - timedelta(seconds=5))
        q.offer(s, "early-a", 3, now - timedelta(seconds=5))
        q.offer(s, "future", 4, now + timedelta(seconds=5))
    order = []
    with backend.Session() as s, s.begin():
        while (env := q.try_poll(s)) is not None:
            order.append(env.key)
    assert order == ["early-b", "early-a", "late"]


def test_poll_returns_a_full_envelope(backend, make_queue, clock):
    q = make_queue(lease=timedelta(seconds=30))
    at = clock() - timedelta(seconds=3)
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"hello": "world"}, at)
    with backend.Session() as s, s.begin():
        env = q.try_poll(s)
    assert env is not None
    assert (env.key, env.payload, env.queue) == ("k", {"hello": "world"}, "q")
    assert env.scheduled_at == at and env.scheduled_at_initially == at
    assert env.created_at == clock()
    assert env.delivery is Delivery.FIRST and env.attempt == 1
    assert env.lease_until == clock() + timedelta(seconds=30)
    assert env.lock_token
    with backend.Session() as s, s.begin():
        assert q.try_poll(s) is None  # leased: invisible to other consumers


def test_queues_share_a_table_but_not_messages(backend, make_queue):
    a, b = make_queue("a"), make_queue("b")
    with backend.Session() as s, s.begin():
        a.offer(s, "same-key", {"q": "a"})
        b.offer(s, "same-key", {"q": "b"})
    with backend.Session() as s, s.begin():
        assert a.try_poll(s).payload == {"q": "a"}
        assert a.try_poll(s) is None
        assert b.try_poll(s).payload == {"q": "b"}


def test_keys_are_case_sensitive(backend, make_queue):
    q = make_queue()
    with backend.Session() as s, s.begin():
        assert q.offer(s, "Key", 1).outcome is Outcome.CREATED
        assert q.offer(s, "key", 2).outcome is Outcome.CREATED


def test_ack_deletes_and_a_second_ack_is_harmless(backend, make_queue):
    q = make_queue()
    with backend.Session() as s, s.begin():
        q.offer(s, "k", 1)
    with backend.Session() as s, s.begin():
        env = q.try_poll(s)
    with backend.Session() as s, s.begin():
        assert q.ack(s, env) is True
        assert q.ack(s, env) is False
    assert row_count(backend) == 0


def test_expired_lease_is_redelivered_and_the_late_ack_loses(backend, make_queue, clock):
    q = make_queue(lease=timedelta(seconds=10))
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 1})
    with backend.Session() as s, s.begin():
        first = q.try_poll(s)
    clock.advance(11)
    with backend.Session() as s, s.begin():
        second = q.try_poll(s)
    assert second is not None and second.key == "k"
    assert second.delivery is Delivery.REDELIVERY and second.lock_token != first.lock_token
    with backend.Session() as s, s.begin():
        assert q.ack(s, first) is False  # the first consumer's late ack does not delete it
    assert row_count(backend) == 1
    with backend.Session() as s, s.begin():
        assert q.ack(s, second) is True
    assert row_count(backend) == 0


def test_update_after_take_wins_over_ack(backend, make_queue):
    q = make_queue()
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 1})
    with backend.Session() as s, s.begin():
        env = q.try_poll(s)
    with backend.Session() as s, s.begin():
        assert q.offer(s, "k", {"v": 2}).outcome is Outcome.UPDATED
    with backend.Session() as s, s.begin():
        assert q.ack(s, env) is False
        again = q.try_poll(s)
        assert again.payload == {"v": 2} and again.delivery is Delivery.FIRST


def test_transactional_mode_rollback_makes_the_message_due_again(backend, make_queue):
    q = make_queue()
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 1})
    with pytest.raises(RuntimeError), backend.Session() as s, s.begin():
        env = q.try_poll(s)
        q.ack(s, env)
        raise RuntimeError("handler crashed inside the transaction")
    with backend.Session() as s, s.begin():
        env = q.try_poll(s)
        assert env is not None and env.delivery is Delivery.FIRST


def test_bytes_serializer(backend, make_queue):
    q = make_queue(serializer=BytesSerializer())
    with backend.Session() as s, s.begin():
        q.offer(s, "k", b"\x00\xffraw")
        assert q.offer(s, "k", b"\x00\xffraw").outcome is Outcome.IGNORED
    with backend.Session() as s, s.begin():
        assert q.try_poll(s).payload == b"\x00\xffraw"


def test_taken_envelopes_are_whole_frozen_values(backend, make_queue, clock):
    """Envelopes are built without the dataclass's __init__ on the take path (it is hot): they
    hold every field and nothing else, and behave as values built the usual way."""
    q = make_queue()
    with backend.Session() as s, s.begin():
        q.offer(s, "one", {"n": 1}, headers={"trace": "t-1"})
        q.offer_batch(s, [("two", [2]), ("three", "3")])
    with backend.Session() as s, s.begin():
        taken = [q.try_poll(s), *q.try_poll_many(s, 5)]
    assert [e.key for e in taken] == ["one", "three", "two"]  # a batch inserts in key order
    names = {f.name for f in dataclasses.fields(Envelope)}
    for env in taken:
        assert set(vars(env)) == names
        assert Envelope(**{n: getattr(env, n) for n in names}) == env
        assert dataclasses.replace(env) == env and repr(env).startswith("Envelope(id=")
        assert pickle.loads(pickle.dumps(env)) == env
        with pytest.raises(dataclasses.FrozenInstanceError):
            env.key = "changed"
    assert taken[0].headers == {"trace": "t-1"} and taken[2].headers == {}
    assert (taken[1].payload, taken[2].payload) == ("3", [2])
    assert taken[0].attempt == 1 and taken[0].lease_until > clock()


@pytest.mark.parametrize("payload", ["3", "[1]", '{"a": 1}', "x", "", "null", "true", "\u00e9"])
def test_a_json_string_payload_reads_back_as_offered(backend, make_queue, payload):
    """Regression: a JSON string payload was parsed again on read ("3" came back as 3; "x" was
    buried as corrupt JSON, never delivered)."""
    q = make_queue()
    with backend.Session() as s, s.begin():
        q.offer(s, "one", payload)
        q.offer_batch(s, [("two", payload)])
    with backend.Session() as s, s.begin():
        assert q.get(s, "one").payload == payload and q.get(s, "two").payload == payload
        assert q.offer(s, "one", payload).outcome is Outcome.IGNORED  # the same message
        assert [e.payload for e in q.try_poll_many(s, 5)] == [payload, payload]
    with backend.Session() as s:
        assert q.counts(s).dead == 0


#: A payload that contains itself: JSON cannot hold it.
CYCLE: list[object] = []
CYCLE.append(CYCLE)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda q, s: q.offer(s, "", 1), "key must not be empty"),
        (lambda q, s: q.offer(s, "k" * (KEY_MAX + 1), 1), "limit is 200"),
        (lambda q, s: q.offer(s, 123, 1), "key must be a string"),
        (lambda q, s: q.offer(s, "k", 1, datetime(2030, 1, 1)), "naive datetime"),
        (lambda q, s: q.offer(s, "k", 1, mode="upsert"), "unknown offer mode"),
        (lambda q, s: q.offer(s, "k", {1, 2}), "not JSON-serializable"),
        (lambda q, s: q.offer(s, "k", float("nan")), "not JSON-serializable"),
        (lambda q, s: q.try_poll(s, lease=timedelta(seconds=-1)), "lease must be > 0"),
        # Regression: accepted, then the take failed on a lease end past year 9999.
        (lambda q, s: q.try_poll(s, lease=timedelta.max), "lease must be at most"),
        (lambda q, s: q.try_poll_many(s, 0), "positive integer"),
        # Regression: an OverflowError (now - older_than before year 1).
        (lambda q, s: q.prune(s, timedelta.max), "older_than must be at most 365000 days"),
        (lambda q, s: q.prune(s, timedelta(days=365_001)), "older_than must be at most"),
        # Regression: an OverflowError, or a period stored that no read of it could convert.
        (lambda q, s: q.set_limits(s, rate=(1, timedelta.max)), "period must be at most"),
        (lambda q, s: q.set_limits(s, rate=(1, 1e300)), "period must be at most"),
        (lambda q, s: q.offer_batch(s, [("ok", 1), ("bad",)]), r"messages\[1\]"),
        (lambda q, s: q.offer_batch(s, [("ok", 1), ("k", 1, datetime(2030, 1, 1))]), "naive"),
        (lambda q, s: q.offer(s, "k", CYCLE), "refers to itself"),
        # Regression: accepted, then buried as "no payload" at its first take, never handled.
        (lambda q, s: q.offer(s, "k", None), "payload is None"),
        (lambda q, s: q.offer_batch(s, [("ok", 1), ("k", None)]), "payload is None"),
        (lambda q, s: q.offer(s.get_bind(), "k", None), "payload is None"),
        (lambda q, s: q.offer_batch(s, [("ok", 1), ("k", CYCLE)]), "refers to itself"),
        (lambda q, s: q.offer_batch(s, [("ok", 1), ("k", {1, 2})]), "not JSON-serializable"),
        (lambda q, s: q.offer_batch(s, [("ok", 1), ["k", 1]]), r"messages\[1\]"),
        (lambda q, s: q.offer_batch(s, [("k", 1, None, None, 5)]), r"messages\[0\]"),
        (lambda q, s: q.offer_batch(s, [("ok", 1), (7, 1)]), "key must be a string"),
        (lambda q, s: q.offer_batch(s, [("ok", 1), ("", 1)]), "key must not be empty"),
        (lambda q, s: q.offer_batch(s, [("ok", 1), ("k" * (KEY_MAX + 1), 1)]), "limit is 200"),
        (lambda q, s: q.offer_batch(s, [(None, 1), ("ok", b"x")]), "not JSON-serializable"),
        (lambda q, s: q.offer_batch(s, [("ok", "null"), ("k", None)]), "payload is None"),
    ],
)
def test_bad_input_is_refused_before_any_sql(backend, make_queue, call, message):
    q = make_queue()
    with record_sql(backend.engine) as statements, backend.Session() as s, s.begin():
        with pytest.raises(InvalidArgument, match=message) as info:
            call(q, s)
        assert isinstance(info.value, (DelayedQueueError, ValueError))
        assert not [x for x in statements if "delayed_queue" in x]
    assert row_count(backend) == 0


def test_bad_queue_settings_are_refused(clock):
    from sqla_delayedq import DelayedQueue

    for name in ("", "q" * (QUEUE_MAX + 1)):
        with pytest.raises(InvalidArgument):
            DelayedQueue(name)
    with pytest.raises(InvalidArgument, match="lease"):
        DelayedQueue("q", lease=timedelta(0))
    with pytest.raises(InvalidArgument, match="lease must be at most"):
        DelayedQueue("q", lease=timedelta(days=365_001))  # its takes failed past year 9999
    # Accepted, then every prune (now - retention) or every take (now - aging) overflowed.
    with pytest.raises(InvalidArgument, match="retention must be at most 365000 days"):
        DelayedQueue("q", retention=timedelta.max)
    with pytest.raises(InvalidArgument, match="priority_aging must be at most 365000 days"):
        DelayedQueue("q", priorities=True, priority_aging=timedelta(days=740_000))
    with pytest.raises(InvalidArgument, match="naive"):
        DelayedQueue("q", clock=lambda: datetime(2030, 1, 1)).now()
    with pytest.raises(EncodeError):
        DelayedQueue("q", serializer=BytesSerializer()).codec.values("not bytes")  # type: ignore[arg-type]


def test_the_longest_durations_and_the_farthest_times_work_on_every_backend(backend, clock):
    """What a refused value is refused for: the longest retention, aging and rate period, and
    a message due at the last microsecond a datetime holds (MariaDB's DATETIME too)."""
    from sqla_delayedq import DelayedQueue
    from sqla_delayedq._time import LONGEST

    last = datetime.max.replace(tzinfo=UTC)
    q: DelayedQueue[Any] = DelayedQueue(
        "far", retention=LONGEST, priorities=True, priority_aging=LONGEST, clock=clock
    )
    with backend.Session() as s, s.begin():
        q.offer(s, "now", 1)
        q.offer(s, "last", 2, last)
        env = q.try_poll(s)  # its first probe reads the messages due since now - LONGEST
        assert env is not None and env.key == "now"
        assert q.ack(s, env)
        assert q.prune(s) == 0 and q.prune(s, LONGEST) == 0  # done just now: kept
        assert q.prune(s, timedelta(0)) == 0
        clock.advance(1)
        assert q.prune(s, timedelta(0)) == 1
        assert q.get(s, "last").scheduled_at == last
        assert q.reschedule(s, "last", last - timedelta(microseconds=1)) == 1
        assert q.get(s, "last").scheduled_at == last - timedelta(microseconds=1)
        assert q.set_limits(s, rate=(1, LONGEST)).rate_period == LONGEST
        assert q.controls(s).rate_period == LONGEST
    with backend.Session() as s, s.begin():
        assert q.try_poll(s) is None  # under the rate's controls: nothing due


def test_payload_type_is_recorded_and_checked(backend, make_queue):
    writer = make_queue(serializer=JsonSerializer("order.v1"))
    reader = make_queue(serializer=JsonSerializer("order.v2"))
    with backend.Session() as s, s.begin():
        writer.offer(s, "k", {"id": 1})
        assert writer.get(s, "k").payload_type == "order.v1"
    with backend.Session() as s, s.begin():
        assert reader.try_poll(s) is None  # mismatched type: buried, not delivered
        info = reader.get(s, "k")
        assert info.status == "dead" and "order.v1" in info.last_error
        assert isinstance(DecodeError("x"), DelayedQueueError)


@contextlib.contextmanager
def notifications(pg: Any) -> Iterator[Callable[[], list[str]]]:
    """``received()``: the ``NOTIFY`` payloads another connection heard on the queue table's
    channel since the last call."""
    import psycopg

    listener = psycopg.connect(
        pg.url.set(drivername="postgresql").render_as_string(hide_password=False), autocommit=True
    )
    try:
        listener.execute('LISTEN "delayedq_delayed_queue"')
        yield lambda: [n.payload for n in listener.notifies(timeout=0.3)]
    finally:
        listener.close()


def test_a_batch_insert_carries_its_notify_with_the_count_it_wrote(pg, make_queue):
    """On PostgreSQL a batch's insert sends the wake-up itself: no statement of its own, only
    for rows written, and never folded away by a later one of the same transaction."""
    q = make_queue("batched")
    with notifications(pg) as received:
        with record_sql(pg.engine) as sql, pg.Session() as s, s.begin():
            q.offer_batch(s, [("a", 1), ("b", 2), ("c", 3)])
        assert len(sql) == 1 and "INSERT INTO" in sql[0] and "pg_notify" in sql[0]
        assert received() == ["3\x1fbatched"]

        with record_sql(pg.engine) as sql, pg.Session() as s, s.begin():
            q.offer_batch(s, [("a", 1), ("b", 2)], mode="skip")  # nothing written
        assert received() == [] and len(sql) == 1

        with pytest.raises(RuntimeError), pg.Session() as s, s.begin():
            q.offer_batch(s, [("d", 4), ("e", 5)])
            raise RuntimeError("rolled back")
        assert received() == []

        with pg.Session() as s, s.begin():  # two new, one updated: the commit adds the update
            q.offer_batch(s, [("d", 4), ("e", 5), ("a", 100)])
        assert received() == ["2\x1fbatched", "1\x1fbatched"]

        # Two batches of two in one transaction: a second "2" would be folded into the first by
        # PostgreSQL; the commit announces the total instead, so no message goes unannounced.
        with pg.Session() as s, s.begin():
            q.offer_batch(s, [("f", 6), ("g", 7)])
            q.offer_batch(s, [("h", 8), ("i", 9)])
        assert received() == ["2\x1fbatched", "4\x1fbatched"]


def test_postgresql_notifies_each_committed_transaction_with_its_count(pg, make_queue):
    """The first insert carries the bare queue name (one message); the commit adds the rest."""
    q = make_queue("notified")
    with notifications(pg) as received:
        with pg.Session() as s, s.begin():
            q.offer(s, "a", 1)
            q.offer(s, "b", 2)
            q.offer_batch(s, [("c", 3), ("d", 4)])
        assert received() == ["notified", "3\x1fnotified"]
        with pytest.raises(RuntimeError), pg.Session() as s, s.begin():
            q.offer(s, "e", 5)
            raise RuntimeError("rolled back")
        assert received() == []
        with pg.Session() as s, s.begin():
            q.offer(s, "a", 100)  # an update also wakes consumers
        assert received() == ["1\x1fnotified"]
        with pg.Session() as s, s.begin():
            q.offer(s, "a", 100)  # ignored: nothing to wake anyone for
        assert received() == []
