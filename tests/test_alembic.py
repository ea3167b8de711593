"""Alembic: the repository's migrations, and both ways a host project gets its queue table.

Every path runs the real ``env.py`` through ``alembic.command`` on each backend, then checks the
result the way a user would: ``compare_metadata`` (types and server defaults included) finds no
difference from the models, the constraints Alembic does not compare are there, and a queue
offers, polls and acknowledges on the migrated table.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import URL, Dialect, Engine, make_url
from sqlalchemy.orm import Session

from sqla_delayedq import DelayedMessage, DelayedQueue, Outcome, QueueMessageMixin, create_engine
from sqla_delayedq._time import DateTimeUTC
from sqla_delayedq.migration import (
    DATETIME_UTC_DDL,
    create_queue_table,
    drop_queue_table,
    queue_table,
)
from sqla_delayedq.models import metadata
from tests.host_app.models import Base, Customer, OutboxMessage

REPO = Path(__file__).resolve().parents[1]
HOST_APP = Path(__file__).resolve().parent / "host_app"


# -- helpers -------------------------------------------------------------------------------------


def alembic_config(ini: Path, url: URL | str, **kwargs: Any) -> Config:
    """A Config as ``alembic -c <ini> -x url=<url>`` builds it, quiet and logging-neutral."""
    rendered = url.render_as_string(hide_password=False) if isinstance(url, URL) else url
    config = Config(
        str(ini),
        stdout=io.StringIO(),
        cmd_opts=argparse.Namespace(x=[f"url={rendered}"]),
        **kwargs,
    )
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


def schema_diff(engine: Engine, target: sa.MetaData, *, only_table: str | None = None) -> list[Any]:
    """What autogenerate would change, types and server defaults included."""
    opts: dict[str, Any] = {"compare_type": True, "compare_server_default": True}
    if only_table is not None:
        # Comparing against one model: the database's other tables are not a difference.
        opts["include_name"] = lambda name, type_, _: type_ != "table" or name == only_table
    with engine.connect() as conn:
        return list(compare_metadata(MigrationContext.configure(conn, opts=opts), target))


def table_names(engine: Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}


#: Column facts per backend that Alembic's type comparison does not see (it passes a key column
#: that lost ``utf8mb4_bin`` or a ``DATETIME`` without microseconds on MariaDB), read from
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
            "queue": ("varchar", "utf8mb4_bin"),
            "key": ("varchar", "utf8mb4_bin"),
            "payload": ("longtext", "utf8mb4_bin"),  # MariaDB's JSON: LONGTEXT + json_valid()
            "payload_bytes": ("longblob", None),
            "scheduled_at": ("datetime", "6"),
            "created_at": ("datetime", "6"),
        },
    ),
}


def assert_queue_table(backend: str, engine: Engine, name: str) -> None:
    """What compare_metadata does not look at: check constraints, collations, precision."""
    inspector = sa.inspect(engine)
    indexes = {ix["name"] for ix in inspector.get_indexes(name)}
    assert {f"ix_{name}_due", f"ix_{name}_lock_token"} <= indexes
    uniques = {uq["name"]: uq["column_names"] for uq in inspector.get_unique_constraints(name)}
    assert uniques[f"uq_{name}_queue_key"] == ["queue", "key"]
    checks = {ck["name"] for ck in inspector.get_check_constraints(name)}
    assert f"ck_{name}_status" in checks
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
    the mixin's ``utf8mb4_bin`` key columns reflect with an explicit collation of their own.
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


# -- the repository's own migrations -------------------------------------------------------------


def test_repo_upgrade_head_then_downgrade_base(
    fresh_database: tuple[str, URL], engine_for: Any
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    config = alembic_config(REPO / "alembic.ini", url)

    command.upgrade(config, "head")

    assert table_names(engine) == {"delayed_queue"}
    assert schema_diff(engine, metadata) == []
    command.check(config)  # the env's own autogenerate settings agree: nothing to generate
    assert_queue_table(backend, engine, "delayed_queue")
    assert_queue_works(engine, DelayedMessage)

    command.downgrade(config, "base")

    assert table_names(engine) == set()


def test_repo_migrations_run_on_the_callers_connection(
    fresh_database: tuple[str, URL], engine_for: Any
) -> None:
    _, url = fresh_database
    engine = engine_for(url)
    config = alembic_config(REPO / "alembic.ini", "unused://")

    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "head")

    assert table_names(engine) == {"delayed_queue"}
    assert schema_diff(engine, metadata) == []


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "postgresql+psycopg://u@localhost/app",
            ["payload JSONB", "TIMESTAMP WITH TIME ZONE", "BIGSERIAL"],
        ),
        (
            "mysql+pymysql://u@localhost/app",
            ["COLLATE utf8mb4_bin", "LONGBLOB", "DATETIME(6)"],
        ),
    ],
)
def test_repo_migrations_render_offline_sql(url: str, expected: list[str]) -> None:
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


# -- a host project ------------------------------------------------------------------------------


def test_host_autogenerate_creates_the_queue_table(
    fresh_database: tuple[str, URL], engine_for: Any, tmp_path: Path
) -> None:
    backend, url = fresh_database
    engine = engine_for(url)
    host_database(backend, engine)
    root = host_copy(tmp_path, keep_versions=False)
    config = alembic_config(root / "alembic.ini", url)

    command.revision(config, message="customers and outbox", autogenerate=True)

    [revision] = (root / "migrations" / "versions").glob("*.py")
    text = revision.read_text()
    for fragment in [
        "op.create_table('outbox'",
        "op.f('uq_outbox_queue_key')",
        "op.f('ck_outbox_status')",
        "op.create_index(op.f('ix_outbox_due'), 'outbox', ['queue', 'scheduled_at', 'id']",
        "op.create_index(op.f('ix_outbox_lock_token'), 'outbox', ['lock_token']",
        "postgresql.JSONB(astext_type=sa.Text())",  # render_item: Alembic alone omits sa.
        "sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6)",
    ]:
        assert fragment in text
    assert "DateTimeUTC" not in text  # the revision is plain SQLAlchemy, frozen DDL

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
    config = alembic_config(host_copy(tmp_path, keep_versions=True) / "alembic.ini", url)

    command.upgrade(config, "head")

    assert table_names(engine) == {"customers", "outbox"}
    assert schema_diff(engine, Base.metadata) == []
    assert schema_diff(engine, queue_table("outbox").metadata, only_table="outbox") == []
    assert_queue_table(backend, engine, "outbox")
    assert_queue_works(engine, OutboxMessage)

    command.downgrade(config, "base")

    assert table_names(engine) == set()


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
