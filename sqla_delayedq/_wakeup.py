"""Wake idle consumers when an offer commits.

An offer records its queue in ``session.info``; when that transaction commits:

- on PostgreSQL, one ``NOTIFY`` per queue is sent just before the commit, inside the transaction,
  so it is delivered exactly when (and only if) the messages become visible;
- in every process, local waiters registered with :func:`subscribe` are called after the commit.

Polling stays authoritative: a lost notification only delays a message by the poll interval.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sqlalchemy import event, func, select
from sqlalchemy.orm import Session

__all__ = ["announce", "channel_for", "notify_pending", "subscribe"]

PENDING = "sqla_delayedq.wakeups"

Waiter = Callable[[str], None]
_waiters: dict[str, set[Waiter]] = {}
_lock = threading.Lock()


def channel_for(table_name: str) -> str:
    """The ``LISTEN``/``NOTIFY`` channel of a message table (an identifier of <= 63 bytes)."""
    return f"delayedq_{table_name}"[:63]


def announce(
    session: Session, table_name: str, queue: str, notify: bool, *, sent: bool = False
) -> None:
    """Note that ``queue`` got messages in the session's current transaction.

    ``notify`` asks for a ``NOTIFY`` before the commit; ``sent`` says a statement of this
    transaction already carried it (an offer can piggyback ``pg_notify`` on its insert).
    """
    pending: dict[tuple[str, str], bool] | None = session.info.get(PENDING)
    if pending is None:
        pending = session.info[PENDING] = {}
    key = (table_name, queue)
    pending[key] = pending.get(key, False) or sent or not notify


def notify_pending(session: Session, table_name: str, queue: str) -> bool:
    """Whether this transaction still owes ``queue`` a ``NOTIFY``."""
    pending: dict[tuple[str, str], bool] | None = session.info.get(PENDING)
    return pending is None or not pending.get((table_name, queue), False)


def subscribe(table_name: str, waiter: Waiter) -> Callable[[], None]:
    """Call ``waiter(queue)`` after each local commit that offered to ``table_name``.

    Returns a function that unsubscribes. Waiters must be quick and must not raise.
    """
    with _lock:
        _waiters.setdefault(table_name, set()).add(waiter)

    def unsubscribe() -> None:
        with _lock:
            _waiters.get(table_name, set()).discard(waiter)

    return unsubscribe


@event.listens_for(Session, "before_commit")
def _send_notify(session: Session) -> None:
    pending: dict[tuple[str, str], bool] | None = session.info.get(PENDING)
    if not pending:
        return
    notes = sorted((channel_for(t), q) for (t, q), done in pending.items() if not done)
    if notes:
        session.execute(select(*(func.pg_notify(c, q) for c, q in notes)))


@event.listens_for(Session, "after_commit")
def _wake_local(session: Session) -> None:
    pending: dict[tuple[str, str], bool] | None = session.info.pop(PENDING, None)
    if not pending:
        return
    with _lock:
        calls = [(w, q) for t, q in pending for w in _waiters.get(t, ())]
    for waiter, queue in calls:
        waiter(queue)


@event.listens_for(Session, "after_rollback")
def _forget(session: Session) -> None:
    session.info.pop(PENDING, None)
