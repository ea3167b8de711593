"""Transient database errors inside queue operations: the library's TransientError, and
``run_in_transaction`` running the caller's unit of work again until it goes through.

A lock held by another transaction plus a short lock timeout makes the server refuse an offer
for real (PostgreSQL 55P03, MariaDB 1205), without faking any driver error.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import text
from sqlalchemy.orm import Session

from sqla_delayedq import DelayedQueue, Outcome, TransientError, is_transient, run_in_transaction
from sqla_delayedq._dialects import transient_as_ours
from sqla_delayedq.aio import AsyncQueue, run_in_transaction_async
from sqla_delayedq.entity import EntityQueue
from tests.entity_app.models import Order

#: ``Connection.info`` flag: this pooled connection's lock wait was shortened.
SHORT_WAIT = "test_short_lock_wait"


def short_lock_timeout(session: Session) -> None:
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL lock_timeout = '150ms'"))
        return
    # MariaDB's setting outlives the transaction: give pooled connections back with the default,
    # so that later tests sharing the pool wait for locks as long as the server says.
    conn = session.connection()
    conn.execute(text("SET SESSION innodb_lock_wait_timeout = 1"))
    if isinstance(conn.engine.pool, sa.NullPool):
        return  # closed on return
    conn.info[SHORT_WAIT] = True
    if not sa.event.contains(conn.engine, "checkin", _default_lock_wait):
        sa.event.listen(conn.engine, "checkin", _default_lock_wait)


def _default_lock_wait(dbapi_connection: Any, record: Any) -> None:
    if dbapi_connection is not None and record.info.pop(SHORT_WAIT, False):
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")
        finally:
            cursor.close()


def hold_row(
    backend: Any,
    q: DelayedQueue[Any],
    key: str,
    seconds: float,
    until: Callable[[], bool] | None = None,
) -> threading.Thread:
    """A transaction that updates ``key`` and keeps its row lock for ``seconds``, or only until
    ``until()`` holds (at most ``seconds``)."""
    locked = threading.Event()

    def run() -> None:
        with backend.Session.begin() as s:
            q.offer(s, key, {"holder": True})
            locked.set()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not (until is not None and until()):
                time.sleep(0.02)

    thread = threading.Thread(target=run)
    thread.start()
    assert locked.wait(10)
    return thread


def test_an_offer_refused_for_now_raises_the_library_transient_error(server_backend):
    q: DelayedQueue[Any] = DelayedQueue("transient")
    with server_backend.Session.begin() as s:
        q.offer(s, "k", {"v": 0})
    holder = hold_row(server_backend, q, "k", 3)
    try:
        with (
            pytest.raises(TransientError, match="roll back the transaction") as caught,
            server_backend.Session.begin() as s,
        ):
            short_lock_timeout(s)
            q.offer(s, "k", {"v": 1})
    finally:
        holder.join()
    assert is_transient(caught.value) and is_transient(caught.value.__cause__)  # type: ignore[arg-type]
    with server_backend.Session() as s:
        assert q.get(s, "k").payload == {"holder": True}  # the refused offer wrote nothing


def test_run_in_transaction_runs_the_unit_of_work_again_until_it_commits(server_backend):
    q: DelayedQueue[Any] = DelayedQueue("retried")
    with server_backend.Session.begin() as s:
        q.offer(s, "k", {"v": 0})
    attempts: list[float] = []

    def work(s: Session) -> Outcome:
        attempts.append(time.monotonic())
        short_lock_timeout(s)
        return q.offer(s, "k", {"v": "mine"}).outcome

    # Held until a second attempt starts: the first one was refused, however slow the machine.
    holder = hold_row(server_backend, q, "k", 15, until=lambda: len(attempts) >= 2)
    try:
        outcome = run_in_transaction(server_backend.Session, work, attempts=30, initial_delay=0.1)
    finally:
        holder.join()
    assert outcome is Outcome.UPDATED
    assert len(attempts) >= 2  # at least one refused attempt ran before the one that committed
    with server_backend.Session() as s:
        assert q.get(s, "k").payload == {"v": "mine"}


def test_run_in_transaction_does_not_retry_other_errors(server_backend):
    calls: list[int] = []

    def work(s: Session) -> None:
        calls.append(1)
        raise ValueError("a bug, not the database")

    with pytest.raises(ValueError, match="a bug"):
        run_in_transaction(server_backend.Session, work, attempts=5)
    assert calls == [1]


def test_run_in_transaction_gives_up_after_its_attempts(server_backend):
    q: DelayedQueue[Any] = DelayedQueue("given-up")
    with server_backend.Session.begin() as s:
        q.offer(s, "k", {"v": 0})
    calls: list[int] = []

    def work(s: Session) -> None:
        calls.append(1)
        short_lock_timeout(s)
        q.offer(s, "k", {"v": len(calls)})

    holder = hold_row(server_backend, q, "k", 4)
    try:
        with pytest.raises(TransientError):
            run_in_transaction(server_backend.Session, work, attempts=2, initial_delay=0.01)
    finally:
        holder.join()
    assert len(calls) == 2


def test_run_in_transaction_async_runs_the_work_again(async_server_backend):
    async_backend = async_server_backend
    q: DelayedQueue[Any] = DelayedQueue("retried-async")
    aq = AsyncQueue(q)
    with async_backend.sync.Session.begin() as s:
        q.offer(s, "k", {"v": 0})
    attempts: list[int] = []

    async def work(s: Any) -> Outcome:
        attempts.append(1)
        await s.run_sync(short_lock_timeout)
        return (await aq.offer(s, "k", {"v": "async"})).outcome

    holder = hold_row(async_backend.sync, q, "k", 15, until=lambda: len(attempts) >= 2)
    try:
        outcome = asyncio.run(
            run_in_transaction_async(async_backend.sessions, work, attempts=30, initial_delay=0.1)
        )
    finally:
        holder.join()
    assert outcome is Outcome.UPDATED and len(attempts) >= 2


KILL_OWN_CONNECTION = {
    "postgresql": ("SELECT pg_backend_pid()", "SELECT pg_terminate_backend(:id)"),
    "mariadb": ("SELECT CONNECTION_ID()", "KILL CONNECTION :id"),
}


def _noop(envelope: Any, session: Session) -> None:
    pass


#: Every public operation of both kinds of queue that runs SQL, as ``(queue, session) -> ...``.
OPERATIONS: dict[str, Callable[[Any, Session], Any]] = {
    "count": lambda q, s: q.count(s),
    "count_up_to": lambda q, s: q.count_up_to(s),
    "pause": lambda q, s: q.pause(s),
    "resume": lambda q, s: q.resume(s),
    "set_limits": lambda q, s: q.set_limits(s, max_in_flight=3),
    "controls": lambda q, s: q.controls(s),
    "next_due": lambda q, s: q.next_due(s),
    "gate": lambda q, s: q.gate(s),
    "process_next": lambda q, s: q.process_next(s, _noop),
}
ENTITY_OPERATIONS: dict[str, Callable[[Any, Session], Any]] = {
    "schedule": lambda q, s: q.schedule(s, sa.true()),
    "stop": lambda q, s: q.stop(s),
    "process_now": lambda q, s: q.process_now(s),
    "retry_failed": lambda q, s: q.retry_failed(s),
    "counts": lambda q, s: q.counts(s),
    "pause": OPERATIONS["pause"],
    "set_limits": OPERATIONS["set_limits"],
    "next_due": OPERATIONS["next_due"],
    "gate": OPERATIONS["gate"],
    "process_next": OPERATIONS["process_next"],
}
CASES = [("message", name, op) for name, op in OPERATIONS.items()] + [
    ("entity", name, op) for name, op in ENTITY_OPERATIONS.items()
]


@pytest.mark.parametrize(
    ("kind", "name", "operation"), CASES, ids=[f"{kind}-{name}" for kind, name, _ in CASES]
)
def test_a_lost_connection_in_an_admin_read_raises_the_library_transient_error(
    server_backend, kind, name, operation
):
    """Every public queue operation raises ``TransientError`` (which ``run_in_transaction``
    retries) for a lost connection: ``count_up_to``, the controls (``pause``, ``resume``,
    ``set_limits``, ``controls``, ``gate``), ``next_due``, ``process_next`` and the entity
    queue's ``schedule``, ``stop``, ``process_now``, ``retry_failed`` and ``counts`` let the
    driver's ``OperationalError`` through, where their siblings raised ``TransientError``."""
    q: Any = DelayedQueue("admin-read") if kind == "message" else EntityQueue(Order)
    own_id, kill = KILL_OWN_CONNECTION[server_backend.name]
    with server_backend.Session() as s:
        conn_id = s.execute(text(own_id)).scalar_one()
        with server_backend.engine.connect() as other:
            other.execute(text(kill), {"id": conn_id})
            if server_backend.name == "postgresql":  # pg_terminate_backend only signals it
                gone = text("SELECT count(*) FROM pg_stat_activity WHERE pid = :id")
                deadline = time.monotonic() + 10
                while other.execute(gone, {"id": conn_id}).scalar_one() and (
                    time.monotonic() < deadline
                ):
                    time.sleep(0.02)
        with pytest.raises(TransientError, match="hit a transient database error"):
            operation(q, s)


def test_every_public_queue_operation_on_a_session_raises_the_library_transient_error():
    """The rule the test above checks on a server, for every public method of both kinds of
    queue that takes a session (a method added later included)."""
    wrapped = transient_as_ours(_noop).__code__
    for cls in (DelayedQueue, EntityQueue):
        for attr in dir(cls):
            fn = getattr(cls, attr)
            if attr.startswith("_") or not callable(fn) or isinstance(fn, type):
                continue
            if "session" not in inspect.signature(fn).parameters:
                continue
            assert fn.__code__ is wrapped, f"{cls.__name__}.{attr} lacks @transient_as_ours"
