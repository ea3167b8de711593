"""Wake idle consumers when an offer commits.

An offer records its ``(table, queue)`` in ``session.info``; when that transaction commits:

- the strategy sends what wakes other processes just before the commit, inside the transaction
  (``NOTIFY`` on PostgreSQL, unless the insert statement already carried it), so it is delivered
  exactly when, and only if, the messages become visible;
- in every process, local waiters registered with :func:`subscribe` are called after the commit.

Polling stays authoritative: a lost notification only delays a message by the poll interval.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import event
from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from ._dialects import Strategy

__all__ = ["announce", "notify_pending", "subscribe"]

PENDING = "sqla_delayedq.wakeups"

Waiter = Callable[[str], None]
_waiters: dict[str, set[Waiter]] = {}
_lock = threading.Lock()


def announce(
    session: Session, strategy: Strategy, table: str, queue: str, *, sent: bool = False
) -> None:
    """Note that ``queue`` of ``table`` got messages in the session's current transaction.

    ``sent`` says a statement of this transaction already carried the cross-process wake-up
    (a PostgreSQL insert can piggyback ``NOTIFY`` on itself).
    """
    pending: dict[tuple[str, str], list[Any]] = session.info.setdefault(PENDING, {})
    done = sent or not strategy.has_notify
    entry = pending.get((table, queue))
    if entry is None:
        pending[(table, queue)] = [strategy, done]
    elif done:
        entry[1] = True


def notify_pending(session: Session, table: str, queue: str) -> bool:
    """Whether this transaction still owes ``queue`` a cross-process wake-up."""
    pending: dict[tuple[str, str], list[Any]] | None = session.info.get(PENDING)
    entry = None if pending is None else pending.get((table, queue))
    return entry is None or not entry[1]


def subscribe(table: str, waiter: Waiter) -> Callable[[], None]:
    """Call ``waiter(queue)`` after each local commit that offered to ``table``.

    Returns a function that unsubscribes. Waiters must be quick and must not raise.
    """
    with _lock:
        _waiters.setdefault(table, set()).add(waiter)

    def unsubscribe() -> None:
        with _lock:
            _waiters.get(table, set()).discard(waiter)

    return unsubscribe


@event.listens_for(Session, "before_commit")
def _send_notify(session: Session) -> None:
    pending: dict[tuple[str, str], list[Any]] | None = session.info.get(PENDING)
    if not pending:
        return
    by_strategy: dict[int, tuple[Strategy, list[tuple[str, str]]]] = {}
    for key, (strategy, done) in pending.items():
        if not done:
            by_strategy.setdefault(id(strategy), (strategy, []))[1].append(key)
    for strategy, notes in by_strategy.values():
        strategy.notify(session, notes)


@event.listens_for(Session, "after_commit")
def _wake_local(session: Session) -> None:
    pending: dict[tuple[str, str], list[Any]] | None = session.info.pop(PENDING, None)
    if not pending:
        return
    with _lock:
        calls = [(w, q) for t, q in pending for w in _waiters.get(t, ())]
    for waiter, queue in calls:
        waiter(queue)


@event.listens_for(Session, "after_rollback")
def _forget(session: Session) -> None:
    session.info.pop(PENDING, None)
