"""Entity queues: the conformance suite on every backend, races, and the ALTER migration.

The rows of the host's own ``eq_orders`` table are the messages (seed 001). Time moves only by
the fake clock; concurrency tests count deliveries in a list, so a duplicate would show.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy import func, inspect, select, true
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from sqla_delayedq import (
    Delivery,
    Envelope,
    ExponentialBackoff,
    InvalidArgument,
    NackOutcome,
    create_engine,
)
from sqla_delayedq._consumer import PROCESS_DUE_RETRIES, Mode
from sqla_delayedq._dialects import strategy_for
from sqla_delayedq._statements import select_due_entities
from sqla_delayedq.entity import (
    EntityCounts,
    EntityQueue,
    EntityQueueMixin,
    EntityStatus,
    failed,
    pending,
    retrying,
    succeeded,
)
from sqla_delayedq.worker import Worker
from tests.entity_app.models import Base, Order, OrderBefore
from tests.fix_db import Backend
from tests.fix_queue import FakeClock

ENTITY_APP = Path(__file__).parent / "entity_app"
QUEUE_COLUMNS = (
    "queue_status",
    "queue_next_attempt_at",
    "queue_attempts",
    "queue_last_attempt_at",
    "queue_last_error",
    "queue_lock_token",
)
NO_JITTER = ExponentialBackoff(max_attempts=3, initial=timedelta(seconds=10), jitter=0)


@pytest.fixture
def db(backend: Backend) -> Iterator[Backend]:
    """Each backend, with an empty ``eq_orders`` table."""
    backend.engine.dispose()  # no pooled connection may hold a stale view of the schema
    Base.metadata.drop_all(backend.engine)
    Base.metadata.create_all(backend.engine)
    yield backend
    Base.metadata.drop_all(backend.engine)


@pytest.fixture
def server_db(server_backend: Backend) -> Iterator[Backend]:
    """PostgreSQL and MariaDB, with an empty ``eq_orders`` table."""
    Base.metadata.drop_all(server_backend.engine)
    Base.metadata.create_all(server_backend.engine)
    yield server_backend
    Base.metadata.drop_all(server_backend.engine)


@pytest.fixture
def queue(clock: FakeClock) -> EntityQueue[Order]:
    return EntityQueue(Order, clock=clock, retry=NO_JITTER, lease=timedelta(minutes=1))


def add_orders(
    sessions: sessionmaker[Session], n: int, *, company_id: int = 1, start: int = 0
) -> list[int]:
    with sessions() as s, s.begin():
        orders = [
            Order(reference=f"o-{start + i}", company_id=company_id, amount_cents=100 + i)
            for i in range(n)
        ]
        s.add_all(orders)
        s.flush()
        return [o.id for o in orders]


def row(sessions: sessionmaker[Session], order_id: int) -> Order:
    with sessions(expire_on_commit=False) as s, s.begin():
        order = s.get(Order, order_id)
        assert order is not None
        return order


# -- schema ----------------------------------------------------------------------------------


def test_mixin_adds_prefixed_columns_and_one_index_beside_the_hosts_own_table_args(
    db: Backend,
) -> None:
    insp = inspect(db.engine)
    columns = {c["name"]: c for c in insp.get_columns("eq_orders")}
    assert {name for name in columns if name.startswith("queue_")} == set(QUEUE_COLUMNS)
    assert not columns["queue_status"]["nullable"]
    assert not columns["queue_attempts"]["nullable"]
    assert columns["queue_next_attempt_at"]["nullable"]
    indexes = {ix["name"]: ix["column_names"] for ix in insp.get_indexes("eq_orders")}
    assert indexes["ix_eq_orders_queue_next_attempt_at"] == ["queue_next_attempt_at"]
    uniques = [u["column_names"] for u in insp.get_unique_constraints("eq_orders")]
    assert ["reference"] in uniques or indexes.get("uq_eq_orders_reference") == ["reference"]


def test_a_new_entity_is_idle_until_scheduled(db: Backend, queue: EntityQueue[Order]) -> None:
    [order_id] = add_orders(db.Session, 1)
    order = row(db.Session, order_id)
    assert (order.queue_status, order.queue_attempts, order.queue_next_attempt_at) == (
        EntityStatus.NEW,
        0,
        None,
    )
    with db.Session() as s, s.begin():
        assert queue.try_poll_many(s, 1) == []
        assert queue.counts(s) == EntityCounts(0, 0, 0, 0, 0, 1)


def test_server_defaults_make_rows_inserted_without_the_queue_columns_valid(
    db: Backend,
) -> None:
    with db.engine.begin() as conn:
        conn.execute(
            sa.insert(OrderBefore),
            [{"reference": "raw", "company_id": 5, "amount_cents": 1}],
        )
    with db.Session() as s:
        order = s.scalars(select(Order)).one()
        assert (order.queue_status, order.queue_attempts) == ("new", 0)


def test_rejects_models_without_the_mixin_or_with_a_composite_key() -> None:
    class Other(DeclarativeBase):
        pass

    class Plain(Other):
        __tablename__ = "plain"
        id: Mapped[int] = mapped_column(primary_key=True)

    class Pair(EntityQueueMixin, Other):
        __tablename__ = "pair"
        a: Mapped[int] = mapped_column(primary_key=True)
        b: Mapped[int] = mapped_column(primary_key=True)

    with pytest.raises(InvalidArgument, match="EntityQueueMixin"):
        EntityQueue(Plain)  # type: ignore[type-var]
    with pytest.raises(InvalidArgument, match="composite primary key"):
        EntityQueue(Pair)
    with pytest.raises(InvalidArgument, match="lease"):
        EntityQueue(Order, lease=timedelta(0))
    with pytest.raises(InvalidArgument, match="lease must be at most"):
        EntityQueue(Order, lease=timedelta.max)  # its takes failed past year 9999


# -- take and settle ---------------------------------------------------------------------------


def test_take_loads_the_entity_into_the_session_and_hides_it_for_the_lease(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        order = s.get(Order, order_id)
        assert order is not None
        assert queue.schedule(s, order) == 1
    with db.Session() as s, s.begin():
        [lease] = queue.try_poll_many(s, 1)
        assert lease.id == order_id
        assert lease.payload is s.get(Order, order_id)
        assert lease.payload.reference == "o-0"
        assert lease.payload.queue_lock_token == lease.lock_token
        assert lease.payload.queue_next_attempt_at == lease.lease_until
        assert (lease.attempt, lease.delivery.value, lease.scheduled_at) == (1, "first", clock())
        assert lease.lease_until == clock() + timedelta(minutes=1)
        # Built without the dataclass's __init__ (a hot path): every field, nothing else.
        assert set(vars(lease)) == {f.name for f in dataclasses.fields(Envelope)}
        assert (lease.headers, lease.group, lease.priority) == ({}, None, 0)
        assert dataclasses.replace(lease) == lease
    with db.Session() as s, s.begin():
        assert queue.try_poll_many(s, 1) == []
        assert queue.counts(s).in_flight == 1


def test_ack_marks_the_row_and_a_second_ack_is_harmless(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
        [lease] = queue.try_poll_many(s, 1)
    clock.advance(3)
    with db.Session() as s, s.begin():
        assert queue.ack(s, lease)
        assert not queue.ack(s, lease)
    order = row(db.Session, order_id)
    assert order.queue_status == "succeeded"
    assert order.queue_next_attempt_at is None
    assert order.queue_lock_token is None
    assert order.queue_attempts == 1
    assert order.queue_last_attempt_at == clock()
    with db.Session() as s:
        assert s.scalars(succeeded(Order)).all() == [s.get(Order, order_id)]
        assert s.scalars(pending(Order)).all() == []


def test_transactional_mode_commits_the_handlers_changes_with_the_success_mark(
    db: Backend, queue: EntityQueue[Order]
) -> None:
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
    with db.Session() as s, s.begin():
        [lease] = queue.try_poll_many(s, 1)
        lease.payload.payment_ref = "pay-1"
        lease.payload.charge_count += 1
        assert queue.ack(s, lease)
        # The Session's copy shows the new queue state without a reload.
        assert lease.payload.queue_status == "succeeded"
        assert lease.payload.queue_next_attempt_at is None
    order = row(db.Session, order_id)
    assert (order.payment_ref, order.charge_count, order.queue_status) == ("pay-1", 1, "succeeded")


def test_a_rolled_back_take_is_due_again_at_once(db: Backend, queue: EntityQueue[Order]) -> None:
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
    with db.Session() as s:
        s.begin()
        [lease] = queue.try_poll_many(s, 1)
        lease.payload.payment_ref = "lost"
        s.rollback()
    with db.Session() as s, s.begin():
        [again] = queue.try_poll_many(s, 1)
        assert again.delivery.value == "first"
        assert again.payload.payment_ref is None


def test_due_order_is_next_attempt_then_primary_key(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    ids = add_orders(db.Session, 4)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == ids[0], at=clock() + timedelta(seconds=2))
        queue.schedule(s, Order.id.in_(ids[1:]), at=clock() + timedelta(seconds=1))
        queue.schedule(s, Order.id == ids[2], at=clock() - timedelta(seconds=1))
    clock.advance(2)
    with db.Session() as s, s.begin():
        assert [lease.id for lease in queue.try_poll_many(s, 10)] == [
            ids[2],
            ids[1],
            ids[3],
            ids[0],
        ]


def test_scheduled_later_is_not_due_before_its_time(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id, at=clock() + timedelta(hours=1))
        assert queue.try_poll_many(s, 1) == []
        assert queue.counts(s).scheduled == 1
    clock.advance(timedelta(hours=1))
    with db.Session() as s, s.begin():
        assert len(queue.try_poll_many(s, 1)) == 1


def test_schedule_a_new_entity_in_its_insert(db: Backend, queue: EntityQueue[Order]) -> None:
    with db.Session() as s, s.begin():
        order = Order(reference="fresh", company_id=2, amount_cents=5)
        assert queue.schedule(s, order) == 1
    with db.Session() as s, s.begin():
        [lease] = queue.try_poll_many(s, 1)
        assert lease.payload.reference == "fresh"


def test_an_expired_lease_is_redelivered_and_the_old_lease_cannot_settle(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
        [first] = queue.try_poll_many(s, 1)
    clock.advance(timedelta(minutes=1))
    with db.Session() as s, s.begin():
        [second] = queue.try_poll_many(s, 1)
        # The lost lease counts as an attempt, as it does for messages.
        assert second.redelivered and second.attempt == 2
        assert second.lock_token != first.lock_token
    with db.Session() as s, s.begin():
        assert not queue.ack(s, first)
        assert queue.nack(s, first, "late") is NackOutcome.STALE
        assert not queue.release(s, first)
        assert queue.extend(s, first) is None
        assert queue.ack(s, second)


@pytest.mark.parametrize("then", ["old consumer acks", "the old lease runs out"])
def test_schedule_of_an_entity_loaded_before_a_take_takes_the_lease_away(
    server_db: Backend, clock: FakeClock, then: str
) -> None:
    """A request loads an order, a worker takes it, the request changes the order and
    schedules a new run. The ORM writes only what differs from what the request's Session
    loaded (no lock token then), so the take's token survived: the old consumer's ack wiped the
    new run, or the next poll counted a lost lease (with one attempt allowed: failed, its
    handler never run). The new run must be a fresh one whatever the Session loaded, and it
    waits for the old delivery to end."""
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(seconds=10), jitter=0)
    queue = EntityQueue(Order, clock=clock, retry=retry, lease=timedelta(minutes=1))
    [order_id] = add_orders(server_db.Session, 1)
    with server_db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
    web = server_db.Session()
    web.begin()
    order = web.get(Order, order_id)  # loaded idle-but-due, with no lock token
    assert order is not None
    with server_db.Session() as s, s.begin():
        [taken] = queue.try_poll_many(s, 1)  # a worker's lease-mode take commits
    order.amount_cents = 999
    queue.schedule(web, order)
    web.commit()
    web.close()
    with server_db.Session() as s, s.begin():
        assert queue.try_poll_many(s, 1) == []  # never beside the old delivery
        if then == "old consumer acks":
            assert not queue.ack(s, taken)  # the new run stays
        else:
            clock.advance(timedelta(minutes=1))
        [again] = queue.try_poll_many(s, 1)
        assert again.delivery is Delivery.FIRST and again.attempt == 1
        assert again.payload.amount_cents == 999
        assert queue.ack(s, again)


def test_nack_retries_with_backoff_then_gives_up_and_retry_failed_starts_over(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    [order_id] = add_orders(db.Session, 1, company_id=3345)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
    outcomes = []
    for attempt, delay in ((1, 10), (2, 20), (3, None)):
        with db.Session() as s, s.begin():
            [lease] = queue.try_poll_many(s, 1)
            assert lease.attempt == attempt
            outcomes.append(queue.nack(s, lease, ValueError(f"declined #{attempt}")))
        order = row(db.Session, order_id)
        assert order.queue_status == "failed"
        assert order.queue_attempts == attempt
        assert order.queue_last_attempt_at == clock()
        assert order.queue_last_error is not None
        assert order.queue_last_error.startswith(f"ValueError: declined #{attempt}")
        if delay is None:
            assert order.queue_next_attempt_at is None
        else:
            assert order.queue_next_attempt_at == clock() + timedelta(seconds=delay)
            with db.Session() as s:
                assert s.scalars(retrying(Order)).all() == [s.get(Order, order_id)]
            clock.advance(delay)
    assert outcomes == [
        NackOutcome.RETRY_SCHEDULED,
        NackOutcome.RETRY_SCHEDULED,
        NackOutcome.DEAD,
    ]
    with db.Session() as s, s.begin():
        assert queue.try_poll_many(s, 1) == []
        assert [o.id for o in s.scalars(failed(Order))] == [order_id]
        assert queue.retry_failed(s, Order.company_id == 1) == 0
        assert queue.retry_failed(s, Order.company_id == 3345) == 1
        [lease] = queue.try_poll_many(s, 1)
        assert lease.attempt == 1
        assert queue.ack(s, lease)
    order = row(db.Session, order_id)
    assert (order.queue_status, order.queue_attempts) == ("succeeded", 1)
    assert order.queue_last_error is not None  # the last failure stays on record


def test_nack_at_an_explicit_time(db: Backend, queue: EntityQueue[Order], clock: FakeClock) -> None:
    [order_id] = add_orders(db.Session, 1)
    at = clock() + timedelta(days=1)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
        [lease] = queue.try_poll_many(s, 1)
        assert queue.nack(s, lease, "provider down", at) is NackOutcome.RETRY_SCHEDULED
    assert row(db.Session, order_id).queue_next_attempt_at == at


def test_release_gives_the_entity_back_without_counting_an_attempt(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id, at=clock() - timedelta(hours=1))
        [lease] = queue.try_poll_many(s, 1)
        assert queue.release(s, lease)
    with db.Session() as s, s.begin():
        [again] = queue.try_poll_many(s, 1)
        assert (again.attempt, again.delivery.value, again.scheduled_at) == (1, "first", clock())


def test_extend_lengthens_the_lease(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
        [lease] = queue.try_poll_many(s, 1)
    clock.advance(50)
    with db.Session() as s, s.begin():
        longer = queue.extend(s, lease, timedelta(minutes=10))
        assert longer is not None and longer.lease_until == clock() + timedelta(minutes=10)
    clock.advance(timedelta(minutes=5))
    with db.Session() as s, s.begin():
        assert queue.try_poll_many(s, 1) == []
        assert queue.ack(s, longer)


def test_ack_can_delete_rows_that_only_stand_for_the_work(db: Backend, clock: FakeClock) -> None:
    queue = EntityQueue(Order, clock=clock, delete_on_success=True)
    ids = add_orders(db.Session, 2)
    with db.Session() as s, s.begin():
        queue.schedule(s, true())
        first, _ = queue.try_poll_many(s, 2)
        assert queue.ack(s, first)
        assert not queue.ack(s, first)
    with db.Session() as s:
        assert s.scalars(select(Order.id)).all() == [ids[1]]


def test_ack_many_marks_a_batch_in_one_statement_per_take(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    ids = add_orders(db.Session, 5)
    with db.Session() as s, s.begin():
        queue.schedule(s, true())
        taken = queue.try_poll_many(s, 3) + queue.try_poll_many(s, 3)
        for lease in taken:
            lease.payload.charge_count += 1
        assert queue.ack_many(s, taken) == 5
        assert {lease.payload.queue_status for lease in taken} == {"succeeded"}
    with db.Session() as s:
        orders = s.scalars(select(Order).order_by(Order.id)).all()
        assert [o.id for o in orders] == ids
        assert {(o.queue_status, o.queue_attempts, o.charge_count) for o in orders} == {
            ("succeeded", 1, 1)
        }


# -- search and admin on the user's own columns ------------------------------------------------


def test_search_by_the_users_own_columns_is_a_plain_select(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    add_orders(db.Session, 3, company_id=3345)
    add_orders(db.Session, 2, company_id=7, start=100)
    with db.Session() as s, s.begin():
        queue.schedule(s, true())
        for lease in queue.try_poll_many(s, 10):
            if lease.payload.amount_cents % 2:
                queue.nack(s, lease, "card declined")
            else:
                queue.ack(s, lease)
    with db.Session() as s:
        plain = select(Order).where(Order.company_id == 3345, Order.queue_status == "failed")
        failed_3345 = s.scalars(plain.order_by(Order.id)).all()
        assert [o.reference for o in failed_3345] == ["o-1"]
        assert s.scalars(retrying(Order).where(Order.company_id == 3345)).all() == failed_3345
        assert (
            s.scalar(
                select(func.count()).select_from(
                    succeeded(Order).where(Order.company_id == 7).subquery()
                )
            )
            == 1
        )
        assert queue.counts(s, Order.company_id == 3345) == EntityCounts(0, 1, 0, 2, 0, 0)


@pytest.mark.parametrize("via", ["condition", "entity", "detached entity"])
@pytest.mark.parametrize(
    "end", ["ack", "ack with changes", "nack", "release", "lease runs out", "extended", "again"]
)
def test_schedule_of_an_entity_in_flight_waits_for_the_old_delivery(
    db: Backend, clock: FakeClock, via: str, end: str
) -> None:
    """A new run is never taken beside the old run's handler: the entity stays in flight until
    the old delivery ends. The old consumer's ack (with or without changes to the entity), nack
    or release ends the hold and settles nothing; its heartbeat lengthens it; its death ends it
    with its lease. The new run is then a first delivery, attempts from 0, at its own time. A
    second schedule while held keeps it held, at the later schedule's time."""
    queue = EntityQueue(Order, clock=clock, retry=NO_JITTER, lease=timedelta(seconds=30))
    [order_id, other] = add_orders(db.Session, 2)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
    lease_mode = db.Session(expire_on_commit=False)
    with lease_mode.begin():
        [old] = queue.try_poll_many(lease_mode, 1)
    lease_mode.close()
    assert old.id == order_id
    clock.advance(timedelta(seconds=1))
    loaded = row(db.Session, order_id) if via == "detached entity" else None
    with db.Session() as s, s.begin():
        if via == "condition":
            assert queue.schedule(s, Order.id.in_([order_id, other])) == 2
        elif via == "entity":
            orders = s.scalars(select(Order).where(Order.id.in_([order_id, other]))).all()
            assert queue.schedule(s, orders) == 2
        else:
            assert loaded is not None and queue.schedule(s, loaded) == 1
        if via != "detached entity":
            [fresh] = queue.try_poll_many(s, 5)  # the idle one starts at once...
            assert fresh.id == other and queue.ack(s, fresh)
        assert queue.try_poll_many(s, 5) == []  # ...the one in flight waits
        counts = queue.counts(s, Order.id == order_id)
        assert (counts.in_flight, counts.due) == (1, 0)
    if end == "extended":
        with db.Session() as s, s.begin():
            assert queue.extend(s, old, timedelta(seconds=60)) is not None
        clock.advance(timedelta(seconds=40))
        with db.Session() as s, s.begin():
            assert queue.try_poll_many(s, 5) == []
    if end == "again":  # scheduled once more while held: still held, now due at the later time
        later = clock() + timedelta(minutes=5)
        with db.Session() as s, s.begin():
            assert queue.schedule(s, Order.id == order_id, at=later) == 1
            assert queue.try_poll_many(s, 5) == []
            assert not queue.ack(s, old)
            assert queue.try_poll_many(s, 5) == []  # due at its own time, not at once
        clock.set(later)
    with db.Session() as s, s.begin():
        if end in ("ack", "extended"):
            assert queue.ack(s, old) is False
        elif end == "ack with changes":
            old.payload.amount_cents = 1  # a lease-mode handler's change: not written
            assert queue.ack(s, old) is False
        elif end == "nack":
            assert queue.nack(s, old, "old failed") is NackOutcome.STALE
        elif end == "release":
            assert queue.release(s, old) is False
    if end == "lease runs out":
        with db.Session() as s, s.begin():
            assert queue.try_poll_many(s, 5) == []
        clock.advance(timedelta(seconds=30))  # the old consumer died: its lease ends
    with db.Session() as s, s.begin():
        [new] = queue.try_poll_many(s, 5)
        assert new.id == order_id and new.delivery is Delivery.FIRST and new.attempt == 1
        assert new.payload.amount_cents == 100
        assert new.payload.queue_last_error is None
        assert queue.ack(s, new)
    done = row(db.Session, order_id)
    assert (done.queue_status, done.queue_attempts) == (EntityStatus.SUCCEEDED, 1)


def test_schedule_of_an_entity_deleted_meanwhile_counts_what_it_scheduled(
    db: Backend, queue: EntityQueue[Order]
) -> None:
    order_id, _ = add_orders(db.Session, 2)
    loaded = row(db.Session, order_id)
    with db.Session() as s, s.begin():
        s.execute(sa.delete(Order).where(Order.id == order_id))
    with db.Session() as s, s.begin():
        new = Order(reference="new", company_id=1, amount_cents=1)
        assert queue.schedule(s, [new, s.merge(loaded, load=False)]) == 1
    with db.Session() as s, s.begin():
        assert queue.counts(s).due == 1


def test_stop_clears_the_next_attempt_and_wins_over_a_consumer_in_flight(
    db: Backend, queue: EntityQueue[Order]
) -> None:
    a, b, c = add_orders(db.Session, 3)
    with db.Session() as s, s.begin():
        queue.schedule(s, true())
        [lease] = queue.try_poll_many(s, 1)
        assert lease.id == a
    with db.Session() as s, s.begin():
        assert queue.stop(s, Order.id.in_([a, b])) == 2
    with db.Session() as s, s.begin():
        assert not queue.ack(s, lease)
        assert [lease.id for lease in queue.try_poll_many(s, 10)] == [c]
    assert row(db.Session, a).queue_status == "new"
    assert row(db.Session, b).queue_next_attempt_at is None


def test_process_now_moves_waiting_rows_to_now_only(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    later, flight, idle = add_orders(db.Session, 3, company_id=9)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == later, at=clock() + timedelta(days=2))
        queue.schedule(s, Order.id == flight)
        [lease] = queue.try_poll_many(s, 1)
        assert lease.id == flight
    with db.Session() as s, s.begin():
        assert queue.process_now(s, Order.company_id == 9) == 1
        [taken] = queue.try_poll_many(s, 10)
        assert (taken.id, taken.scheduled_at) == (later, clock())
    assert row(db.Session, idle).queue_next_attempt_at is None


def two_attempts_one_order(db: Backend, clock: FakeClock) -> tuple[EntityQueue[Order], int]:
    """A queue of two attempts and one order, due now."""
    queue = EntityQueue(
        Order,
        clock=clock,
        retry=dataclasses.replace(NO_JITTER, max_attempts=2),
        lease=timedelta(minutes=1),
    )
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
    return queue, order_id


def test_process_now_leaves_a_lost_lease_to_the_take_that_fails_it_after_its_last_attempt(
    db: Backend, clock: FakeClock
) -> None:
    """As for messages (docs/retries.md): its consumer died on its last attempt; process now
    does not touch it (it is due already) and the take marks it failed, undelivered."""
    queue, order_id = two_attempts_one_order(db, clock)
    attempts = []
    for _ in range(3):
        with db.Session() as s, s.begin():
            attempts += [e.attempt for e in queue.try_poll_many(s, 1)]
        clock.advance(timedelta(minutes=1))
        with db.Session() as s, s.begin():
            assert queue.process_now(s, Order.id == order_id) == 0
    assert attempts == [1, 2]
    order = row(db.Session, order_id)
    assert order.queue_status == EntityStatus.FAILED and order.queue_attempts == 2
    assert "lease ran out without an ack on 2 attempts" in (order.queue_last_error or "")


@pytest.mark.parametrize("how", ["lease", "transactional"])
def test_an_entity_that_succeeded_on_its_last_attempt_and_is_due_again_runs_a_fresh_run(
    db: Backend, clock: FakeClock, how: str
) -> None:
    """Its due time written by hand (the column, not ``schedule``): the take starts a new run,
    attempts from 0, instead of burying it as out of attempts without running its handler."""
    queue, order_id = two_attempts_one_order(db, clock)
    for outcome in ("fail", "ok"):  # succeeded on its second, last, attempt
        with db.Session() as s, s.begin():
            [lease] = queue.try_poll_many(s, 1)
            if outcome == "fail":
                queue.nack(s, lease, "once", at=clock())
            else:
                queue.ack(s, lease)
    order = row(db.Session, order_id)
    assert (order.queue_status, order.queue_attempts) == (EntityStatus.SUCCEEDED, 2)
    with db.Session() as s, s.begin():
        s.execute(
            sa.update(Order).where(Order.id == order_id).values(queue_next_attempt_at=clock())
        )
    handled: list[int] = []
    with db.Session() as s, s.begin():
        if how == "lease":
            [lease] = queue.try_poll_many(s, 1)
            handled.append(lease.attempt)
            assert queue.nack(s, lease, "the new run's first failure") is not NackOutcome.DEAD
        else:
            result = queue.process_one(s, lambda env, session: handled.append(env.attempt))
            assert result is not None and result[1] is None
    assert handled == [1]
    order = row(db.Session, order_id)
    assert order.queue_attempts == 1
    assert (order.queue_next_attempt_at is not None) == (how == "lease")  # a retry is due


def test_a_release_in_a_fresh_run_keeps_the_lost_attempt_its_take_counted(
    db: Backend, clock: FakeClock
) -> None:
    """An entity due again after it succeeded runs afresh; its consumer died (the next take
    counts the lost attempt), and that take's consumer gave it back uncounted (a stop). The
    next take saw a succeeded row without a token and started the run afresh again, forgetting
    the lost attempt: a handler that kills its worker between stops ran for ever. The take that
    counts a lost attempt now records its outcome, failed, as the column's contract says."""
    queue, order_id = two_attempts_one_order(db, clock)
    with db.Session() as s, s.begin():
        [lease] = queue.try_poll_many(s, 1)
        queue.ack(s, lease)
    with db.Session() as s, s.begin():
        s.execute(
            sa.update(Order).where(Order.id == order_id).values(queue_next_attempt_at=clock())
        )
    attempts: list[int] = []
    with db.Session() as s, s.begin():
        attempts += [e.attempt for e in queue.try_poll_many(s, 1)]  # its consumer dies
    clock.advance(timedelta(minutes=1))
    with db.Session() as s, s.begin():
        [lease] = queue.try_poll_many(s, 1)
        attempts.append(lease.attempt)
        assert lease.payload.queue_status == EntityStatus.FAILED  # as the take wrote it
        assert queue.release(s, lease)  # a stop gives it back, uncounted
    with db.Session() as s, s.begin():
        attempts += [e.attempt for e in queue.try_poll_many(s, 1)]  # its consumer dies again
    assert attempts == [1, 2, 2]
    clock.advance(timedelta(minutes=1))
    with db.Session() as s, s.begin():
        assert queue.try_poll_many(s, 1) == []  # out of attempts: failed, not delivered
    order = row(db.Session, order_id)
    assert (order.queue_status, order.queue_attempts) == (EntityStatus.FAILED, 2)
    assert "lease ran out without an ack on 2 attempts" in (order.queue_last_error or "")


def test_schedule_by_filter_starts_a_fresh_run_and_resets_the_lease(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    ids = add_orders(db.Session, 3, company_id=4)
    with db.Session() as s, s.begin():
        assert queue.schedule(s, Order.company_id == 4) == 3
        [lease] = queue.try_poll_many(s, 1)
        queue.nack(s, lease, "once")
    at = clock() + timedelta(minutes=30)
    with db.Session() as s, s.begin():
        assert queue.schedule(s, Order.id == ids[0], at=at) == 1
    order = row(db.Session, ids[0])
    assert (order.queue_attempts, order.queue_next_attempt_at) == (0, at)


def test_admin_updates_refresh_entities_already_in_the_session(
    db: Backend, queue: EntityQueue[Order]
) -> None:
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        order = s.get(Order, order_id)
        assert order is not None and order.queue_next_attempt_at is None
        queue.schedule(s, Order.id == order_id)
        assert order.queue_next_attempt_at is not None
        queue.stop(s, Order.id == order_id)
        assert order.queue_next_attempt_at is None
        # Inserted in this session: its unset nullable columns were never loaded.
        fresh = Order(reference="fresh", company_id=1, amount_cents=1)
        s.add(fresh)
        s.flush()
        assert fresh.queue_next_attempt_at is None
        assert queue.schedule(s, Order.id == fresh.id) == 1
        assert fresh.queue_next_attempt_at is not None
        assert queue.stop(s, Order.id == fresh.id) == 1
        assert fresh.queue_next_attempt_at is None


def test_bad_input_is_rejected_before_any_sql(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    [order_id] = add_orders(db.Session, 1)
    order = row(db.Session, order_id)
    with db.Session() as s, s.begin():
        with pytest.raises(InvalidArgument, match="instance attribute"):
            queue.stop(s, order.id == order_id)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="instance attribute"):
            queue.schedule(s, order.id == order_id)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="naive"):
            queue.schedule(s, Order.id == order_id, at=clock().replace(tzinfo=None))
        with pytest.raises(InvalidArgument, match="positive"):
            queue.try_poll_many(s, 0)
        with pytest.raises(InvalidArgument, match="entities or a SQL condition"):
            queue.schedule(s, ["x"])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument, match="whereclause"):
            queue.schedule(s, failed(Order))  # type: ignore[arg-type]
        assert queue.counts(s).pending == 0


# -- served by the worker --------------------------------------------------------------------


class Provider:
    """A payment provider that declines the amounts it is told to, counting every call."""

    def __init__(self, declines: set[int]) -> None:
        self.declines = declines
        self.calls: list[int] = []

    def charge(self, envelope: Envelope[Order], session: Session | None = None) -> None:
        order = envelope.payload
        self.calls.append(order.id)
        if order.amount_cents in self.declines:
            raise RuntimeError(f"declined {order.amount_cents}")
        order.charge_count += 1
        order.payment_ref = f"pay-{order.id}"


@pytest.mark.parametrize("mode", ["transactional", "lease"])
def test_a_worker_commits_success_with_the_handlers_changes_and_rolls_back_failures(
    db: Backend, queue: EntityQueue[Order], mode: Mode
) -> None:
    """Transactional mode commits the handler's changes with the mark; lease mode writes the
    changes to the entity's own columns with the ack. A failed attempt writes none of them."""
    ids = add_orders(db.Session, 4)
    provider = Provider(declines={101})
    with db.Session() as s, s.begin():
        queue.schedule(s, true())
    worker = Worker(db.Session).register(queue, provider.charge, mode=mode)
    assert worker.process_due(limit=3) == 3
    assert worker.process_due() == 1
    assert worker.process_due() == 0
    assert sorted(provider.calls) == ids
    with db.Session() as s:
        orders = {o.id: o for o in s.scalars(select(Order))}
        declined = orders.pop(ids[1])
        assert (declined.charge_count, declined.payment_ref) == (0, None)
        assert declined.queue_status == "failed"
        assert declined.queue_last_error is not None
        assert "declined 101" in declined.queue_last_error
        for order in orders.values():
            assert (order.charge_count, order.queue_status) == (1, "succeeded")
            assert order.payment_ref == f"pay-{order.id}"


def test_a_lease_mode_ack_writes_only_the_columns_the_handler_changed(
    db: Backend, queue: EntityQueue[Order]
) -> None:
    """Another writer's change to a column the handler left alone survives the ack."""
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, true())
    with db.Session(expire_on_commit=False) as s, s.begin():
        [envelope] = queue.try_poll_many(s, 1)
    with db.Session() as s, s.begin():  # the application edits the order meanwhile
        s.get(Order, order_id).amount_cents = 999
    envelope.payload.payment_ref = "pay-x"  # the handler's change, on its snapshot
    with db.Session() as s, s.begin():
        assert queue.ack(s, envelope)
    order = row(db.Session, order_id)
    assert (order.payment_ref, order.amount_cents, order.queue_status) == (
        "pay-x",
        999,
        "succeeded",
    )


def test_a_lease_mode_ack_made_again_after_its_transaction_failed_still_writes_the_changes(
    db: Backend, queue: EntityQueue[Order]
) -> None:
    """The worker acknowledges again after a transaction that failed before its commit (a
    deadlock, a lost connection). The first try had marked the handler's changes committed on
    its snapshot, so the second wrote a plain success: the row ended succeeded without them
    (found in review: a payment charged, its reference never stored)."""
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, true())
    with db.Session(expire_on_commit=False) as s, s.begin():
        [envelope] = queue.try_poll_many(s, 1)
    envelope.payload.payment_ref = "pay-1"  # the handler's change, on its snapshot
    with db.Session() as s:
        s.begin()
        assert queue.ack(s, envelope)
        s.rollback()  # the transaction fails before its commit
    assert row(db.Session, order_id).queue_status != "succeeded"
    with db.Session() as s, s.begin():
        assert queue.ack(s, envelope)
    order = row(db.Session, order_id)
    assert (order.payment_ref, order.queue_status) == ("pay-1", "succeeded")
    assert envelope.payload.queue_status == "succeeded"  # the snapshot shows the settle


@pytest.mark.parametrize("how", ["record_failure", "worker"])
def test_a_fresh_runs_transactional_failure_that_rolls_back_is_counted(
    db: Backend, clock: FakeClock, how: str
) -> None:
    """An entity due again after it succeeded runs afresh (attempts from 0). Its transactional
    handler raised ``SystemExit``: the take rolled back, and the failure's record looked for
    the row with one attempt fewer than its take counted, where the row still had the old
    run's. Nothing was recorded, and every worker ran it again as attempt 1, for ever (found
    in review)."""
    queue, order_id = two_attempts_one_order(db, clock)
    with db.Session() as s, s.begin():
        [lease] = queue.try_poll_many(s, 1)
        queue.ack(s, lease)
    runs: list[int] = []
    taken: list[Envelope[Order]] = []
    for _ in range(2):
        with db.Session() as s, s.begin():  # due again: written by hand, a new run
            s.execute(
                sa.update(Order)
                .where(Order.id == order_id, Order.queue_status == EntityStatus.SUCCEEDED)
                .values(queue_next_attempt_at=clock())
            )

        def bail(env: Envelope[Order], session: Session) -> None:
            runs.append(env.attempt)
            taken.append(env)
            raise SystemExit("bail")

        if how == "worker":
            worker = Worker(db.Session, concurrency=1, listen=False, keep_statistics=False)
            worker.register(queue, bail, mode="transactional")
            with pytest.raises(SystemExit):
                worker.process_due()
        else:
            with db.Session() as s, pytest.raises(SystemExit), s.begin():
                queue.process_one(s, bail)
            with db.Session() as s, s.begin():
                assert queue.record_failure(s, taken[-1], "bail") is not NackOutcome.STALE
        clock.advance(timedelta(hours=1))  # past the retry's time
    worker = Worker(db.Session, concurrency=1, listen=False, keep_statistics=False)
    worker.register(queue, bail, mode="transactional")
    assert worker.process_due() == 0
    order = row(db.Session, order_id)
    assert runs == [1, 2]  # then out of attempts: not run again
    assert (order.queue_status, order.queue_attempts) == (EntityStatus.FAILED, 2)
    assert order.queue_next_attempt_at is None and "bail" in (order.queue_last_error or "")


def test_a_transactional_take_leaves_the_next_due_entity_to_other_consumers(
    server_db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    """A transactional take locked one entity more than it took (to say whether more was due)
    for its whole transaction, the handler's: a second consumer found nothing due until the
    first handler ended, though two were (found in review: two 3 s handlers started 3 s
    apart)."""
    db = server_db
    add_orders(db.Session, 2)
    with db.Session() as s, s.begin():
        queue.schedule(s, true())
    # Later than their due time: MariaDB 10.11's SKIP LOCKED range scan up to a bound equal
    # to the due time of a row it skipped returns nothing at all (a frozen clock's case).
    clock.advance(timedelta(seconds=1))
    first: list[int] = []
    with db.Session() as s, s.begin():
        queue.process_one(s, lambda env, session: first.append(env.id))
        with db.Session() as other, other.begin():  # while the first handler's transaction runs
            second = queue.process_one(other, lambda env, session: None)
            assert second is not None and second[0].id not in first
    with db.Session() as s:
        assert queue.counts(s).succeeded == 2


class _Stamped(DeclarativeBase):
    pass


class Invoice(EntityQueueMixin, _Stamped):
    """An entity whose ``revision`` and ``touched`` change on every update of the application."""

    __tablename__ = "eq_invoices"

    id: Mapped[int] = mapped_column(primary_key=True)
    total: Mapped[int] = mapped_column(default=0)
    revision: Mapped[int] = mapped_column(default=0, onupdate=sa.literal_column("revision + 1"))
    touched: Mapped[str] = mapped_column(sa.String(20), default="new", onupdate="changed")


def test_the_queue_s_writes_leave_the_owner_s_self_updating_columns_alone(
    db: Backend, clock: FakeClock
) -> None:
    """Takes, heartbeats, settles and admin calls are ``UPDATE`` statements on the owner's
    table: SQLAlchemy added every ``onupdate`` column to them, so an ``updated_at`` changed on
    each take and each heartbeat, where the queue's columns "cannot clash with yours" (found
    in review). A handler's own change still goes through the ORM's rules."""
    _Stamped.metadata.create_all(db.engine)
    try:
        queue = EntityQueue(Invoice, clock=clock, retry=NO_JITTER, lease=timedelta(minutes=1))
        with db.Session() as s, s.begin():
            s.add_all([Invoice(id=1), Invoice(id=2), Invoice(id=3)])
        with db.Session() as s, s.begin():
            queue.schedule(s, true())
        with db.Session(expire_on_commit=False) as s, s.begin():
            taken = queue.try_poll_many(s, 3)
        with db.Session() as s, s.begin():
            [lease] = [e for e in taken if e.id == 1]
            assert queue.extend(s, lease) is not None
            assert queue.ack(s, lease)
            assert queue.nack(s, next(e for e in taken if e.id == 2), "once") is not None
            assert queue.release(s, next(e for e in taken if e.id == 3))
        with db.Session() as s, s.begin():
            queue.process_now(s, true())
            queue.stop(s, Invoice.id == 3)
        with db.Session() as s:
            rows = s.execute(sa.select(Invoice.id, Invoice.revision, Invoice.touched)).all()
        assert sorted(tuple(r) for r in rows) == [(1, 0, "new"), (2, 0, "new"), (3, 0, "new")]
        with db.Session() as s, s.begin():  # the application's own update still bumps them
            s.get(Invoice, 1).total = 5
        with db.Session() as s:
            assert s.get(Invoice, 1).revision == 1
    finally:
        _Stamped.metadata.drop_all(db.engine)


def _deadlock() -> sa.exc.OperationalError:
    import pymysql

    return sa.exc.OperationalError(
        "SELECT ... FOR UPDATE SKIP LOCKED", {}, pymysql.err.OperationalError(1213, "Deadlock")
    )


@pytest.mark.parametrize("mode", ["transactional", "lease"])
def test_process_due_takes_again_after_a_deadlocked_take(
    db: Backend, queue: EntityQueue[Order], mode: Mode, monkeypatch: pytest.MonkeyPatch
) -> None:
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, true())
    real_take = EntityQueue._poll
    takes: list[int] = []

    def flaky_take(self: EntityQueue[Order], session: Session, *args: Any, **kw: Any) -> Any:
        takes.append(1)
        if len(takes) <= 2:
            raise _deadlock()
        return real_take(self, session, *args, **kw)

    monkeypatch.setattr(EntityQueue, "_poll", flaky_take)
    handled: list[int] = []

    def handler(envelope: Envelope[Order], session: Session | None = None) -> None:
        handled.append(envelope.payload.id)

    worker = Worker(db.Session).register(queue, handler, mode=mode)
    assert worker.process_due() == 1
    assert handled == [order_id]
    assert len(takes) >= 3


def test_process_due_gives_up_on_lasting_or_non_transient_take_errors(
    db: Backend, queue: EntityQueue[Order], monkeypatch: pytest.MonkeyPatch
) -> None:
    add_orders(db.Session, 1)
    errors: list[Exception] = [_deadlock(), ValueError("a bug")]
    takes: list[int] = []

    def failing_take(self: EntityQueue[Order], session: Session, n: int, **kw: Any) -> Any:
        takes.append(n)
        raise errors[0]

    monkeypatch.setattr(EntityQueue, "poll_batch", failing_take)
    worker = Worker(db.Session).register(queue, lambda env: None)
    with pytest.raises(sa.exc.OperationalError):
        worker.process_due()
    assert len(takes) == PROCESS_DUE_RETRIES + 1
    errors.pop(0)
    takes.clear()
    with pytest.raises(ValueError, match="a bug"):
        worker.process_due()
    assert len(takes) == 1


# -- statements and plans --------------------------------------------------------------------


def compiled(stmt: Any, dialect: Any) -> str:
    return str(stmt.compile(dialect=dialect))


DIALECTS: dict[str, Any] = {
    "postgresql": postgresql.dialect,
    "mariadb": mysql.dialect,
    "sqlite": sqlite.dialect,
}


def test_the_take_locks_with_skip_locked_where_the_backend_has_it(
    queue: EntityQueue[Order],
) -> None:
    def sql(backend: str, lock: Any) -> str:
        return compiled(
            select_due_entities(Order, queue.shape, queue.now(), 5, lock), DIALECTS[backend]()
        )

    pg = sql("postgresql", "update_skip_locked")
    maria = sql("mariadb", "update_skip_locked")
    lite = sql("sqlite", None)
    for text in (pg, maria):
        assert "FOR UPDATE SKIP LOCKED" in text
        assert "ORDER BY eq_orders.queue_next_attempt_at, eq_orders.id" in text
    assert "FOR UPDATE" not in lite


def test_the_take_on_postgresql_is_an_index_scan(pg: Backend, queue: EntityQueue[Order]) -> None:
    Base.metadata.drop_all(pg.engine)
    Base.metadata.create_all(pg.engine)
    add_orders(pg.Session, 200)
    with pg.Session() as s, s.begin():
        s.execute(sa.text("ANALYZE eq_orders"))
        s.execute(sa.text("SET LOCAL enable_seqscan = off"))
        stmt = select_due_entities(Order, queue.shape, queue.now(), 10, "update_skip_locked")
        conn = s.connection()
        sql = stmt.compile(dialect=conn.dialect)
        plan = "\n".join(conn.exec_driver_sql("EXPLAIN " + sql.string, sql.params).scalars())
    Base.metadata.drop_all(pg.engine)
    assert "ix_eq_orders_queue_next_attempt_at" in plan, plan


def test_strategy_capabilities_decide_the_take(db: Backend) -> None:
    with db.Session() as s:
        lock = strategy_for(s).poll_lock
    assert lock == (None if db.name == "sqlite" else "update_skip_locked")


# -- races -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("transactional", [True, False], ids=["transactional", "lease"])
def test_eight_consumers_process_two_thousand_entities_exactly_once(
    server_db: Backend, clock: FakeClock, transactional: bool
) -> None:
    queue = EntityQueue(Order, clock=clock, lease=timedelta(hours=1), retry=NO_JITTER)
    ids: list[int] = []
    for start in range(0, 2000, 500):
        ids += add_orders(server_db.Session, 500, start=start, company_id=start)
    with server_db.Session() as s, s.begin():
        assert queue.schedule(s, true()) == 2000
    processed: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def handler(envelope: Envelope[Order], session: Session | None = None) -> None:
        processed.append(envelope.payload.id)
        envelope.payload.charge_count += 1

    worker = Worker(server_db.Session, batch_size=5).register(
        queue, handler, mode="transactional" if transactional else "lease"
    )

    def consume() -> None:
        try:
            barrier.wait()
            while worker.process_due(limit=5):
                pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consume) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(processed) == 2000
    assert sorted(processed) == sorted(ids)
    with server_db.Session() as s:
        assert queue.counts(s) == EntityCounts(0, 0, 0, 2000, 0, 0)
        assert s.scalar(select(func.min(Order.charge_count))) == 1
        assert s.scalar(select(func.max(Order.charge_count))) == 1


# -- the ALTER migration ---------------------------------------------------------------------

ROWS = 10_000


def alembic_config(script_dir: Path) -> Config:
    """The entity app's Alembic environment, copied so generated revisions stay out of the repo."""
    shutil.copytree(
        ENTITY_APP / "migrations", script_dir, ignore=shutil.ignore_patterns("__pycache__")
    )
    cfg = Config()
    cfg.set_main_option("script_location", str(script_dir))
    cfg.set_main_option("path_separator", "os")
    return cfg


def alembic(cfg: Config, url: URL, fn: Any, *args: Any, **kwargs: Any) -> None:
    engine = create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            cfg.attributes["connection"] = conn
            fn(cfg, *args, **kwargs)
            conn.commit()
    finally:
        engine.dispose()


def autogenerate(cfg: Config, url: URL) -> str:
    """Autogenerate revision 0002 against ``url`` (at revision 0001); returns its source."""
    alembic(cfg, url, command.revision, message="entity queue", autogenerate=True, rev_id="0002")
    script_dir = Path(cfg.get_main_option("script_location") or "")
    [script] = (script_dir / "versions").glob("0002_*.py")
    return script.read_text()


def upgrade_ops(source: str) -> str:
    return source.split("def upgrade()")[1].split("def downgrade()")[0]


@pytest.mark.slow
def test_adding_the_mixin_to_a_populated_table_autogenerates_an_alter_that_runs(
    fresh_database: tuple[str, URL], tmp_path: Path, clock: FakeClock
) -> None:
    _, url = fresh_database
    cfg = alembic_config(tmp_path / "migrations")
    alembic(cfg, url, command.upgrade, "head")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.insert(OrderBefore),
                [
                    {"reference": f"r{i}", "company_id": i % 100, "amount_cents": i}
                    for i in range(ROWS)
                ],
            )

        source = autogenerate(cfg, url)
        upgrade = upgrade_ops(source)
        added = re.findall(r"op\.add_column\('eq_orders', sa\.Column\('(\w+)'", upgrade)
        assert sorted(added) == sorted(QUEUE_COLUMNS)
        assert "op.create_index(op.f('ix_eq_orders_queue_next_attempt_at')" in upgrade
        assert "server_default='new'" in upgrade and "server_default='0'" in upgrade
        assert "drop" not in upgrade and "alter_column" not in upgrade, upgrade
        assert "sqla_delayedq._time" not in source
        # The same revision whichever database it was generated against: one file runs on all.
        scratch = alembic_config(tmp_path / "scratch")
        scratch_url = URL.create("sqlite", database=str(tmp_path / "scratch.sqlite"))
        alembic(scratch, scratch_url, command.upgrade, "head")
        assert upgrade_ops(autogenerate(scratch, scratch_url)) == upgrade

        alembic(cfg, url, command.upgrade, "head")
        queue = EntityQueue(Order, clock=clock, retry=NO_JITTER)
        sessions = sessionmaker(engine)
        with sessions() as s, s.begin():
            assert queue.counts(s) == EntityCounts(0, 0, 0, 0, 0, ROWS)
            assert s.scalars(pending(Order)).first() is None
            assert queue.schedule(s, true()) == ROWS
        processed: list[int] = []
        while True:
            with sessions() as s, s.begin():
                leases = queue.try_poll_many(s, 500)
                if not leases:
                    break
                for lease in leases:
                    processed.append(lease.id)
                    lease.payload.charge_count += 1
                assert queue.ack_many(s, leases) == len(leases)
        assert len(processed) == ROWS and len(set(processed)) == ROWS
        with sessions() as s:
            assert queue.counts(s) == EntityCounts(0, 0, 0, ROWS, 0, 0)
            assert s.scalar(select(func.sum(Order.charge_count))) == ROWS

        alembic(cfg, url, command.downgrade, "0001")
        columns = {c["name"] for c in inspect(engine).get_columns("eq_orders")}
        assert not {c for c in columns if c.startswith("queue_")}
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(OrderBefore)) == ROWS
    finally:
        engine.dispose()


# -- the docs ----------------------------------------------------------------------------------


def test_the_docs_example_runs_when_pasted(tmp_path: Path) -> None:
    doc = (Path(__file__).parent.parent / "docs" / "entity-queues.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert len(blocks) >= 5
    script = tmp_path / "example.py"
    script.write_text("\n".join(blocks))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "EntityCounts(due=0, scheduled=2, in_flight=0, succeeded=2, failed=0, idle=0)"
    assert out[1].startswith("ORD-2 1 ") and out[1].endswith(
        "ProviderTimeout: no answer within 10 s for ORD-2"
    )
    assert "PaymentDeclined: 25000 is over the limit of 10000" in out[2]
    assert out[3:] == [
        "['ORD-2', 'ORD-3'] 2",
        "2",
        "[('ORD-3', 3)]",
        "1",
        "0",
        "EntityCounts(due=0, scheduled=0, in_flight=0, succeeded=3, failed=0, idle=0)",
        "1",
    ]


def test_an_entity_envelope_is_the_frozen_envelope_of_messages(
    db: Backend, queue: EntityQueue[Order]
) -> None:
    add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, true())
        [envelope] = queue.try_poll_many(s, 1)
    assert isinstance(envelope, Envelope) and isinstance(envelope.payload, Order)
    assert (envelope.queue, envelope.key) == ("eq_orders", str(envelope.id))
    with pytest.raises(AttributeError):
        envelope.attempt = 2  # type: ignore[misc]


def test_an_entity_queue_obeys_pause_and_its_in_flight_limit(
    db: Backend, queue: EntityQueue[Order]
) -> None:
    ids = add_orders(db.Session, 5)
    with db.Session() as s, s.begin():
        for order_id in ids:
            order = s.get(Order, order_id)
            assert order is not None
            queue.schedule(s, order)
        queue.pause(s)
    with db.Session() as s, s.begin():
        assert queue.try_poll_many(s, 5) == []
        assert queue.process_one(s, lambda env, sess: None) is None
    with db.Session() as s, s.begin():
        queue.resume(s)
        queue.set_limits(s, max_in_flight=2)
    with db.Session() as s, s.begin():
        taken = queue.try_poll_many(s, 5)
    assert len(taken) == 2
    with db.Session() as s, s.begin():
        assert queue.try_poll_many(s, 5) == []
        assert queue.ack(s, taken[0])
    with db.Session() as s, s.begin():
        assert len(queue.try_poll_many(s, 5)) == 1


def test_a_limited_entity_queue_processes_transactionally_under_its_rate(
    db: Backend, queue: EntityQueue[Order], clock: FakeClock
) -> None:
    ids = add_orders(db.Session, 3)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id.in_(ids))
        queue.set_limits(s, rate=(2, timedelta(seconds=10)))
    handled: list[int] = []

    def handler(env: Envelope[Order], session: Session) -> None:
        env.payload.amount_cents += 1
        handled.append(env.id)

    for _ in range(3):
        with db.Session() as s, s.begin():
            queue.process_one(s, handler)
    assert handled == ids[:2]
    assert row(db.Session, ids[0]).amount_cents == 101  # the handler's write committed
    with db.Session() as s:
        assert queue.counts(s).succeeded == 2


@pytest.mark.parametrize("change", ["schedule later", "stop", "delete"])
def test_a_transactional_handler_that_changes_its_own_entitys_run_keeps_its_writes(
    db: Backend, clock: FakeClock, change: str
) -> None:
    """A transactional handler schedules its own entity again for later (or stops it, or
    deletes the row): the mark is refused, for the handler's own change, as nobody else can
    touch the row its transaction took. That change and the handler's writes commit. The
    refusal rolled them back: the row stayed in flight under the take's lease, and was taken
    at the lease's end as a redelivery with a lost attempt (with one attempt allowed: failed,
    its handler never having failed)."""
    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(seconds=10), jitter=0)
    queue = EntityQueue(Order, clock=clock, retry=retry, lease=timedelta(seconds=30))
    [order_id] = add_orders(db.Session, 1)
    with db.Session() as s, s.begin():
        queue.schedule(s, Order.id == order_id)
    later = clock() + timedelta(minutes=5)

    def handler(envelope: Envelope[Order], session: Session) -> None:
        envelope.payload.amount_cents = 7
        if change == "schedule later":
            assert queue.schedule(session, envelope.payload, at=later) == 1
        elif change == "stop":
            assert queue.stop(session, Order.id == envelope.id) == 1
        else:
            session.delete(envelope.payload)

    with db.Session() as s, s.begin():
        processed = queue.process_one(s, handler)
        assert processed is not None and processed[1] is None
    clock.advance(timedelta(seconds=30))  # the take's lease is over
    with db.Session() as s, s.begin():
        assert queue.try_poll_many(s, 5) == []
        order = s.get(Order, order_id)
        if change == "delete":
            assert order is None
            return
        assert order is not None and order.amount_cents == 7
        assert order.queue_lock_token is None and order.queue_status == EntityStatus.NEW
    if change == "schedule later":
        clock.set(later)
        with db.Session() as s, s.begin():
            [again] = queue.try_poll_many(s, 5)
            assert again.delivery is Delivery.FIRST and again.attempt == 1
