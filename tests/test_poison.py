"""A payload that cannot be decoded never blocks the head of a queue.

Each kind of poison (corrupt JSON text, a payload type of another serializer, a missing payload,
a serializer that raises) is buried with its decode error, and the poll that buried it goes on
and returns the good message due behind it, in the same call, on every backend and in both
consumption modes. The read side shows the poison with its error instead of failing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import sqlalchemy as sa

from sqla_delayedq import (
    DecodeError,
    DelayedMessage,
    DelayedQueue,
    JsonSerializer,
    MessageFilter,
    State,
)

T = cast(sa.Table, DelayedMessage.__table__)


class Strict(JsonSerializer[Any]):
    """Refuses payloads without a "v" field, as a versioned schema would."""

    def decode(self, stored: Any) -> Any:
        if "v" not in stored:
            raise ValueError("no version field")
        return stored


def other_type(backend: Any) -> None:
    with backend.engine.begin() as conn:
        conn.execute(T.update().where(T.c.key == "a").values(payload_type="order.v0"))


def no_payload(backend: Any) -> None:
    with backend.engine.begin() as conn:
        conn.execute(T.update().where(T.c.key == "a").values(payload=None))


POISONS: dict[str, Callable[[Any], None]] = {
    "other-type": other_type,
    "no-payload": no_payload,
}


def poisoned_queue(backend: Any, make_queue: Callable[..., DelayedQueue[Any]], poison: str) -> Any:
    q = make_queue("poison", serializer=Strict())
    with backend.Session.begin() as s:
        q.offer(s, "a", {"v": 1})  # the head of the queue, to be poisoned
        q.offer(s, "b", {"v": 2})
        if poison == "raises":
            s.execute(T.update().where(T.c.key == "a").values(payload={"nov": 1}))
    if poison in POISONS:
        POISONS[poison](backend)
    return q


ALL = ["other-type", "no-payload", "raises"]


@pytest.mark.parametrize("poison", ALL)
def test_a_poll_buries_a_poison_head_and_returns_the_message_behind_it(backend, make_queue, poison):
    q = poisoned_queue(backend, make_queue, poison)
    with backend.Session.begin() as s:
        env = q.try_poll(s)
        assert env is not None and env.key == "b"  # the same call went on past the poison
    with backend.Session() as s:
        (dead,) = q.search(s, MessageFilter(state=State.DEAD))
    assert dead.key == "a" and dead.attempts == 1
    assert dead.decode_error and dead.last_error


@pytest.mark.parametrize("poison", ALL)
def test_consume_buries_a_poison_head_and_returns_the_message_behind_it(
    backend, make_queue, poison
):
    q = poisoned_queue(backend, make_queue, poison)
    with backend.Session.begin() as s:
        (env,) = q.consume(s, 1)
        assert env.key == "b"
    with backend.Session() as s:
        assert [m.key for m in q.search(s, MessageFilter(state=State.DEAD))] == ["a"]


def test_corrupt_json_text_on_sqlite_is_buried_not_raised(make_queue, tmp_path):
    from sqlalchemy.orm import sessionmaker

    from sqla_delayedq import create_engine
    from sqla_delayedq.models import metadata

    engine = create_engine(f"sqlite:///{tmp_path / 'corrupt.sqlite'}")
    metadata.create_all(engine)
    sessions = sessionmaker(engine)
    q = make_queue("corrupt")
    try:
        with sessions.begin() as s:
            q.offer(s, "a", {"v": 1})
            q.offer(s, "b", {"v": 2})
            q.offer(s, "c", {"v": 3})
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE delayed_queue SET payload = '{corrupt' WHERE key = 'a'"))
        with sessions() as s:  # the read side shows it with its error
            info = q.get(s, "a")
            assert info is not None and info.payload is None
            assert "corrupt" in (info.decode_error or "")
            assert len(q.search(s)) == 3
        with sessions.begin() as s:
            envs = q.try_poll_many(s, 2)
            assert [e.key for e in envs] == ["b", "c"]
        with sessions() as s:
            dead = q.get(s, "a")
            assert dead is not None and dead.state is State.DEAD
            assert "stored JSON is corrupt" in (dead.last_error or "")
        with engine.connect() as conn:  # the corrupt text is kept as evidence, unchanged
            text = sa.text("SELECT payload FROM delayed_queue WHERE key = 'a'")
            assert conn.execute(text).scalar() == "{corrupt"
        # Transactional mode re-inserts a consumed poison row; the text survives that too.
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE delayed_queue SET status = 'pending', scheduled_at = created_at "
                    "WHERE key = 'a'"
                )
            )
        with sessions.begin() as s:
            assert q.consume(s, 5) == []  # b and c are leased; a is buried again
        with engine.connect() as conn:
            row = conn.execute(
                sa.text("SELECT payload, status FROM delayed_queue WHERE key = 'a'")
            ).one()
        assert tuple(row) == ("{corrupt", "dead")
    finally:
        engine.dispose()


def test_decode_error_is_the_library_error(backend, make_queue):
    q = poisoned_queue(backend, make_queue, "raises")
    with backend.Session() as s:
        columns = [T.c[c] for c in ("payload_type", "payload", "payload_bytes")]
        row = s.execute(sa.select(*columns).where(T.c.key == "a")).one()
    with pytest.raises(DecodeError, match="no version field"):
        q.codec.decode(row)


DEEP = "[" * 5000 + "]" * 5000  # valid JSON nested deeper than Python's parser recurses


@pytest.fixture
def default_recursion_limit() -> Iterator[None]:
    """Python's default recursion limit, which some libraries raise in the test process
    (mkdocstrings, mypy): past it, ``DEEP`` would parse."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


@pytest.mark.usefixtures("default_recursion_limit")
def test_deeply_nested_headers_read_as_no_headers(backend, make_queue):
    """Stored headers nested too deep to parse raised RecursionError from every take: every
    worker stopped, and ``delayedq ls/show`` crashed. Headers never make a message
    undeliverable: they read as none, as other text that is not a JSON object does."""
    q = make_queue("deep-headers")
    with backend.Session.begin() as s:
        q.offer(s, "a", {"v": 1}, headers={"h": "1"})
    with backend.engine.begin() as conn:
        conn.execute(T.update().where(T.c.key == "a").values(headers=DEEP))
    with backend.Session() as s:
        info = q.get(s, "a")
        assert info is not None and info.headers == {}
    with backend.Session.begin() as s:
        (env,) = q.consume(s, 5)
        assert env.key == "a" and env.headers == {}


@pytest.mark.parametrize("stored", [DEEP, "[" * 5000], ids=["valid", "unterminated"])
@pytest.mark.usefixtures("default_recursion_limit")
def test_deeply_nested_json_on_sqlite_is_buried_not_raised(make_queue, tmp_path, stored):
    """A payload nested too deep to parse is a decode error of its own message (buried), not
    a RecursionError that stops the take of the messages behind it."""
    from sqlalchemy.orm import sessionmaker

    from sqla_delayedq import create_engine
    from sqla_delayedq.models import metadata

    engine = create_engine(f"sqlite:///{tmp_path / 'deep.sqlite'}")
    metadata.create_all(engine)
    sessions = sessionmaker(engine)
    q = make_queue("deep")
    try:
        with sessions.begin() as s:
            q.offer(s, "a", {"v": 1})
            q.offer(s, "b", {"v": 2})
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE delayed_queue SET payload = :p WHERE key = 'a'"), {"p": stored}
            )
        with sessions.begin() as s:
            assert [e.key for e in q.try_poll_many(s, 2)] == ["b"]
        with sessions() as s:
            dead = q.get(s, "a")
            assert dead is not None and dead.state is State.DEAD
            assert "stored JSON is corrupt" in (dead.last_error or "")
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.usefixtures("default_recursion_limit")
def test_deeply_nested_jsonb_on_postgresql_is_buried_not_raised(backend, make_queue):
    """psycopg decodes JSONB itself: a payload nested too deep to parse raised RecursionError
    from the take's fetch, and every worker stopped. The engine's JSON loader makes it a
    decode error of its own message."""
    q = make_queue("deep")
    with backend.Session.begin() as s:
        q.offer(s, "a", {"v": 1})
        q.offer(s, "b", {"v": 2})
    with backend.engine.begin() as conn:
        conn.execute(
            T.update()
            .where(T.c.key == "a")
            .values(payload=sa.literal(DEEP).op("::")(sa.text("jsonb")))
        )
    with backend.Session.begin() as s:
        assert [e.key for e in q.try_poll_many(s, 2)] == ["b"]
    with backend.Session() as s:
        dead = q.get(s, "a")
        assert dead is not None and dead.state is State.DEAD
        assert "stored JSON is corrupt" in (dead.last_error or "")
