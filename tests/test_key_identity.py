"""Keys and queue names are compared byte for byte, on every backend.

Two keys that differ only by a trailing space, by case, or by accent (precomposed ``é`` against
``e`` with a combining acute accent, and ``é`` against ``e``) are two messages, each created,
retrievable and delivered on its own; likewise two such queue names are two queues. MariaDB's and
MySQL's ``_bin`` collations pad spaces (``'k' = 'k '``) and their default collations ignore case
and accents, so the key columns use a NO PAD binary collation there (see ``models.ExactString``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import make_url
from sqlalchemy.schema import CreateTable

from sqla_delayedq import DelayedMessage, DelayedQueue, Outcome, UnsupportedBackend
from sqla_delayedq.models import KEY_MAX, QUEUE_MAX, exact_collation
from tests.fix_db import Backend

MakeQueue = Callable[..., DelayedQueue[Any]]

#: Pairs of strings that a collation which is not byte-exact takes for one.
LOOK_ALIKES = {
    "trailing space": ("k", "k "),
    "case": ("k", "K"),
    "composed and decomposed accent": ("\u00e9", "e\u0301"),
    "accent": ("\u00e9", "e"),
}
pairs = pytest.mark.parametrize(("first", "second"), LOOK_ALIKES.values(), ids=LOOK_ALIKES)


@pairs
def test_keys_differing_only_by_are_two_messages(
    backend: Backend, make_queue: MakeQueue, first: str, second: str
) -> None:
    queue = make_queue()
    with backend.Session() as session, session.begin():
        assert queue.offer(session, first, {"key": first}).outcome is Outcome.CREATED
        assert queue.offer(session, second, {"key": second}).outcome is Outcome.CREATED

    with backend.Session() as session, session.begin():
        for key in (first, second):
            info = queue.get(session, key)
            assert info is not None
            assert (info.key, info.payload) == (key, {"key": key})
        delivered = [(e.key, e.payload) for e in queue.try_poll_many(session, 10)]

    assert sorted(delivered) == sorted([(first, {"key": first}), (second, {"key": second})])


@pairs
def test_queue_names_differing_only_by_are_two_queues(
    backend: Backend, make_queue: MakeQueue, first: str, second: str
) -> None:
    queues = {name: make_queue(name) for name in (first, second)}
    with backend.Session() as session, session.begin():
        for name, queue in queues.items():
            assert queue.offer(session, "same key", {"queue": name}).outcome is Outcome.CREATED

    with backend.Session() as session, session.begin():
        for name, queue in queues.items():
            info = queue.get(session, "same key")
            assert info is not None
            assert (info.queue, info.payload) == (name, {"queue": name})
            delivered = [(e.key, e.payload) for e in queue.try_poll_many(session, 10)]
            assert delivered == [("same key", {"queue": name})]


# -- the column type -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "collation"),
    [
        ("mysql+pymysql://", "utf8mb4_0900_bin"),
        ("mariadb+pymysql://", "utf8mb4_nopad_bin"),
        ("postgresql+psycopg://", None),
        ("sqlite://", None),
    ],
)
def test_key_columns_get_a_byte_exact_collation_where_the_default_is_not(
    url: str, collation: str | None
) -> None:
    dialect = make_url(url).get_dialect()()
    table = cast(sa.Table, DelayedMessage.__table__)
    ddl = str(CreateTable(table).compile(dialect=dialect))
    for column, length in (("queue", QUEUE_MAX), ("key", KEY_MAX)):
        spec = f"{dialect.identifier_preparer.quote(column)} VARCHAR({length})"
        if collation:
            spec += f" CHARACTER SET utf8mb4 COLLATE {collation}"
        assert f"\n\t{spec} NOT NULL," in ddl


def test_mysql_before_8_0_17_is_refused_for_want_of_a_byte_exact_collation() -> None:
    dialect = mysql.dialect()
    dialect.server_version_info = (8, 0, 16)
    with pytest.raises(UnsupportedBackend, match=r"MySQL 8\.0\.16 .* MySQL 8\.0\.17 or later"):
        exact_collation(dialect)
    dialect.server_version_info = (8, 0, 17)
    assert exact_collation(dialect) == "utf8mb4_0900_bin"
