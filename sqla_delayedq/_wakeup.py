"""Wake idle consumers when an offer commits.

An offer records its ``(table, queue)`` in ``session.info``; when that transaction commits:

- the strategy sends what wakes other processes just before the commit, inside the transaction
  (``NOTIFY`` on PostgreSQL, unless the insert statement already carried it), so it is delivered
  exactly when, and only if, the messages become visible;
- in every process, local waiters registered with :func:`subscribe` are called after the commit.

Each wake-up carries how many messages the transaction offered to the queue, and a worker wakes
that many idle consumers, not all of them: one offer, one take. A ``NOTIFY`` payload is
``<count>\x1f<queue>`` (:func:`payload`), or the bare queue name for one message when an insert
carries it; the two forms never collide, so PostgreSQL does not fold one into the other.

A change of a queue's controls (:mod:`sqla_delayedq.controls`) is announced the same way with
``!\x1f<queue>``: waiters get a count of None (wake every idle consumer) after the functions
registered with :func:`on_control` have run.

Polling stays authoritative: a lost notification only delays a message by the poll interval.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sqlalchemy import event
from sqlalchemy.orm import Session


class Strategy(Protocol):
    """What a wake-up needs of a backend strategy (see :mod:`._dialects`)."""

    @property
    def has_notify(self) -> bool: ...
    def notify(self, session: Session, notes: Sequence[tuple[str, str]]) -> None: ...


__all__ = [
    "announce",
    "committed",
    "notify_pending",
    "on_control",
    "parse",
    "payload",
    "payload_tail",
    "subscribe",
]

PENDING = "sqla_delayedq.wakeups"

#: ``waiter(queue, count)``: ``count`` messages were offered to ``queue`` (None: its controls
#: changed).
Waiter = Callable[[str, int | None], None]
#: ``wake(table, queue, count)`` from a listener: ``count`` messages offered to ``queue`` of
#: ``table`` (its key, see :func:`~sqla_delayedq.models.table_key`); ``count`` None: wake every
#: idle consumer.
Wake = Callable[[str | None, str | None, int | None], None]
_SEP = "\x1f"
_CONTROL = "!"
_waiters: dict[str, set[Waiter]] = {}
_control_hooks: list[Callable[[str], None]] = []
_lock = threading.Lock()


def payload(queue: str, count: int) -> str:
    """The ``NOTIFY`` payload that announces ``count`` messages offered to ``queue``."""
    return f"{count}{payload_tail(queue)}"


def payload_tail(queue: str) -> str:
    """What follows the count in :func:`payload` (for a statement that writes the count)."""
    return f"{_SEP}{queue}"


def parse(text: str | None) -> tuple[str | None, int | None]:
    """``(queue, count)`` of a ``NOTIFY`` payload; ``count`` is None when it does not say."""
    if not text:
        return None, None
    head, sep, queue = text.partition(_SEP)
    if sep and head.isdigit():
        return queue, int(head)
    if sep and head == _CONTROL:
        return queue, None
    return text, 1


def announce(
    session: Session,
    strategy: Strategy,
    table: str,
    queue: str,
    count: int = 0,
    *,
    sent: int = 0,
    carried: str | None = None,
    control: bool = False,
) -> None:
    """Note that ``count`` messages were offered to ``queue`` of ``table`` in the session's
    current transaction.

    ``sent`` says how many of them a statement of this transaction already announced to other
    processes (a PostgreSQL insert can piggyback ``NOTIFY`` on itself), and ``carried`` with
    which payload. ``control``: the queue's controls changed.
    """
    pending: dict[tuple[str, str], list[Any]] = session.info.setdefault(PENDING, {})
    entry = pending.setdefault((table, queue), [strategy, 0, 0, False, None])
    entry[1] += count
    entry[2] += sent
    entry[3] = entry[3] or control
    entry[4] = carried or entry[4]


def on_control(hook: Callable[[str], None]) -> None:
    """Call ``hook(table)`` after each local commit that changed controls of ``table``, before
    any waiter is woken."""
    with _lock:
        _control_hooks.append(hook)


def notify_pending(session: Session, table: str, queue: str) -> bool:
    """Whether no statement of this transaction has announced ``queue`` to other processes."""
    pending: dict[tuple[str, str], list[Any]] | None = session.info.get(PENDING)
    entry = None if pending is None else pending.get((table, queue))
    return entry is None or entry[2] == 0


def subscribe(table: str, waiter: Waiter) -> Callable[[], None]:
    """Call ``waiter(queue, count)`` after each local commit that offered to ``table``.

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
    for (table, queue), (strategy, count, sent, control, carried) in pending.items():
        if not strategy.has_notify:
            continue
        notes = by_strategy.setdefault(id(strategy), (strategy, []))[1]
        if count > sent:
            # PostgreSQL drops a NOTIFY identical to one the transaction already sent: a rest
            # that reads like what an insert carried is announced as the total instead.
            note = payload(queue, count - sent)
            notes.append((table, payload(queue, count) if note == carried else note))
        if control:
            notes.append((table, f"{_CONTROL}{_SEP}{queue}"))
    for strategy, notes in by_strategy.values():
        if notes:
            strategy.notify(session, notes)


def committed(table: str, queue: str, count: int) -> None:
    """Wake this process's waiters for ``count`` messages a statement of no Session has just
    committed on its own (an autocommit offer; its ``NOTIFY`` rode in the statement)."""
    _wake({(table, queue): [None, count, count, False, None]})


def sent_alone(session: Session) -> None:
    """After statements that committed on their own, outside a Session's transaction (see
    ``_consumer.AloneSession``): send and wake what they announced, as a Session's commit does
    through the events here."""
    _send_notify(session)
    _wake_local(session)


@event.listens_for(Session, "after_commit")
def _wake_local(session: Session) -> None:
    pending: dict[tuple[str, str], list[Any]] | None = session.info.pop(PENDING, None)
    if pending:
        _wake(pending)


def _wake(pending: dict[tuple[str, str], list[Any]]) -> None:
    """Call the control hooks, then the waiters, of what a commit offered (see :func:`announce`
    for an entry's fields)."""
    with _lock:
        hooks = list(_control_hooks)
        calls: list[tuple[Waiter, str, int | None]] = [
            (w, q, None if entry[3] else entry[1])
            for (t, q), entry in pending.items()
            if entry[1] > 0 or entry[3]
            for w in _waiters.get(t, ())
        ]
    for table in {t for (t, _), entry in pending.items() if entry[3]}:
        for hook in hooks:
            hook(table)
    for waiter, queue, count in calls:
        waiter(queue, count)


@event.listens_for(Session, "after_rollback")
def _forget(session: Session) -> None:
    session.info.pop(PENDING, None)
