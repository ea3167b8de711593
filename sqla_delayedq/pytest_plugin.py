"""The testing helpers as pytest fixtures; pytest loads this plugin by itself (entry point
``pytest11``), so nothing needs importing.

Fixtures (override ``delayedq_engine`` and ``delayedq_models`` in your ``conftest.py`` to test
on your own database and tables):

- ``delayedq_clock``: a :class:`~sqla_delayedq.testing.ManualClock`;
- ``delayedq_engine``: the engine to use; None (the default) for an in-memory SQLite database;
- ``delayedq_models``: the queue models whose tables are created (the default message table);
- ``delayedq_db``: a :class:`~sqla_delayedq.testing.QueueDatabase` on them;
- ``delayedq_queue``: a :class:`~sqla_delayedq.DelayedQueue` named ``"test"`` in it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from .testing import ManualClock, QueueDatabase, queue_database

__all__ = [
    "delayedq_clock",
    "delayedq_db",
    "delayedq_engine",
    "delayedq_models",
    "delayedq_queue",
]


@pytest.fixture
def delayedq_clock() -> ManualClock:
    """A clock that moves only when the test moves it."""
    return ManualClock()


@pytest.fixture
def delayedq_engine() -> Engine | None:
    """Override to return your engine; None uses a fresh in-memory SQLite database."""
    return None


@pytest.fixture
def delayedq_models() -> tuple[type[Any], ...]:
    """Override to create the tables of your own queue models instead of the default one."""
    from .models import DelayedMessage

    return (DelayedMessage,)


@pytest.fixture
def delayedq_db(
    delayedq_engine: Engine | None,
    delayedq_models: tuple[type[Any], ...],
    delayedq_clock: ManualClock,
) -> Iterator[QueueDatabase]:
    """A database with the queue tables, cleaned up after the test."""
    with queue_database(delayedq_engine, models=delayedq_models, clock=delayedq_clock) as db:
        yield db


@pytest.fixture
def delayedq_queue(delayedq_db: QueueDatabase) -> Any:
    """A JSON queue named ``"test"`` on ``delayedq_db`` and ``delayedq_clock``."""
    return delayedq_db.queue("test")
