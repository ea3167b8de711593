"""Alembic: the packaged migrations, the repository's environment, and a host project's paths.

Every path runs a real ``env.py`` through ``alembic.command`` on each backend, then checks the
result the way a user would: ``compare_metadata`` (types and server defaults included) finds no
difference from the models, what Alembic does not compare (constraints, indexes, collations,
precision) is in the catalog, and a queue offers, polls and acknowledges on the migrated table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, cast

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata, render_op_text, render_python_code
from alembic.autogenerate.api import AutogenContext
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.operations import Operations, ops
from alembic.runtime.environment import RenderItemFn
from alembic.script import ScriptDirectory
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import URL, Dialect, Engine, make_url
from sqlalchemy.orm import Session

from sqla_delayedq import DelayedMessage, DelayedQueue, Outcome, QueueMessageMixin, create_engine
from sqla_delayedq._time import DateTimeUTC
from sqla_delayedq.migration import (
    DATETIME_UTC_DDL,
    create_queue_table,
    downgrade_key_collation,
    downgrade_lock_token_index,
    drop_group_column,
    drop_headers_column,
    drop_priority_column,
    drop_queue_table,
    queue_table,
)
from sqla_delayedq.migrations import BRANCH, SCRIPT_LOCATION, VERSION_TABLE, VERSIONS
from sqla_delayedq.models import ExactString, metadata
from tests.host_app.models import Base, Customer, OutboxMessage

REPO = Path(__file__).resolve().parents[1]
HOST_APP = Path(__file__).resolve().parent / "host_app"
VERSION_TABLES = {"alembic_version", VERSION_TABLE}
#: The tables the packaged revisions create: the message table and the dashboard's two.
OUR_TABLES = {"delayed_queue", "delayedq_workers", "delayedq_stats", "delayedq_queue_controls"}


# -- helpers -------------------------------------------------------------------------------------


def alembic_config(ini: Path | None, url: URL | str, **kwargs: Any) -> Config:
    """A Config as ``alembic -c <ini> -x url=<url>`` builds it, quiet and logging-neutral.

    Without an ini file: the packaged migrations, as a pip install runs them.
    """
    rendered = url.render_as_string(hide_password=False) if isinstance(url, URL) else url
    config = Config(
        None if ini is None else str(ini),
        stdout=io.StringIO(),
        cmd_opts=argparse.Namespace(x=[f"url={rendered}"]),
        **kwargs,
    )
    if ini is None:
        config.set_main_option("script_location", SCRIPT_LOCATION)
    config.attributes["configure_logger"] = False  # leave the test session's logging alone
    return config


@pytest.fixture
def engine_for() -> Iterator[Any]:
    made: list[Engine] = []

    def make(url: URL) -> Engine:
        made.append(create_engine(url, poolclass=sa.NullPool))
        return made[-1]

    yield make
    for engine in made:
        engine.dispose()


def schema_diff(
    engine: Engine, target: sa.MetaData | list[sa.MetaData], *, only_table: str | None = None
) -> list[Any]:
    """What autogenerate would change, types and server defaults included.

    Version tables are not a difference; nor, with ``only_table``, are the database's other tables.
    """

    def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
        if type_ != "table":
            return True
        return name not in VERSION_TABLES and only_table in (None, name)

    opts = {"compare_type": True, "compare_server_default": True, "include_name": include_name}
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts=opts)
        return list(compare_metadata(context, cast(Any, target)))


def schema_diff_before_0008(engine: Engine) -> list[Any]:
    """:func:`schema_diff` against the models at a revision before ``delayedq_0008``: less the
    change it makes (``rate_period`` in double precision on MariaDB/MySQL)."""

    def made_by_0008(change: Any) -> bool:
        ops = change if isinstance(change, list) else [change]
        return all(op[0] == "modify_type" and op[2:4] == CONTROLS_PERIOD for op in ops)

    return [change for change in schema_diff(engine, metadata) if not made_by_0008(change)]


CONTROLS_PERIOD = ("delayedq_queue_controls", "rate_period")


def table_names(engine: Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names()) - VERSION_TABLES


def versions(engine: Engine, table: str = VERSION_TABLE) -> set[str]:
    """The revisions recorded in a version table (none when the table does not exist)."""
    if not sa.inspect(engine).has_table(table):
        return set()
    with engine.connect() as conn:
        return set(conn.scalars(sa.text(f"SELECT version_num FROM {table}")))


#: Column facts per backend that Alembic's type comparison does not see (it passes a key column
#: with a PAD SPACE collation or a ``DATETIME`` without microseconds on MariaDB), read from
#: information_schema: column -> (data type, collation or precision).
COLUMN_FACTS: dict[str, tuple[str, dict[str, tuple[str, Any]]]] = {
    "postgresql": (
        "SELECT column_name, data_type, datetime_precision FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name = :table",
        {
            "id": ("bigint", None),
            "payload": ("jsonb", None),
            "payload_bytes": ("bytea", None),
            "scheduled_at": ("timestamp with time zone", 6),
            "created_at": ("timestamp with time zone", 6),
        },
    ),
    "mariadb": (
        "SELECT column_name, data_type, coalesce(collation_name, CAST(datetime_precision AS CHAR)) "
        "FROM information_schema.columns "
        "WHERE table_schema = database() AND table_name = :table",
        {
            "id": ("bigint", None),
            "queue": ("varchar", "utf8mb4_nopad_bin"),
            "key": ("varchar", "utf8mb4_nopad_bin"),
            "payload": ("longtext", "utf8mb4_bin"),  # MariaDB's JSON: LONGTEXT + json_valid()
            "payload_bytes": ("longblob", None),
            "scheduled_at": ("datetime", "6"),
            "created_at": ("datetime", "6"),
        },
    ),
}


def key_collations(engine: Engine, table: str) -> dict[str, str]:
    """MariaDB: the collations of ``queue`` and ``key``."""
    with engine.connect() as conn:
        found = conn.execute(
            sa.text(
                "SELECT column_name, collation_name FROM information_schema.columns "
                "WHERE table_schema = database() AND table_name = :table "
                "AND column_name IN ('queue', 'key')"
            ),
            {"table": table},
        )
        return {str(name): str(collation) for name, collation in found}


def lock_token_index(backend: str, engine: Engine, table: str) -> str:
    """Whether ``ix_<table>_lock_token`` is "partial" (``WHERE lock_token IS NOT NULL``) or
    "full", from the catalog's own DDL (MariaDB has no partial indexes)."""
    name = f"ix_{table}_lock_token"
    if backend == "mariadb":
        indexes = {ix["name"] for ix in sa.inspect(engine).get_indexes(table)}
        assert name in indexes
        return "full"
    query = {
        "postgresql": "SELECT indexdef FROM pg_indexes WHERE indexname = :name",
        "sqlite": "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = :name",
    }[backend]
    with engine.connect() as conn:
        ddl = conn.execute(sa.text(query), {"name": name}).scalar_one()
    if "WHERE" not in ddl.upper():
        return "full"
    assert "lock_token IS NOT NULL" in ddl.replace("(", "").replace(")", ""), ddl
    return "partial"


def assert_queue_table(backend: str, engine: Engine, name: str) -> None:
    """What compare_metadata does not look at: check constraints, collations, precision."""
    inspector = sa.inspect(engine)
    indexes = {ix["name"] for ix in inspector.get_indexes(name)}
    assert {f"ix_{name}_due", f"ix_{name}_lock_token"} <= indexes
    uniques = {uq["name"]: uq["column_names"] for uq in inspector.get_unique_constraints(name)}
    assert uniques[f"uq_{name}_queue_key"] == ["queue", "key"]
    checks = {ck["name"] for ck in inspector.get_check_constraints(name)}
    assert f"ck_{name}_status" in checks
    assert lock_token_index(backend, engine, name) == (
        "full" if backend == "mariadb" else "partial"
    )
    if backend in COLUMN_FACTS:
        query, expected = COLUMN_FACTS[backend]
        with engine.connect() as conn:
            rows = conn.execute(sa.text(query), {"table": name}).all()
        actual = {row[0]: (row[1].lower(), row[2]) for row in rows}
        assert {column: actual[column] for column in expected} == expected


def assert_queue_works(engine: Engine, model: type[QueueMessageMixin]) -> None:
    queue: DelayedQueue[dict[str, int]] = DelayedQueue("q", model=model)
    with Session(engine) as session, session.begin():
        if model is OutboxMessage:  # the host's point: its own row and the message, one commit
            session.add(Customer(email="ada@example.com", name="Ada"))
        assert queue.offer(session, "welcome/1", {"customer_id": 1}).outcome is Outcome.CREATED
    with Session(engine) as session, session.begin():
        envelope = queue.try_poll(session)
        assert envelope is not None
        assert (envelope.key, envelope.payload) == ("welcome/1", {"customer_id": 1})
        assert queue.ack(session, envelope)
    with Session(engine) as session, session.begin():
        assert queue.try_poll(session) is None
        assert session.scalar(sa.select(sa.func.count()).select_from(model)) == 0


def host_database(backend: str, engine: Engine) -> None:
    """Give a MariaDB host database the usual case-insensitive default collation.

    The fixture's databases default to ``utf8mb4_bin``; a host's usually do not, and that is when
    the mixin's key columns must bring their own collation.
    """
    if backend == "mariadb":
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"ALTER DATABASE `{engine.url.database}` "
                "CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
            )


def host_copy(tmp_path: Path, *, keep_versions: bool) -> Path:
    """The host's alembic.ini and migrations/ in a temp dir, so revisions are written there."""
    root = tmp_path / "host"
    shutil.copytree(HOST_APP, root, ignore=shutil.ignore_patterns("__pycache__"))
    if not keep_versions:
        for revision in (root / "migrations" / "versions").glob("*.py"):
            revision.unlink()
    return root


#: A host revision that applies the key collation fix to its own table, as docs/alembic.md shows.
HOST_KEY_COLLATION_REVISION = """
from sqla_delayedq.migration import downgrade_key_collation, upgrade_key_collation

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    upgrade_key_collation("outbox")


def downgrade() -> None:
    downgrade_key_collation("outbox")
"""


# -- the packaged migrations and the repository's environment ---------------------------------


def test_packaged_revisions_in_order_build_the_mixin_table(
    fresh_database: tuple[str, URL], engine_for: Any
) -> None:
    """Every revision in turn ends at the mixin's table: a schema change needs a revision."""
    backend, url = fresh_database
    engine = engine_for(url)
    config = alembic_config(None, url)
    script = ScriptDirectory.from_config(config)
    revisions = [rev.revision for rev in reversed(list(script.walk_revisions()))]
    assert script.get_revision(revisions[0]).branch_labels == {BRANCH}

    for revision in revisions:
        command.upgrade(config, revision)
        assert versions(engine) == {revision}

    assert versions(engine, "alembic_version") == set()  # a host's version table is untouched
    assert table_names(engine) == OUR_TABLES
    assert schema_diff(engine, metadata) == []
    assert_queue_table(backend, engine, "delayed_queue")
    assert_queue_works(engine, DelayedMessage)

    command.downgrade(config, "base")

    assert table_names(engine) == set()
    assert versions(engine) == set()


def test_repo_upgrade_head_then_downgrade_base(
    fresh_database: tuple[str, URL], engine_for: Any
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    config = alembic_config(REPO / "alembic.ini", url)

    command.upgrade(config, "head")

    assert table_names(engine) == OUR_TABLES
    assert versions(engine) == set(ScriptDirectory.from_config(config).get_heads())
    assert schema_diff(engine, metadata) == []
    command.check(config)  # the env's own autogenerate settings agree: nothing to generate
    assert_queue_table(backend, engine, "delayed_queue")
    assert_queue_works(engine, DelayedMessage)

    command.downgrade(config, "base")

    assert table_names(engine) == set()


def test_repo_environment_runs_the_packaged_revisions() -> None:
    repo = ScriptDirectory.from_config(alembic_config(REPO / "alembic.ini", "sqlite://"))
    packaged = ScriptDirectory.from_config(alembic_config(None, "sqlite://"))

    def listing(script: ScriptDirectory) -> list[tuple[str, str]]:
        return [(rev.revision, Path(rev.path).name) for rev in script.walk_revisions()]

    assert listing(repo) == listing(packaged)
    assert (REPO / "alembic" / "script.py.mako").read_text() == (
        Path(packaged.dir) / "script.py.mako"
    ).read_text()


def test_repo_migrations_run_on_the_callers_connection(
    fresh_database: tuple[str, URL], engine_for: Any
) -> None:
    _, url = fresh_database
    engine = engine_for(url)
    config = alembic_config(REPO / "alembic.ini", "unused://")

    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "head")

    assert table_names(engine) == OUR_TABLES
    assert schema_diff(engine, metadata) == []


def test_check_ignores_a_hosts_tables_in_the_same_database(
    fresh_database: tuple[str, URL], engine_for: Any
) -> None:
    _, url = fresh_database
    engine = engine_for(url)
    Base.metadata.create_all(engine)
    config = alembic_config(None, url)

    command.upgrade(config, "head")

    command.check(config)  # would propose dropping customers and outbox if it compared them
    assert table_names(engine) == {"customers", "outbox", *OUR_TABLES}


@pytest.mark.parametrize(
    ("url", "expected", "absent"),
    [
        (
            "postgresql+psycopg://u@localhost/app",
            ["payload JSONB", "TIMESTAMP WITH TIME ZONE", "BIGSERIAL"],
            ["COLLATE"],
        ),
        (
            "mysql+pymysql://u@localhost/app",
            ["COLLATE utf8mb4_bin", "COLLATE utf8mb4_0900_bin", "LONGBLOB", "DATETIME(6)"],
            ["utf8mb4_nopad_bin"],
        ),
        (
            "mariadb+pymysql://u@localhost/app",
            ["COLLATE utf8mb4_bin", "COLLATE utf8mb4_nopad_bin", "LONGBLOB", "DATETIME(6)"],
            ["utf8mb4_0900_bin"],
        ),
    ],
)
def test_repo_migrations_render_offline_sql(
    url: str, expected: list[str], absent: list[str]
) -> None:
    out = io.StringIO()
    config = alembic_config(REPO / "alembic.ini", url, output_buffer=out)

    command.upgrade(config, "head", sql=True)
    command.downgrade(config, "head:base", sql=True)

    sql = out.getvalue()
    for fragment in [
        "CREATE TABLE delayed_queue",
        "CONSTRAINT uq_delayed_queue_queue_key UNIQUE",
        "CONSTRAINT ck_delayed_queue_status CHECK",
        "CREATE INDEX ix_delayed_queue_due ON delayed_queue (queue, scheduled_at, id)",
        "CREATE INDEX ix_delayed_queue_lock_token",
        "DROP TABLE delayed_queue",
        *expected,
    ]:
        assert fragment in sql
    for fragment in absent:
        assert fragment not in sql


V0001 = sa.table(
    "delayed_queue",
    sa.column("queue"),
    sa.column("key"),
    sa.column("payload_type"),
    sa.column("payload", sa.JSON()),
    sa.column("status"),
    sa.column("scheduled_at", DateTimeUTC()),
    sa.column("scheduled_at_initially", DateTimeUTC()),
    sa.column("created_at", DateTimeUTC()),
    sa.column("attempts"),
)


#: A message row as every revision since 0001 can store it.
V0001_ROW: dict[str, Any] = {
    "queue": "q",
    "payload_type": "json",
    "payload": {"i": 0},
    "status": "pending",
    "scheduled_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    "scheduled_at_initially": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    "attempts": 0,
}


def insert_0001_row(conn: sa.Connection, key: str, i: int) -> None:
    """One message as the 0001 schema stores it (today's queue writes columns 0001 lacks)."""
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    conn.execute(
        V0001.insert().values(
            queue="q",
            key=key,
            payload_type="json",
            payload={"i": i},
            status="pending",
            scheduled_at=at,
            scheduled_at_initially=at,
            created_at=at,
            attempts=0,
        )
    )


def offer_padded_key(engine: Engine, queue: DelayedQueue[Any], key: str) -> Outcome:
    """The outcome of offering ``key + ' '`` beside ``key``, rolled back."""
    with Session(engine) as session:
        session.begin()
        outcome = queue.offer(session, f"{key} ", {"padded": True}).outcome
        session.rollback()
    return outcome


def padded_key_collides(engine: Engine, key: str) -> bool:
    """Whether ``key + ' '`` breaks the unique key beside ``key`` (rolled back)."""
    with engine.connect() as conn:
        try:
            insert_0001_row(conn, f"{key} ", -1)
        except sa.exc.IntegrityError:
            return True
        finally:
            conn.rollback()
    return False


def rows(engine: Engine, table: str) -> list[tuple[Any, ...]]:
    """Every column of every row, as the driver returns them."""
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY id"))]


def test_byte_exact_keys_revision_keeps_the_rows_of_a_0001_table(
    fresh_database: tuple[str, URL], engine_for: Any
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    config = alembic_config(None, url)
    command.upgrade(config, "delayedq_0001")
    with engine.begin() as conn:
        for i in range(100):
            insert_0001_row(conn, f"key/{i}", i)
    before = rows(engine, "delayed_queue")
    # 0001's utf8mb4_bin pads spaces on MariaDB: the padded key is the same key there.
    assert padded_key_collides(engine, "key/0") is (backend == "mariadb")

    command.upgrade(config, "delayedq_0002")

    assert rows(engine, "delayed_queue") == before
    assert not padded_key_collides(engine, "key/0")
    command.upgrade(config, "head")
    queue: DelayedQueue[dict[str, int]] = DelayedQueue("q")
    with Session(engine) as session, session.begin():
        assert queue.offer(session, "key/0 ", {"i": -1}).outcome is Outcome.CREATED
        infos = [queue.get(session, key) for key in ("key/0", "key/0 ")]
    assert [(i.key, i.payload) for i in infos if i] == [("key/0", {"i": 0}), ("key/0 ", {"i": -1})]
    assert_queue_table(backend, engine, "delayed_queue")


def column_names(engine: Engine, table: str) -> list[str]:
    return [c["name"] for c in sa.inspect(engine).get_columns(table)]


def test_headers_and_groups_revisions_keep_the_rows_of_a_0004_table(
    fresh_database: tuple[str, URL], engine_for: Any
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    config = alembic_config(None, url)
    command.upgrade(config, "delayedq_0004")
    with engine.begin() as conn:
        for i in range(100):
            insert_0001_row(conn, f"key/{i}", i)
    before = rows(engine, "delayed_queue")
    assert "headers" not in column_names(engine, "delayed_queue")

    command.upgrade(config, "delayedq_0005")
    command.upgrade(config, "delayedq_0006")

    assert [row[:-3] for row in rows(engine, "delayed_queue")] == before
    assert {row[-3:] for row in rows(engine, "delayed_queue")} == {(None, None, 0)}
    assert schema_diff_before_0008(engine) == []
    queue: DelayedQueue[dict[str, int]] = DelayedQueue("q", groups=True, priorities=True)
    with Session(engine) as session, session.begin():
        queue.offer(session, "urgent", {"i": -2}, priority=5)
        urgent = queue.try_poll(session)
        assert urgent is not None and (urgent.key, urgent.priority) == ("urgent", 5)
        old = queue.try_poll(session)
        assert old is not None and (old.key, dict(old.headers), old.group) == ("key/0", {}, None)
        queue.offer(session, "new", {"i": -1}, headers={"traceparent": "00-x"}, group="g")
    with Session(engine) as session:
        info = queue.get(session, "new")
        assert info is not None and (dict(info.headers), info.group) == (
            {"traceparent": "00-x"},
            "g",
        )
    command.upgrade(config, "head")
    assert_queue_table(backend, engine, "delayed_queue")

    command.downgrade(config, "delayedq_0004")

    assert {"headers", "group_key", "priority"}.isdisjoint(column_names(engine, "delayed_queue"))
    assert len(rows(engine, "delayed_queue")) == 102


def test_partial_lock_token_index_revision_keeps_the_rows_of_a_0006_table(
    fresh_database: tuple[str, URL], engine_for: Any
) -> None:
    """``delayedq_0007``: the lock-token index covers leased rows only (PostgreSQL, SQLite), and
    a lease taken before the upgrade is still acknowledged by its token after it."""
    backend, url = fresh_database
    engine = engine_for(url)
    config = alembic_config(None, url)
    command.upgrade(config, "delayedq_0006")
    with engine.begin() as conn, Operations.context(MigrationContext.configure(conn)):
        downgrade_lock_token_index()  # the index as every version before 0007 created it
    queue: DelayedQueue[dict[str, int]] = DelayedQueue("q")
    with Session(engine) as session, session.begin():
        queue.offer_batch(session, [(f"key/{i}", {"i": i}) for i in range(100)])
    with Session(engine) as session, session.begin():
        leased = queue.try_poll_many(session, 3)
    assert lock_token_index(backend, engine, "delayed_queue") == "full"
    before = rows(engine, "delayed_queue")

    command.upgrade(config, "delayedq_0007")

    assert rows(engine, "delayed_queue") == before
    assert_queue_table(backend, engine, "delayed_queue")
    assert schema_diff_before_0008(engine) == []
    with Session(engine) as session, session.begin():
        assert queue.ack_many(session, leased) == 3
        assert queue.counts(session).pending == 97

    command.downgrade(config, "delayedq_0006")

    assert lock_token_index(backend, engine, "delayed_queue") == "full"
    assert len(rows(engine, "delayed_queue")) == 97
    command.upgrade(config, "head")  # and again: harmless on an index that is partial already
    assert lock_token_index(backend, engine, "delayed_queue") == (
        "full" if backend == "mariadb" else "partial"
    )


def test_plain_alembic_runs_the_packaged_revisions_from_a_one_line_ini(tmp_path: Path) -> None:
    """``script_location = sqla_delayedq:migrations`` alone in an ``alembic.ini``, as the docs
    say: the environment configured logging from any ini file and failed on one without
    logging sections (``KeyError: 'formatters'``; found in review)."""
    (tmp_path / "alembic.ini").write_text("[alembic]\nscript_location = sqla_delayedq:migrations\n")
    url = f"sqlite:///{tmp_path / 'app.sqlite'}"
    done = subprocess.run(
        [sys.executable, "-m", "alembic", "-x", f"url={url}", "upgrade", "head"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    engine = create_engine(url, poolclass=sa.NullPool)
    try:
        assert "delayed_queue" in table_names(engine)
    finally:
        engine.dispose()


def test_rate_period_revision_keeps_a_long_period_exact(
    fresh_database: tuple[str, URL], engine_for: Any
) -> None:
    """``delayedq_0008``: the rate period in double precision on MariaDB/MySQL, where a
    ``FLOAT`` read ``12 days, 1 s`` back as 12 days (a window shorter than the one set; found in
    review). Elsewhere it was double precision already, and the revision changes nothing."""
    backend, url = fresh_database
    engine = engine_for(url)
    config = alembic_config(None, url)
    command.upgrade(config, "delayedq_0007")
    queue: DelayedQueue[dict[str, int]] = DelayedQueue("q")
    period = dt.timedelta(days=12, seconds=1)

    def stored() -> dt.timedelta | None:
        with Session(engine) as session, session.begin():
            queue.set_limits(session, rate=(1, period))
        with Session(engine) as session:
            return queue.controls(session).rate_period

    assert stored() == (dt.timedelta(days=12) if backend == "mariadb" else period)

    command.upgrade(config, "delayedq_0008")

    assert schema_diff(engine, metadata) == []
    assert stored() == period
    command.downgrade(config, "delayedq_0007")
    assert schema_diff_before_0008(engine) == []


#: A host revision that adds the headers and group columns to a table made by an earlier version.
HOST_HEADERS_REVISION = """
from sqla_delayedq.migration import (
    add_group_column,
    add_headers_column,
    add_priority_column,
    downgrade_lock_token_index,
    drop_group_column,
    drop_headers_column,
    drop_priority_column,
    upgrade_lock_token_index,
)

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_headers_column("outbox")
    add_group_column("outbox")
    add_priority_column("outbox")
    upgrade_lock_token_index("outbox")


def downgrade() -> None:
    downgrade_lock_token_index("outbox")
    drop_priority_column("outbox")
    drop_group_column("outbox")
    drop_headers_column("outbox")
"""


def test_host_revision_adds_headers_and_groups_to_an_older_table(
    fresh_database: tuple[str, URL], engine_for: Any, tmp_path: Path
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    host_database(backend, engine)
    root = host_copy(tmp_path, keep_versions=True)
    versions_dir = root / "migrations" / "versions"
    (versions_dir / "0002_byte_exact_keys.py").write_text(HOST_KEY_COLLATION_REVISION)
    (versions_dir / "0003_headers.py").write_text(HOST_HEADERS_REVISION)
    config = alembic_config(root / "alembic.ini", url)
    command.upgrade(config, "0002")
    with engine.begin() as conn, Operations.context(MigrationContext.configure(conn)):
        drop_priority_column("outbox")  # the outbox as sqla_delayedq 0.1 created it
        drop_group_column("outbox")
        drop_headers_column("outbox")
        downgrade_lock_token_index("outbox")
    with engine.begin() as conn:
        conn.execute(
            sa.table("outbox", *[sa.column(c.name, c.type) for c in V0001.c]).insert(),
            [dict(V0001_ROW, key=f"k/{i}") for i in range(20)],
        )
    before = rows(engine, "outbox")

    command.upgrade(config, "head")

    assert [row[:-3] for row in rows(engine, "outbox")] == before
    assert schema_diff(engine, Base.metadata) == []
    assert_queue_table(backend, engine, "outbox")
    queue: DelayedQueue[dict[str, int]] = DelayedQueue("q", model=OutboxMessage, groups=True)
    with Session(engine) as session, session.begin():
        queue.offer(session, "k/0", {"i": 1}, headers={"request-id": "r1"})
        queue.offer(session, "g/1", {"i": 1}, group="g")
        queue.offer(session, "g/2", {"i": 2}, group="g")
    with Session(engine) as session, session.begin():
        taken = {e.key: dict(e.headers) for e in queue.try_poll_many(session, 30)}
    assert len(taken) == 21 and taken["k/0"] == {"request-id": "r1"} and taken["k/1"] == {}
    assert "g/1" in taken and "g/2" not in taken  # one of the group at a time

    # On a table that has the column already (made by today's create_queue_table): harmless.
    command.downgrade(config, "base")
    command.upgrade(config, "head")
    assert schema_diff(engine, Base.metadata) == []


# -- a host project ------------------------------------------------------------------------------


def stock_project(tmp_path: Path, url: URL) -> Path:
    """``alembic init``, then ``target_metadata`` and ``sqlalchemy.url`` set; no render_item."""
    ini = tmp_path / "stock" / "alembic.ini"
    ini.parent.mkdir()
    command.init(Config(str(ini), stdout=io.StringIO()), str(ini.parent / "migrations"))
    rendered = url.render_as_string(hide_password=False).replace("%", "%%")
    ini.write_text(ini.read_text().replace("driver://user:pass@localhost/dbname", rendered))
    env = ini.parent / "migrations" / "env.py"
    env.write_text(
        env.read_text().replace(
            "target_metadata = None",
            "from tests.host_app.models import Base\ntarget_metadata = Base.metadata",
        )
    )
    assert "render_item" not in env.read_text()
    return ini


@pytest.fixture
def logging_kept() -> Iterator[None]:
    """Undo what a stock env.py's ``fileConfig()`` does to the test session's logging."""
    manager = logging.Logger.manager
    root = logging.getLogger()
    saved_root = (root.level, root.handlers[:])
    saved = {
        name: (logger.disabled, logger.level, logger.handlers[:], logger.propagate)
        for name, logger in manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    yield
    root.setLevel(saved_root[0])
    root.handlers[:] = saved_root[1]
    for name, logger in manager.loggerDict.items():
        if isinstance(logger, logging.Logger):
            state = saved.get(name, (False, logging.NOTSET, [], True))
            logger.disabled, logger.level, logger.handlers[:], logger.propagate = state


def assert_plain_revision(text: str, backend: str) -> None:
    """The autogenerated outbox: the mixin's table in plain SQLAlchemy, runnable anywhere."""
    # The 'mysql' variant names MariaDB's collation when autogenerate reached MariaDB through a
    # mysql:// URL (as the fixture does), so the revision runs there as generated.
    mysql_collation = "utf8mb4_nopad_bin" if backend == "mariadb" else "utf8mb4_0900_bin"
    for fragment in [
        "op.create_table('outbox'",
        "op.f('uq_outbox_queue_key')",
        "op.f('ck_outbox_status')",
        "op.create_index(op.f('ix_outbox_due'), 'outbox', ['queue', 'scheduled_at', 'id']",
        "op.create_index(op.f('ix_outbox_lock_token'), 'outbox', ['lock_token']",
        "postgresql.JSONB(astext_type=sa.Text())",  # Alembic alone omits sa. off PostgreSQL
        "sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6)",
        "sa.Column('key', sa.String(length=200).with_variant(mysql.VARCHAR(length=200, "
        "charset='utf8mb4', collation='utf8mb4_nopad_bin'), 'mariadb').with_variant("
        f"mysql.VARCHAR(length=200, charset='utf8mb4', collation='{mysql_collation}'), 'mysql')",
        "from sqlalchemy.dialects import mysql",
        "from sqlalchemy.dialects import postgresql",
    ]:
        assert fragment in text
    assert "sqla_delayedq" not in text  # frozen DDL: no import of, or name from, this package


def test_host_autogenerate_with_the_render_item_hook(
    fresh_database: tuple[str, URL], engine_for: Any, tmp_path: Path
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    host_database(backend, engine)
    root = host_copy(tmp_path, keep_versions=False)
    assert "render_item=render_item" in (root / "migrations" / "env.py").read_text()
    config = alembic_config(root / "alembic.ini", url)

    command.revision(config, message="customers and outbox", autogenerate=True)

    [revision] = (root / "migrations" / "versions").glob("*.py")
    assert_plain_revision(revision.read_text(), backend)

    command.upgrade(config, "head")

    assert table_names(engine) == {"customers", "outbox"}
    assert schema_diff(engine, Base.metadata) == []
    assert_queue_table(backend, engine, "outbox")
    assert_queue_works(engine, OutboxMessage)

    command.downgrade(config, "base")

    assert table_names(engine) == set()


def test_stock_env_autogenerate_without_a_hook_runs_as_generated(
    fresh_database: tuple[str, URL], engine_for: Any, tmp_path: Path, logging_kept: None
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    host_database(backend, engine)
    ini = stock_project(tmp_path, url)
    config = Config(str(ini), stdout=io.StringIO())

    command.revision(config, message="customers and outbox", autogenerate=True)

    [revision] = (ini.parent / "migrations" / "versions").glob("*.py")
    assert_plain_revision(revision.read_text(), backend)

    command.upgrade(config, "head")

    assert table_names(engine) == {"customers", "outbox"}
    assert schema_diff(engine, Base.metadata) == []
    assert_queue_table(backend, engine, "outbox")
    assert_queue_works(engine, OutboxMessage)

    command.downgrade(config, "base")

    assert table_names(engine) == set()


def test_host_hand_written_migration_with_helper_operations(
    fresh_database: tuple[str, URL], engine_for: Any, tmp_path: Path
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    host_database(backend, engine)
    root = host_copy(tmp_path, keep_versions=True)
    # The key collation fix too, on a table that has it already: harmless.
    (root / "migrations" / "versions" / "0002_byte_exact_keys.py").write_text(
        HOST_KEY_COLLATION_REVISION
    )
    config = alembic_config(root / "alembic.ini", url)

    command.upgrade(config, "head")

    assert table_names(engine) == {"customers", "outbox"}
    assert schema_diff(engine, Base.metadata) == []
    assert schema_diff(engine, queue_table("outbox").metadata, only_table="outbox") == []
    assert_queue_table(backend, engine, "outbox")
    assert_queue_works(engine, OutboxMessage)

    command.downgrade(config, "base")

    assert table_names(engine) == set()


def test_host_revision_makes_the_keys_of_an_older_table_byte_exact(
    fresh_database: tuple[str, URL], engine_for: Any, tmp_path: Path
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    host_database(backend, engine)
    root = host_copy(tmp_path, keep_versions=True)
    (root / "migrations" / "versions" / "0002_byte_exact_keys.py").write_text(
        HOST_KEY_COLLATION_REVISION
    )
    config = alembic_config(root / "alembic.ini", url)
    command.upgrade(config, "0001")
    with engine.begin() as conn, Operations.context(MigrationContext.configure(conn)):
        downgrade_key_collation("outbox")  # the outbox as sqla_delayedq 0.1 created it
    queue: DelayedQueue[dict[str, int]] = DelayedQueue("q", model=OutboxMessage)
    with Session(engine) as session, session.begin():
        assert queue.offer(session, "k", {"i": 1}).outcome is Outcome.CREATED
    padded = Outcome.UPDATED if backend == "mariadb" else Outcome.CREATED
    assert offer_padded_key(engine, queue, "k") is padded
    before = rows(engine, "outbox")

    command.upgrade(config, "head")

    assert rows(engine, "outbox") == before
    assert_queue_table(backend, engine, "outbox")
    assert schema_diff(engine, Base.metadata) == []
    with Session(engine) as session, session.begin():
        assert queue.offer(session, "k ", {"i": 2}).outcome is Outcome.CREATED
    if backend == "mariadb":  # the padded collation cannot hold both keys
        with pytest.raises(sa.exc.IntegrityError):
            command.downgrade(config, "0001")
        with Session(engine) as session, session.begin():
            assert queue.drop(session, "k ")

    command.downgrade(config, "0001")

    if backend == "mariadb":
        assert key_collations(engine, "outbox") == {"queue": "utf8mb4_bin", "key": "utf8mb4_bin"}


def test_host_runs_the_packaged_revisions_beside_its_own_history(
    fresh_database: tuple[str, URL], engine_for: Any, tmp_path: Path
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    host_database(backend, engine)
    root = host_copy(tmp_path, keep_versions=True)
    ini = root / "alembic.ini"
    # As docs/alembic.md says: a separator that is not ':' and the packaged revisions as a resource.
    ini.write_text(
        ini.read_text().replace(
            "path_separator = os\n",
            "path_separator = newline\n"
            f"version_locations =\n    %(here)s/migrations/versions\n    {VERSIONS}\n",
        )
    )
    config = alembic_config(ini, url)
    ours = ScriptDirectory.from_config(alembic_config(None, url)).get_heads()

    command.upgrade(config, "heads")

    assert table_names(engine) == {"customers", "outbox", *OUR_TABLES}
    assert versions(engine, "alembic_version") == {"0001", *ours}  # one version table: the host's
    assert versions(engine) == set()
    assert schema_diff(engine, [Base.metadata, metadata]) == []
    assert_queue_table(backend, engine, "delayed_queue")
    assert_queue_works(engine, DelayedMessage)

    command.downgrade(config, f"{BRANCH}@base")

    assert table_names(engine) == {"customers", "outbox"}
    assert versions(engine, "alembic_version") == {"0001"}


# -- the module itself ---------------------------------------------------------------------------

DIALECTS = ("postgresql+psycopg", "mysql+pymysql", "mariadb+pymysql", "sqlite")


def dialect(name: str) -> Dialect:
    return make_url(f"{name}://").get_dialect()()


def test_queue_table_is_the_mixin_table() -> None:
    table = queue_table("outbox", schema="app")
    model = cast(sa.Table, OutboxMessage.__table__)
    assert table.fullname == "app.outbox"
    for name in DIALECTS:
        ddl = str(sa.schema.CreateTable(table).compile(dialect=dialect(name)))
        # The host's Base has no naming convention; the helper names the primary key.
        ddl = ddl.replace("app.outbox", "outbox").replace("CONSTRAINT pk_outbox ", "")
        assert ddl == str(sa.schema.CreateTable(model).compile(dialect=dialect(name)))
    assert {ix.name for ix in table.indexes} == {ix.name for ix in model.indexes}


def test_rendered_timestamp_type_matches_the_column_type() -> None:
    rendered = eval(DATETIME_UTC_DDL, {"DateTime": sa.DateTime, "mysql": mysql})
    for name in DIALECTS:
        expected = DateTimeUTC().compile(dialect=dialect(name))
        assert rendered.compile(dialect=dialect(name)) == expected


class Money(sa.types.TypeDecorator[int]):
    """A host's own custom type: the plugin must leave its rendering to Alembic and the host."""

    impl = sa.Integer
    cache_ok = True


def users_hook(type_: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    if type_ == "type" and isinstance(obj, sa.Integer) and not isinstance(obj, sa.BigInteger):
        return "MyInteger()"
    if type_ == "type" and isinstance(obj, ExactString):
        return "MyKey()"
    return False


@pytest.mark.parametrize("hook", [None, users_hook], ids=["no hook", "users hook"])
def test_plugin_renders_the_mixin_types_in_every_operation_and_only_those(
    hook: RenderItemFn | None,
) -> None:
    table = cast(sa.Table, OutboxMessage.__table__)
    upgrade = ops.UpgradeOps(
        ops=[
            ops.CreateTableOp.from_table(table),
            ops.ModifyTableOps(
                "orders",
                [
                    ops.AddColumnOp("orders", sa.Column("next_at", DateTimeUTC(), nullable=True)),
                    ops.AddColumnOp("orders", sa.Column("price", Money(), nullable=True)),
                    ops.AlterColumnOp(
                        "orders", "done_at", existing_type=DateTimeUTC(), modify_nullable=True
                    ),
                ],
            ),
        ]
    )
    context = MigrationContext.configure(dialect_name="sqlite")

    code = render_python_code(
        upgrade, render_as_batch=True, render_item=hook, migration_context=context
    )

    timestamp = "sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), 'mysql', 'mariadb')"
    assert f"sa.Column('created_at', {timestamp}, nullable=False)" in code  # create table
    assert f"batch_op.add_column(sa.Column('next_at', {timestamp}, nullable=True))" in code
    assert f"batch_op.alter_column('done_at',\n               existing_type={timestamp}" in code
    assert "postgresql.JSONB(astext_type=sa.Text())" in code
    assert "sa.Column('price', tests.test_alembic.Money(), nullable=True)" in code  # untouched
    if hook is None:
        assert "sa.Column('attempts', sa.Integer(), server_default='0'" in code
        assert "sa.Column('key', sa.String(length=200).with_variant(" in code
    else:  # the host's hook has the first word, ours fills in
        assert "sa.Column('attempts', MyInteger(), server_default='0'" in code
        assert "sa.Column('key', MyKey(), nullable=False)" in code
    assert "sqla_delayedq" not in code
    # Ours is the hook only while an operation renders: the host's options are left as they were.
    opts = {"sqlalchemy_module_prefix": "sa.", "alembic_module_prefix": "op."}
    autogen = AutogenContext(context, opts={**opts, **({"render_item": hook} if hook else {})})
    assert "sa.DateTime(timezone=True)" in render_op_text(autogen, upgrade.ops[0])
    assert autogen.opts.get("render_item", "unset") == (hook or "unset")


def test_importing_the_package_does_not_import_alembic() -> None:
    code = "import sys, sqla_delayedq; assert 'alembic' not in sys.modules, 'alembic imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_helper_operations_honour_the_schema() -> None:
    out = io.StringIO()
    context = MigrationContext.configure(
        dialect_name="postgresql", opts={"as_sql": True, "output_buffer": out}
    )
    with Operations.context(context):
        create_queue_table("outbox", schema="app")
        drop_queue_table("outbox", schema="app")

    sql = out.getvalue()
    assert "CREATE TABLE app.outbox" in sql
    assert "CREATE INDEX ix_outbox_due ON app.outbox (queue, scheduled_at, id)" in sql
    assert "CREATE INDEX ix_outbox_lock_token ON app.outbox (lock_token)" in sql
    assert "DROP TABLE app.outbox" in sql
