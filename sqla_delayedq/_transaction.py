"""Run a unit of work in a transaction of its own, again from the start when the database
refuses it for now (a deadlock, a serialization failure, a lost connection).

The database may abort any transaction under contention; what it aborted left nothing behind,
so running the same work again is the standard remedy. ``work`` must therefore be safe to run
more than once: everything it changes in the database is rolled back between attempts, but
side effects outside it (an e-mail sent, a counter in memory) are not.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.orm import Session

from ._dialects import is_transient
from .errors import InvalidArgument

__all__ = ["run_in_transaction"]

R = TypeVar("R")
log = logging.getLogger("sqla_delayedq")


def backoff_delays(attempts: int, initial: float, maximum: float) -> list[float]:
    """Full-jitter pauses between attempts (one fewer than ``attempts``)."""
    if attempts < 1:
        raise InvalidArgument(f"attempts must be >= 1, got {attempts}")
    if initial < 0 or maximum < 0:
        raise InvalidArgument("delays must not be negative")
    return [random.uniform(0, min(maximum, initial * 2**i)) for i in range(attempts - 1)]


def run_in_transaction(
    sessions: Callable[[], Session],
    work: Callable[[Session], R],
    *,
    attempts: int = 5,
    initial_delay: float = 0.05,
    max_delay: float = 2.0,
) -> R:
    """Call ``work(session)`` inside ``session.begin()`` and commit; retry transient failures.

    ``sessions`` is a ``sessionmaker`` (or any callable returning a new ``Session``). Up to
    ``attempts`` transactions are tried, with a randomised, doubling pause in between; an error
    that is not transient, or the last transient one, is raised::

        def place_order(session):
            session.add(order)
            queue.offer(session, f"confirm/{order.id}", {"order": order.id})

        run_in_transaction(Session, place_order)
    """
    pauses = iter(backoff_delays(attempts, initial_delay, max_delay))
    attempt = 1
    while True:
        try:
            with sessions() as session, session.begin():
                return work(session)
        except Exception as exc:
            if attempt >= attempts or not is_transient(exc):
                raise
            log.info("transaction attempt %d of %d failed, retrying: %s", attempt, attempts, exc)
        time.sleep(next(pauses))
        attempt += 1
