"""The read-only commands: ``stats``, ``ls``, ``search`` and ``show``."""

from __future__ import annotations

import heapq
import json
import signal
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import click
from rich.live import Live
from rich.table import Table

from ._cli_base import (
    ALL_STATES,
    BadInput,
    Db,
    build_filter,
    compact_json,
    db_options,
    emit_json,
    fail,
    filter_options,
    has_conditions,
    human_seconds,
    human_time,
    iso,
    json_option,
    message_dict,
    new_table,
    out,
    queues_option,
    short,
)
from ._cli_stats import STATES, QueueStats, queue_stats
from ._cli_target import open_db
from ._types import MessageFilter, MessageInfo

# -- stats -------------------------------------------------------------------------------------


def collect_stats(
    db: Db, queues: Sequence[str], *, missing_ok: bool = False, at_most: int | None = None
) -> list[QueueStats]:
    """What ``stats`` shows; the benchmark times this function."""
    if queues and not missing_ok:
        db.resolve_queues(queues)
    with db.sessions() as s:
        return queue_stats(
            s,
            db.table,
            datetime.now(UTC),
            list(queues) or None,
            include_missing=missing_ok,
            at_most=at_most,
        )


def stats_json(
    db: Db, stats: Sequence[QueueStats], now: datetime, at_most: int | None = None
) -> dict[str, Any]:
    return {
        "table": db.table_name,
        "now": iso(now),
        "at_most": at_most,
        "queues": [q.as_dict() for q in stats],
    }


def count_text(n: int, capped: bool) -> str:
    """A count as the table shows it: ``10,000+`` when it stopped at the cap."""
    return f"{n:,}+" if capped else f"{n:,}"


def stats_table(stats: Sequence[QueueStats]) -> Table:
    counts = ("due", "scheduled", "in flight", "dead", "done")
    table = new_table("queue", *counts, "oldest due", "lag", right=(*counts, "lag"))
    for q in stats:
        shown = {state: count_text(getattr(q, state), state in q.capped) for state in STATES}
        table.add_row(
            q.queue,
            shown["due"],
            shown["scheduled"],
            shown["in_flight"],
            f"[red]{shown['dead']}[/red]" if q.dead or "dead" in q.capped else "0",
            shown["done"],
            iso(q.oldest_due) or "-",
            human_seconds(q.lag_seconds) if q.oldest_due is not None else "-",
        )
    if len(stats) > 1:
        table.add_section()
        table.add_row(
            "total",
            *(
                count_text(sum(getattr(q, a) for q in stats), any(a in q.capped for q in stats))
                for a in STATES
            ),
            "",
            human_seconds(max(q.lag_seconds for q in stats)),
        )
    return table


@click.command()
@db_options
@queues_option("Only this queue (repeatable); default: every queue in the table.")
@click.option(
    "--missing-ok", is_flag=True, help="Report a queue with no messages as zeros, not an error."
)
@click.option(
    "--watch",
    type=click.FloatRange(min=0.5),
    metavar="SECONDS",
    help="Refresh every SECONDS until interrupted (with --json: one JSON document per line).",
)
@click.option(
    "--at-most",
    type=click.IntRange(min=1),
    metavar="N",
    help="Count at most N messages per queue and state (shown as N+): a read that stays "
    "short however long the backlog. Default: exact counts.",
)
@json_option
@click.pass_context
def stats(
    ctx: click.Context,
    app: str | None,
    url: str | None,
    table: str,
    queues: tuple[str, ...],
    missing_ok: bool,
    watch: float | None,
    at_most: int | None,
    as_json: bool,
) -> None:
    """Per queue: messages due now, scheduled later, in flight, dead, done, and the lag of the
    oldest due message. Counts come from indexes, so this stays fast on big tables."""
    db = open_db(ctx, url, table, app=app, queues=queues)

    def collect() -> list[QueueStats]:
        return collect_stats(db, queues, missing_ok=missing_ok, at_most=at_most)

    if watch is None:
        now = datetime.now(UTC)
        result = collect()
        if as_json:
            emit_json(stats_json(db, result, now, at_most))
        elif not result:
            click.echo(f"no messages in table {db.table_name!r}")
        else:
            out().print(stats_table(result))
        return
    # Stop on SIGINT and SIGTERM even when started in the background, where the shell hands
    # the process SIGINT ignored and Python then never raises KeyboardInterrupt.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    try:
        if as_json:
            while True:
                now = datetime.now(UTC)
                result = collect()
                click.echo(json.dumps(stats_json(db, result, now, at_most)))
                time.sleep(watch)
        with Live(stats_table([]), console=out(), auto_refresh=False) as live:
            while True:
                live.update(stats_table(collect()))
                live.refresh()
                time.sleep(watch)
    except KeyboardInterrupt:
        return


# -- ls / search -------------------------------------------------------------------------------


def find_messages(
    db: Db, queues: Sequence[str], where: MessageFilter, limit: int, after_id: int | None
) -> list[MessageInfo]:
    """The first ``limit`` matches by id across ``queues`` (one indexed query per queue)."""
    with db.sessions() as s:
        per_queue = [db.queue(q).search(s, where, limit=limit, after_id=after_id) for q in queues]
    return list(heapq.merge(*per_queue, key=lambda m: m.id))[:limit]


def messages_table(messages: Sequence[MessageInfo], *, payload: bool) -> Table:
    now = datetime.now(UTC)
    columns = ("id", "queue", "key", "state", "scheduled", "attempts")
    extra = ("payload", "last error") if payload else ("last error",)
    table = new_table(*columns, *extra, right=("id", "attempts"))
    for m in messages:
        row = [
            str(m.id),
            m.queue,
            m.key,
            m.state.value,
            human_time(m.scheduled_at, now),
            str(m.attempts),
        ]
        if payload:
            row.append(compact_json(m.payload, 50))
        row.append(short(m.last_error, 50))
        table.add_row(*row)
    return table


def list_command(
    ctx: click.Context,
    *,
    app: str | None,
    url: str | None,
    table: str,
    queues: tuple[str, ...],
    state: str | None,
    key_prefix: str | None,
    where: tuple[str, ...],
    limit: int,
    after_id: int | None,
    as_json: bool,
    search: bool,
) -> None:
    f = build_filter(state=state, key_prefix=key_prefix, where=where)
    if search and not has_conditions(f):
        raise BadInput("search needs a filter: --state, --key-prefix or --where (or use 'ls')")
    db = open_db(ctx, url, table, app=app, queues=queues)
    names = db.resolve_queues(queues)
    messages = find_messages(db, names, f, limit + 1, after_id)
    more = len(messages) > limit
    messages = messages[:limit]
    next_after = messages[-1].id if more else None
    total = None
    if search:
        with db.sessions() as s:
            total = sum(db.queue(q).count(s, f) for q in names)
    if as_json:
        doc: dict[str, Any] = {"messages": [message_dict(m) for m in messages]}
        if total is not None:
            doc["count"] = total
        doc["next_after_id"] = next_after
        emit_json(doc)
        return
    if total is not None:
        click.echo(f"{total:,} matching message{'s' if total != 1 else ''}")
    if not messages:
        click.echo("no messages")
        return
    out().print(messages_table(messages, payload=search))
    if next_after is not None:
        click.echo(f"more: add --after-id {next_after}")


def list_options(f: Any) -> Any:
    f = click.option(
        "--after-id",
        type=click.IntRange(min=0, max=2**63 - 1),
        help="Only messages with a larger id (the last one shown).",
    )(f)
    f = click.option(
        "--limit",
        type=click.IntRange(min=1, max=2**62),
        default=50,
        show_default=True,
        help="At most N.",
    )(f)
    return f


@click.command(name="ls")
@db_options
@queues_option("Only this queue (repeatable); default: every queue.")
@filter_options(ALL_STATES)
@list_options
@json_option
@click.pass_context
def ls(ctx: click.Context, /, **kwargs: Any) -> None:
    """List messages by id, optionally filtered by state, key prefix or payload field."""
    list_command(ctx, search=False, **kwargs)


@click.command()
@db_options
@queues_option("Only this queue (repeatable); default: every queue.")
@filter_options(ALL_STATES)
@list_options
@json_option
@click.pass_context
def search(ctx: click.Context, /, **kwargs: Any) -> None:
    """Find messages by state, key prefix and payload fields, with their payloads and a count.

    Example: delayedq search -q invoices --state dead --where companyId=3345
    """
    list_command(ctx, search=True, **kwargs)


# -- show --------------------------------------------------------------------------------------


def details_table(m: MessageInfo) -> Table:
    now = datetime.now(UTC)
    table = Table(show_header=False, show_edge=False, pad_edge=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    rows: list[tuple[str, str]] = [
        ("queue", m.queue),
        ("key", m.key),
        ("id", str(m.id)),
        ("state", f"{m.state.value} (status {m.status})"),
        ("scheduled at", human_time(m.scheduled_at, now)),
        ("first scheduled", human_time(m.scheduled_at_initially, now)),
        ("created at", human_time(m.created_at, now)),
        ("attempts", str(m.attempts)),
        ("last attempt", human_time(m.last_attempt_at, now)),
        ("lock token", m.lock_token or "-"),
        ("payload type", m.payload_type),
        *([("group", m.group)] if m.group is not None else []),
        *([("priority", str(m.priority))] if m.priority else []),
        *((f"header {name}", value) for name, value in sorted(m.headers.items())),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


@click.command()
@db_options
@queues_option("The message's queue; default: look in every queue.")
@click.argument("key")
@json_option
@click.pass_context
def show(
    ctx: click.Context,
    app: str | None,
    url: str | None,
    table: str,
    queues: tuple[str, ...],
    key: str,
    as_json: bool,
) -> None:
    """Everything about the message stored under KEY: schedule, attempts, payload, last error."""
    db = open_db(ctx, url, table, app=app, queues=queues)
    names = db.resolve_queues(queues)
    with db.sessions() as s:
        found = [m for m in (db.queue(q).get(s, key) for q in names) if m is not None]
    if not found:
        where = f"queue {names[0]!r}" if len(names) == 1 else "any queue"
        fail(f"no message with key {key!r} in {where}")
    if as_json:
        emit_json({"messages": [message_dict(m) for m in found]})
        return
    console = out()
    for i, m in enumerate(found):
        if i:
            console.print()
        console.print(details_table(m))
        console.print("[bold]payload[/bold]")
        if isinstance(m.payload, (bytes, bytearray)):
            click.echo(f"{len(m.payload)} bytes: {bytes(m.payload[:64])!r}")
        else:
            click.echo(json.dumps(m.payload, indent=2, ensure_ascii=False))
        if m.last_error:
            console.print("[bold]last error[/bold]")
            click.echo(m.last_error)
