"""``delayedq cron ls``, ``delayedq db upgrade|current`` and ``delayedq doctor``.

The ``db`` commands run the migrations that ship inside the package
(:mod:`sqla_delayedq.migrations`), so they work from a pip install; the revision is recorded in
their own version table, never in an application's ``alembic_version``.
"""

from __future__ import annotations

import argparse
import io
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import click
import sqlalchemy as sa

from ._cli_base import (
    RuntimeFailure,
    compact_json,
    create_db_engine,
    db_options,
    duration_option,
    emit_json,
    human_seconds,
    human_time,
    iso,
    json_option,
    new_table,
    out,
    queues_option,
    require_url,
    short,
    sqlite_file_missing,
    url_option,
)
from ._cli_target import open_db

# -- cron --------------------------------------------------------------------------------------


@click.group()
def cron() -> None:
    """Cron configurations installed in the queues."""


@cron.command(name="ls")
@db_options
@queues_option("Only this queue (repeatable); default: every queue.")
@click.option("--prefix", help="Only this cron prefix.")
@json_option
@click.pass_context
def cron_ls(
    ctx: click.Context,
    app: str | None,
    url: str | None,
    table: str,
    queues: tuple[str, ...],
    prefix: str | None,
    as_json: bool,
) -> None:
    """Cron configurations by prefix and config hash, with their next tick and tick counts."""
    from .cron import list_cron

    db = open_db(ctx, url, table, app=app, queues=queues)
    names = db.resolve_queues(queues)
    with db.sessions() as s:
        infos = [(q, info) for q in names for info in list_cron(s, db.queue(q), prefix)]
    if as_json:
        emit_json({"cron": [cron_dict(q, info) for q, info in infos]})
        return
    if not infos:
        click.echo("no cron configurations")
        return
    now = datetime.now(UTC)
    t = new_table(
        "queue",
        "prefix",
        "hash",
        "current",
        "schedule",
        "next tick",
        "pending",
        "dead",
        right=("pending", "dead"),
    )
    for q, info in infos:
        t.add_row(
            q,
            info.prefix,
            info.config_hash,
            "yes" if info.current else "no",
            compact_json(info.schedule, 40) if info.schedule else "-",
            human_time(info.next_tick, now),
            f"{info.counts.pending:,}",
            f"{info.counts.dead:,}",
        )
    out().print(t)


def cron_dict(queue: str, info: Any) -> dict[str, Any]:
    c = info.counts
    return {
        "queue": queue,
        "prefix": info.prefix,
        "config_hash": info.config_hash,
        "current": info.current,
        "schedule": info.schedule,
        "catch_up": info.catch_up,
        "installed_at": iso(info.installed_at),
        "installed_until": iso(info.installed_until),
        "next_tick": iso(info.next_tick),
        "last_tick": iso(info.last_tick),
        "counts": {
            "due": c.due,
            "scheduled": c.scheduled,
            "in_flight": c.in_flight,
            "dead": c.dead,
            "done": c.done,
        },
    }


# -- db ----------------------------------------------------------------------------------------


@click.group()
def db() -> None:
    """Create or upgrade the default message table with the package's Alembic migrations."""


def alembic_config(url: str, stdout: Any) -> Any:
    """An Alembic Config built in code: the packaged migrations and ``-x url=...`` for env.py."""
    from alembic.config import Config

    from .migrations import SCRIPT_DIR

    config = Config(stdout=stdout, cmd_opts=argparse.Namespace(x=[f"url={url}"]))
    config.set_main_option("script_location", str(SCRIPT_DIR).replace("%", "%%"))
    config.attributes["configure_logger"] = False
    return config


def revisions(url: str, config: Any) -> tuple[list[str], list[str]]:
    """(the database's current revisions, the scripts' heads).

    A message table with no recorded revision belongs to another Alembic history (a host project
    that runs these revisions in its own) or to ``create_all``: upgrading here would create it
    twice, so say so instead.
    """
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from .migrations import BRANCH, VERSION_TABLE
    from .models import DelayedMessage

    heads = sorted(ScriptDirectory.from_config(config).get_heads())
    table = DelayedMessage.__tablename__
    engine = create_db_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            current = sorted(context.get_current_heads())
            unrecorded = not current and sa.inspect(conn).has_table(table)
    finally:
        engine.dispose()
    if unrecorded:
        raise RuntimeFailure(
            f"table '{table}' exists but {VERSION_TABLE} records no revision: it was created "
            f"by another Alembic history (upgrade it there: alembic upgrade {BRANCH}@head) "
            "or by create_all"
        )
    return current, heads


@db.command()
@url_option
@click.argument("revision", default="head")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it (offline mode).")
@json_option
def upgrade(url: str | None, revision: str, sql: bool, as_json: bool) -> None:
    """Upgrade the database to REVISION (default: head), creating the message table."""
    from alembic.command import upgrade as alembic_upgrade
    from alembic.util import CommandError

    url = require_url(url)
    if sql:
        alembic_upgrade(alembic_config(url, sys.stdout), revision, sql=True)
        return
    config = alembic_config(url, io.StringIO())
    before, _ = revisions(url, config)
    try:
        alembic_upgrade(config, revision)
    except CommandError as exc:
        raise RuntimeFailure(f"alembic: {exc}") from exc
    after, heads = revisions(url, config)
    if as_json:
        emit_json({"from": before, "to": after, "heads": heads, "up_to_date": after == heads})
    elif before == after:
        click.echo(f"already at {', '.join(after) or 'base'}")
    else:
        click.echo(f"upgraded {', '.join(before) or 'base'} -> {', '.join(after)}")


@db.command()
@url_option
@json_option
def current(url: str | None, as_json: bool) -> None:
    """The database's migration revision, and whether it is at head."""
    from alembic.command import current as alembic_current
    from alembic.script import ScriptDirectory

    url = require_url(url)
    buffer = io.StringIO()
    config = alembic_config(url, buffer)
    cur: list[str]
    if sqlite_file_missing(url):  # not initialised: said without creating the file
        cur, heads = [], sorted(ScriptDirectory.from_config(config).get_heads())
    else:
        cur, heads = revisions(url, config)
    if as_json:
        emit_json({"current": cur, "heads": heads, "up_to_date": cur == heads})
        return
    if cur:
        alembic_current(config)
    lines = [line for line in buffer.getvalue().splitlines() if line.strip()]
    if not lines:
        click.echo("no revision: the database is not initialised; run 'delayedq db upgrade'")
    else:
        for line in lines:
            click.echo(line)
        if cur != heads:
            click.echo(f"not at head ({', '.join(heads)}): run 'delayedq db upgrade'")


# -- doctor ------------------------------------------------------------------------------------


@click.command()
@db_options
@duration_option(
    "--threshold",
    default="60s",
    show_default=True,
    help="Report transactions open at least this long.",
)
@json_option
@click.pass_context
def doctor(
    ctx: click.Context,
    app: str | None,
    url: str | None,
    table: str,
    threshold: timedelta,
    as_json: bool,
) -> None:
    """What keeps the database from cleaning up after the queue, and what to do about it.

    Names the sessions, replication slots and prepared transactions that pin the vacuum
    horizon (PostgreSQL) or the oldest InnoDB transactions and the history list (MariaDB/MySQL),
    the message table's dead rows and sizes, and how far this host's clock is from the
    server's; see docs/operations.md. Exits 0 either way.
    """
    from .doctor import as_dict, diagnose

    db = open_db(ctx, url, table, app=app, check_table=False)
    t = db.table
    name = t.name if t.schema is None else f"{t.schema}.{t.name}"
    with db.engine.connect() as conn:
        found = diagnose(conn, [name], threshold=threshold.total_seconds())
    if as_json:
        emit_json(as_dict(found))
        return
    console = out()
    if found.holders:
        holders = new_table("holding the horizon", "open for", "xmin age", "who", "state", "query")
        for h in found.holders:
            who = " ".join(v for v in (h.user, h.application, h.client) if v)
            holders.add_row(
                f"{h.kind} {h.name}",
                "-" if h.age_seconds is None else human_seconds(h.age_seconds),
                "-" if h.xmin_age is None else f"{h.xmin_age:,}",
                who or "-",
                h.state or "-",
                short(h.query, 50),
            )
        console.print(holders)
    for th in found.tables:
        console.print(
            f"{th.table}: {th.live_rows:,} live rows, {th.dead_rows:,} dead "
            f"({th.dead_ratio:.0%}); heap {th.table_bytes / 2**20:,.1f} MiB, indexes "
            f"{th.index_bytes / 2**20:,.1f} MiB; last autovacuum "
            f"{iso(th.last_autovacuum) or 'never'}" + ("; vacuuming now" if th.vacuuming else "")
        )
    if found.history_length is not None:
        console.print(f"InnoDB history list length: {found.history_length:,}")
    if found.clock_skew_seconds is not None:
        console.print(
            f"clock skew: this host is {found.clock_skew_seconds:+.3f} s off the database server"
        )
    if found.healthy:
        console.print(f"{found.backend}: nothing holds the horizon; no bloat to report.")
    for line in found.advice:
        console.print(f"- {line}", markup=False)
