"""Entity queues served by both workers, in-process, on every backend.

The entity queue is the message queue's consumer contract over rows of the application's own
table, so the worker serves it with the same loop: exactly once under 4 threads or tasks in
both modes, redelivery after a lease runs out (counted as an attempt), heartbeats that keep a
long handler's lease, and a graceful stop. Deliveries are counted in lists.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, true, update
from sqlalchemy.orm import Session

from sqla_delayedq import (
    Delivery,
    EntityCounts,
    EntityQueue,
    EntityStatus,
    Envelope,
    ExponentialBackoff,
)
from sqla_delayedq.worker import Worker
from tests.entity_app.models import Base, Order
from tests.fix_db import Backend
from tests.fix_workers import losing_a_commit_reply, running, stopped_by

MODES = ("lease", "transactional")


def with_tables(backend: Backend) -> Iterator[Backend]:
    backend.engine.dispose()
    Base.metadata.drop_all(backend.engine)
    Base.metadata.create_all(backend.engine)
    yield backend
    Base.metadata.drop_all(backend.engine)


@pytest.fixture
def db(backend: Backend) -> Iterator[Backend]:
    yield from with_tables(backend)


@pytest.fixture
def server_db(server_backend: Backend) -> Iterator[Backend]:
    """``db`` on PostgreSQL and MariaDB only (row locks)."""
    yield from with_tables(server_backend)


def add_scheduled(db: Backend, queue: EntityQueue[Order], n: int) -> list[int]:
    with db.Session() as s, s.begin():
        orders = [Order(reference=f"o-{i}", company_id=1, amount_cents=i) for i in range(n)]
        s.add_all(orders)
        s.flush()
        queue.schedule(s, orders)
        return [o.id for o in orders]


def wait_for(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def counts(db: Backend, queue: EntityQueue[Order]) -> EntityCounts:
    with db.Session() as s:
        return queue.counts(s)


@pytest.mark.parametrize("mode", MODES)
def test_each_entity_is_handled_exactly_once_by_four_consumers(db, make_worker, mode):
    queue = EntityQueue(Order, lease=timedelta(minutes=5))
    ids = add_scheduled(db, queue, 200)
    handled: list[int] = []  # a list: a duplicate must show
    lock = threading.Lock()

    def handler(envelope: Envelope[Order], session: Session | None = None) -> None:
        with lock:
            handled.append(envelope.payload.id)
        envelope.payload.charge_count += 1

    worker = make_worker(db, concurrency=4, poll_interval=0.1, listen=False)
    worker.register(queue, handler, mode=mode)
    with running(worker):
        assert wait_for(lambda: counts(db, queue).succeeded == 200, 60)
    assert {k: n for k, n in Counter(handled).items() if n > 1} == {}
    assert sorted(handled) == ids
    with db.Session() as s:
        charged = s.scalars(select(Order.charge_count)).all()
    assert set(charged) == {1}  # the handler's change was written once, with the success


def test_an_entity_whose_lease_ran_out_is_redelivered_as_an_attempt(db, make_worker):
    queue = EntityQueue(Order, lease=timedelta(seconds=1), retry=ExponentialBackoff(max_attempts=3))
    [order_id] = add_scheduled(db, queue, 1)
    with db.Session() as s, s.begin():  # a consumer takes it and is never heard of again
        assert len(queue.try_poll_many(s, 1)) == 1
    time.sleep(1.2)
    seen: list[tuple[Delivery, int]] = []

    def handler(envelope: Envelope[Order]) -> None:
        seen.append((envelope.delivery, envelope.attempt))

    worker = make_worker(db, concurrency=1, poll_interval=0.1, listen=False)
    worker.register(queue, handler)
    with running(worker):
        assert wait_for(lambda: counts(db, queue).succeeded == 1, 10)
    assert seen == [(Delivery.REDELIVERY, 2)]
    with db.Session() as s:
        order = s.get(Order, order_id)
        assert order is not None and order.queue_attempts == 2


@pytest.mark.parametrize("mode", MODES)
def test_an_entity_whose_last_lease_ran_out_is_failed_at_the_take_and_the_hooks_hear_it(
    db, make_worker, mode
):
    """Its one attempt was lost with its consumer: the take marks it failed without running
    the handler, and tells the worker's hooks (``buried``), as for a message."""
    from sqla_delayedq import Buried
    from sqla_delayedq.worker import WorkerHooks

    class Hooks(WorkerHooks):
        def __init__(self) -> None:
            self.buried_: list[tuple[str, Buried]] = []

        def buried(self, queue: str, buried: Buried) -> None:
            self.buried_.append((queue, buried))

    queue = EntityQueue(Order, lease=timedelta(seconds=1), retry=ExponentialBackoff(max_attempts=1))
    [order_id] = add_scheduled(db, queue, 1)
    with db.Session() as s, s.begin():  # a consumer takes it and is never heard of again
        assert len(queue.try_poll_many(s, 1)) == 1
    time.sleep(1.2)
    ran: list[int] = []
    hooks = Hooks()
    worker = make_worker(db, concurrency=1, poll_interval=0.1, listen=False, hooks=hooks)
    worker.register(
        queue,
        (lambda env: ran.append(1)) if mode == "lease" else (lambda env, s: ran.append(1)),
        mode=mode,
    )
    with running(worker):
        assert wait_for(lambda: len(hooks.buried_) == 1, 10)
    ((name, buried),) = hooks.buried_
    assert (name, buried.queue, buried.key) == (queue.name, queue.name, str(order_id))
    assert "lease ran out without an ack on 1 attempts" in buried.error
    assert ran == []
    assert counts(db, queue).failed == 1


def test_an_entity_take_whose_commit_reply_was_lost_runs_its_handler_once(db, make_worker):
    """The take commits, its reply is lost: the entity stayed leased under a token nobody held,
    then the lost lease counted as its one attempt and it failed unhandled. The worker reads
    that the take committed and runs the handler, once."""
    from sqla_delayedq._dialects import TAKE_ONLY

    retry = ExponentialBackoff(max_attempts=1, initial=timedelta(hours=1), jitter=0)
    queue = EntityQueue(Order, lease=timedelta(seconds=1), retry=retry)
    [order_id] = add_scheduled(db, queue, 1)
    seen: list[tuple[Any, Delivery, int]] = []

    def handler(envelope: Envelope[Order]) -> None:
        seen.append((envelope.id, envelope.delivery, envelope.attempt))

    with losing_a_commit_reply(lambda s: bool(s.info.get(TAKE_ONLY))) as armed:
        armed.append(True)
        worker = make_worker(
            db, concurrency=1, poll_interval=0.05, listen=False, keep_statistics=False
        )
        worker.register(queue, handler)
        with running(worker):
            assert wait_for(lambda: counts(db, queue).pending == 0, 15)
    assert not armed, "the injected fault never hit"
    assert seen == [(order_id, Delivery.FIRST, 1)]
    assert counts(db, queue).succeeded == 1


def test_a_long_lease_mode_entity_handler_keeps_its_lease(db, make_worker):
    queue = EntityQueue(Order, lease=timedelta(seconds=3))
    add_scheduled(db, queue, 1)
    delivered: list[Delivery] = []

    def handler(envelope: Envelope[Order]) -> None:
        delivered.append(envelope.delivery)
        time.sleep(7)  # two extensions (each one at half the lease left: at least 1 s to spare)

    worker = make_worker(db, concurrency=2, poll_interval=0.1, listen=False)
    worker.register(queue, handler)
    with running(worker):
        assert wait_for(lambda: counts(db, queue).succeeded == 1, 30)
    assert delivered == [Delivery.FIRST]  # the other consumer never got it


def test_stop_waits_for_an_entity_handler_in_flight(db, make_worker):
    queue = EntityQueue(Order)
    add_scheduled(db, queue, 1)
    started, finished = threading.Event(), threading.Event()

    def handler(envelope: Envelope[Order]) -> None:
        started.set()
        time.sleep(0.5)
        finished.set()

    worker = make_worker(db, concurrency=1, poll_interval=0.1, listen=False)
    worker.register(queue, handler)
    worker.start()
    try:
        assert started.wait(5)
    finally:
        assert worker.stop(drain_timeout=5) is True
    assert finished.is_set()
    assert counts(db, queue).succeeded == 1


def test_a_worker_serves_message_and_entity_queues_together(db, make_worker):
    from sqla_delayedq import DelayedQueue

    messages: DelayedQueue[Any] = DelayedQueue("beside-entities")
    entities = EntityQueue(Order)
    add_scheduled(db, entities, 3)
    with db.Session() as s, s.begin():
        messages.offer_batch(s, [(f"m{i}", {"i": i}) for i in range(3)])
        entities.schedule(s, true())
    seen: list[str] = []
    lock = threading.Lock()

    def handler(envelope: Envelope[Any]) -> None:
        with lock:
            seen.append(envelope.queue)

    worker = make_worker(db, concurrency=2, poll_interval=0.1, listen=False)
    worker.register(messages, handler).register(entities, handler)
    with running(worker):
        assert wait_for(lambda: len(seen) == 6, 15)
    assert Counter(seen) == {"beside-entities": 3, "eq_orders": 3}


@pytest.mark.parametrize("mode", MODES)
def test_entities_scheduled_again_while_in_flight_never_run_twice_at_once(db, make_worker, mode):
    """A web request changes entities and schedules them again and again while the worker runs
    them: each new run waits for the old delivery to end (never two handlers of one entity at
    once), and the last change of each entity is seen by a run of its own."""
    queue = EntityQueue(Order, lease=timedelta(seconds=30))
    ids = add_scheduled(db, queue, 8)
    lock = threading.Lock()
    running_now: Counter[int] = Counter()
    peak: Counter[int] = Counter()
    seen: dict[int, list[int]] = {i: [] for i in ids}

    def handler(envelope: Envelope[Order], session: Session | None = None) -> None:
        order_id = envelope.payload.id
        with lock:
            running_now[order_id] += 1
            peak[order_id] = max(peak[order_id], running_now[order_id])
            seen[order_id].append(envelope.payload.amount_cents)
        time.sleep(0.03)
        with lock:
            running_now[order_id] -= 1

    worker = make_worker(db, concurrency=4, poll_interval=0.05, listen=False)
    worker.register(queue, handler, mode=mode)
    version = 1_000
    with running(worker):
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            version += 1
            with db.Session() as s, s.begin():  # a change and a new run, committed together
                if version % 2:
                    orders = s.scalars(select(Order).where(Order.id.in_(ids))).all()
                    for order in orders:
                        order.amount_cents = version
                    queue.schedule(s, orders)
                else:
                    s.execute(update(Order).where(Order.id.in_(ids)).values(amount_cents=version))
                    queue.schedule(s, Order.id.in_(ids))
            time.sleep(0.01)
        assert wait_for(lambda: counts(db, queue).succeeded == len(ids), 30)
    assert max(peak.values()) == 1, peak
    assert {i: versions[-1] for i, versions in seen.items()} == dict.fromkeys(ids, version)
    assert sum(len(versions) for versions in seen.values()) > 2 * len(ids)


@pytest.mark.parametrize("after_lost_lease", [False, True], ids=["first", "after-a-lost-lease"])
@pytest.mark.parametrize("limited", [False, True], ids=["plain", "limited"])
def test_a_transactional_entity_handler_raising_a_base_exception_counts_its_attempt(
    db, make_worker, limited, after_lost_lease
):
    """A transactional handler's ``SystemExit`` rolls its take back and stops the worker. A
    message queue records the attempt apart; an entity queue did not: the entity was due again
    at once, uncounted, and stopped every next worker in turn, never reaching its last attempt.
    Now counted the same way (a limited queue's lease, taken apart, is nacked)."""
    queue = EntityQueue(Order, lease=timedelta(seconds=1), retry=ExponentialBackoff(max_attempts=3))
    [order_id] = add_scheduled(db, queue, 1)
    if limited:
        with db.Session() as s, s.begin():
            queue.set_limits(s, max_in_flight=5)
    if after_lost_lease:
        with db.Session() as s, s.begin():  # a consumer takes it and is never heard of again
            assert len(queue.try_poll_many(s, 1)) == 1
        time.sleep(1.2)
    runs: list[int] = []

    def handler(envelope: Envelope[Order], session: Session) -> None:
        runs.append(envelope.attempt)
        raise SystemExit("the handler bails out")

    worker = make_worker(db, concurrency=1, poll_interval=0.02, listen=False)
    worker.register(queue, handler, mode="transactional")
    error = stopped_by(worker, lambda: bool(runs))
    assert isinstance(error, SystemExit)
    attempt = 2 if after_lost_lease else 1
    assert runs == [attempt]  # once: the worker stopped instead of looping
    with db.Session() as s:
        order = s.get(Order, order_id)
        assert order is not None
        assert order.queue_attempts == attempt
        assert order.queue_status == EntityStatus.FAILED
        assert order.queue_lock_token is None  # not held by a lease
        assert order.queue_next_attempt_at is not None  # scheduled for its retry
        assert "SystemExit" in (order.queue_last_error or "")


def test_a_handler_holding_its_entity_row_lock_holds_up_no_other_lease(server_db):
    """A limited entity queue's transactional handler changes its entity and flushes: its
    transaction holds that row's lock until it ends. The heartbeat waited for that lock to
    extend the row's lease, and extended no other lease meanwhile: the other handler's lease
    ran out while it ran, and a second worker ran that entity beside it. Now the heartbeat's
    wait for a lock is bounded (a second on MariaDB, the least it allows), and it goes on to
    the other leases; each entity starts once (found in review)."""
    queue = EntityQueue(Order, lease=timedelta(seconds=2))
    with server_db.Session.begin() as s:
        queue.set_limits(s, max_in_flight=10)
    ids = add_scheduled(server_db, queue, 2)
    starts: list[int] = []

    def handler(envelope: Envelope[Order], session: Session) -> None:
        starts.append(envelope.payload.id)
        if envelope.payload.id == ids[0]:
            envelope.payload.charge_count += 1
            session.flush()  # its row is locked until the transaction ends
        time.sleep(5.0)  # two and a half leases

    options: dict[str, Any] = {"listen": False, "keep_statistics": False, "poll_interval": 0.1}
    first = Worker(server_db.Session, concurrency=2, **options)
    second = Worker(server_db.Session, concurrency=1, **options)
    for worker in (first, second):
        worker.register(queue, handler, mode="transactional")
    with running(first):
        assert wait_for(lambda: len(starts) == 2, 10)
        time.sleep(2.3)  # past the end of the first leases
        with running(second):
            assert wait_for(lambda: counts(server_db, queue).succeeded == 2, 15)
    assert sorted(starts) == sorted(ids)


def test_a_long_handler_keeps_its_lease_while_the_application_references_its_entity(server_db):
    """A lease-mode handler three leases long, while the application inserts rows that refer to
    its entity by a foreign key, in short transactions of its own (each share-locks the entity
    row). The heartbeat extends the lease all the same, and no other worker runs the entity
    beside it. (Found in review: a heartbeat that passed over a locked row instead of waiting
    for it let the lease run out here.)"""
    import sqlalchemy as sa

    md = sa.MetaData()
    sa.Table(Order.__tablename__, md, autoload_with=server_db.engine)
    events = sa.Table(
        "order_events",
        md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "order_id", Order.__table__.c.id.type, sa.ForeignKey(f"{Order.__tablename__}.id")
        ),
    )
    events.create(server_db.engine)
    try:
        queue = EntityQueue(Order, lease=timedelta(seconds=1))
        [order_id] = add_scheduled(server_db, queue, 1)
        running_now: list[str] = []
        overlaps: list[list[str]] = []
        lock = threading.Lock()

        def handler(envelope: Envelope[Order]) -> None:
            with lock:
                running_now.append(envelope.lock_token)
                if len(running_now) > 1:
                    overlaps.append(list(running_now))
            time.sleep(3.0)  # three leases: the heartbeat keeps it
            with lock:
                running_now.remove(envelope.lock_token)

        stop = threading.Event()

        def application() -> None:
            while not stop.is_set():
                with server_db.Session.begin() as s:
                    s.execute(events.insert().values(order_id=order_id))
                    time.sleep(0.2)  # a request's transaction
                time.sleep(0.01)

        options: dict[str, Any] = {"listen": False, "keep_statistics": False}
        first = Worker(server_db.Session, concurrency=1, poll_interval=0.05, **options)
        second = Worker(server_db.Session, concurrency=1, poll_interval=0.05, **options)
        for worker in (first, second):
            worker.register(queue, handler)
        writer = threading.Thread(target=application, daemon=True)
        with running(first):
            assert wait_for(lambda: len(running_now) == 1, 10)
            writer.start()
            try:
                with running(second):
                    assert wait_for(lambda: counts(server_db, queue).succeeded == 1, 15)
            finally:
                stop.set()
                writer.join(10)
        assert overlaps == []
    finally:
        events.drop(server_db.engine)
