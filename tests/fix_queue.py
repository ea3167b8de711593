"""Queue fixtures: an injectable clock (:class:`sqla_delayedq.testing.ManualClock`, the helper
users get) and queues bound to each backend."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from sqla_delayedq import DelayedQueue
from sqla_delayedq.testing import ManualClock

#: The suite's clock is the one users get: the public testing helper.
FakeClock = ManualClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_queue(clock: FakeClock) -> Callable[..., DelayedQueue[Any]]:
    def make(name: str = "q", **kwargs: Any) -> DelayedQueue[Any]:
        kwargs.setdefault("clock", clock)
        return DelayedQueue(name, **kwargs)

    return make


@contextlib.contextmanager
def record_sql(engine: Engine) -> Iterator[list[str]]:
    """Collect the SQL text of every statement the engine sends while the block runs."""
    statements: list[str] = []

    def listener(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", listener)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", listener)
