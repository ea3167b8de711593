"""Queue fixtures: an injectable clock and queues bound to each backend."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from sqla_delayedq import DelayedQueue


class FakeClock:
    """A clock tests move by hand; thread-safe."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2030, 1, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, delta: timedelta | float) -> datetime:
        if not isinstance(delta, timedelta):
            delta = timedelta(seconds=delta)
        with self._lock:
            self._now += delta
            return self._now


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
