"""The commands that change messages: ``retry``, ``requeue``, ``drop`` and ``reschedule``.

Bulk changes run in chunks of ids (1,000 by default), one short transaction per chunk, with a
progress bar: a million-row requeue never holds one huge transaction or its locks, and an
interruption leaves the chunks already done committed. Every chunk re-applies the filter, so a
message that changed in between (taken by a worker, say) is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import click
from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from ._cli_base import (
    BadInput,
    Db,
    RawQueue,
    build_filter,
    datetime_option,
    db_options,
    duration_option,
    emit_json,
    filter_options,
    has_conditions,
    json_option,
    progress,
    queues_option,
)
from ._cli_target import open_db
from ._time import LONGEST, require_duration
from ._types import MessageFilter

CHUNK = 1000

#: Applies a change to the messages of one chunk; returns how many changed.
Operation = Callable[[RawQueue, Session, MessageFilter], int]


class Matched(NamedTuple):
    """What a command counted (and asked to confirm): per queue, how many messages match, and
    the highest id among them; :func:`run_chunked` changes no more than that."""

    counts: dict[str, int]
    upto: dict[str, int]


def count_matching(db: Db, queues: Sequence[str], where: MessageFilter) -> Matched:
    counts, upto = {}, {}
    with db.sessions() as s:
        for name in queues:
            counts[name], upto[name] = db.queue(name).count_up_to(s, where)
    return Matched(counts, upto)


def run_chunked(
    db: Db,
    matched: Matched,
    select_filter: MessageFilter,
    op: Operation,
    label: str,
    chunk: int | None = None,
) -> int:
    """Apply ``op`` to the messages matching ``select_filter``, ``chunk`` ids at a time: of
    each queue, no message with a higher id than was counted (offered since) and no more
    messages than were counted (though more may match by now, dead since, say)."""
    chunk = chunk or CHUNK
    t = db.table
    changed = 0
    with progress(label, sum(matched.counts.values())) as advance:
        for name, expected in matched.counts.items():
            queue = db.queue(name)
            last: int | None = None
            done = 0
            while done < expected:
                with db.sessions() as s, s.begin():
                    cond = queue.condition(select_filter, queue.now())
                    stmt = select(t.c.id).where(cond, t.c.id <= matched.upto[name])
                    if last is not None:
                        stmt = stmt.where(t.c.id > last)
                    stmt = stmt.order_by(t.c.id).limit(min(chunk, expected - done))
                    ids = list(s.scalars(stmt))
                    if not ids:
                        break
                    among = t.c.id.in_(ids)
                    within = (
                        among if select_filter.where is None else and_(select_filter.where, among)
                    )
                    done += op(queue, s, replace(select_filter, where=within))
                last = ids[-1]
                advance(len(ids))
            changed += done
    return changed


def report(
    as_json: bool, action: str, counts: dict[str, int], changed: int, *, dry_run: bool = False
) -> None:
    matched = sum(counts.values())
    if as_json:
        emit_json(
            {
                "action": action,
                "dry_run": dry_run,
                "matched": matched,
                "changed": 0 if dry_run else changed,
                "queues": counts,
            }
        )
    elif dry_run:
        click.echo(f"would {action} {matched:,} message{'s' if matched != 1 else ''}")
    else:
        click.echo(f"{action}: {changed:,} message{'s' if changed != 1 else ''}")


def when_option(f: Any) -> Any:
    f = duration_option("--in", "delay", help="Due after this delay (e.g. 10m) instead of now.")(f)
    return datetime_option("--at", help="Due at this time (ISO 8601 with a UTC offset).")(f)


def resolve_when(at: datetime | None, delay: timedelta | None) -> datetime | None:
    if at is not None and delay is not None:
        raise BadInput("give --at or --in, not both")
    if delay is not None:
        return datetime.now(UTC) + require_duration(delay, "--in", allow_zero=True, most=LONGEST)
    return at


# -- retry -------------------------------------------------------------------------------------


@click.command()
@db_options
@queues_option("The messages' queue; default: every queue.")
@click.argument("keys", nargs=-1, required=True)
@when_option
@json_option
@click.pass_context
def retry(
    ctx: click.Context,
    app: str | None,
    url: str | None,
    table: str,
    queues: tuple[str, ...],
    keys: tuple[str, ...],
    at: datetime | None,
    delay: timedelta | None,
    as_json: bool,
) -> None:
    """Retry the dead messages stored under KEYS: due now (or --at/--in), attempts reset.

    Exits 1 when a key is not a dead message.
    """
    when = resolve_when(at, delay)
    db = open_db(ctx, url, table, app=app, queues=queues)
    names = db.resolve_queues(queues)
    dead = MessageFilter(state="dead", keys=tuple(dict.fromkeys(keys)))
    t = db.table
    found: set[tuple[str, str]] = set()
    counts: dict[str, int] = {}
    with db.sessions() as s, s.begin():
        for name in names:
            queue = db.queue(name)
            # The dead ones, locked: what this command retries, and only that (a key another
            # retry made pending meanwhile is not dead here, and not listed as retried).
            ours = s.scalars(
                select(t.c.key).where(queue.condition(dead, queue.now())).with_for_update()
            ).all()
            counts[name] = (
                queue.requeue_dead(s, replace(dead, keys=tuple(ours)), at=when) if ours else 0
            )
            found.update((name, k) for k in ours)
    retried = sorted({k for _, k in found})
    missing = [k for k in dict.fromkeys(keys) if k not in retried]
    if as_json:
        emit_json({"retried": retried, "not_dead": missing, "queues": counts})
    else:
        for q, k in sorted(found):
            click.echo(f"retrying {q}/{k}")
        if missing:
            click.echo(f"not dead or not found: {', '.join(missing)}", err=True)
    if missing:
        ctx.exit(1)


# -- requeue -----------------------------------------------------------------------------------


@click.command()
@db_options
@queues_option("Only this queue (repeatable); default: every queue.")
@filter_options()
@when_option
@click.option("--dry-run", is_flag=True, help="Only count the dead messages that match.")
@json_option
@click.pass_context
def requeue(
    ctx: click.Context,
    app: str | None,
    url: str | None,
    table: str,
    queues: tuple[str, ...],
    key_prefix: str | None,
    where: tuple[str, ...],
    at: datetime | None,
    delay: timedelta | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Make dead messages pending again (all of them, or those matching the filters).

    Runs in chunks with a progress bar; the last error is kept for the record.
    """
    when = resolve_when(at, delay)
    f = replace(build_filter(key_prefix=key_prefix, where=where), state="dead")
    db = open_db(ctx, url, table, app=app, queues=queues)
    matched = count_matching(db, db.resolve_queues(queues), f)
    changed = 0
    if not dry_run:
        changed = run_chunked(
            db, matched, f, lambda q, s, w: q.requeue_dead(s, w, at=when), "requeueing"
        )
    report(as_json, "requeue", matched.counts, changed, dry_run=dry_run)


# -- drop --------------------------------------------------------------------------------------


def drop_chunk(queue: RawQueue, session: Session, where: MessageFilter) -> int:
    """Delete one chunk: by the filter, or (``--all``) every listed id of the queue."""
    return queue.drop_where(session, where)


def describe(f: MessageFilter, queues: Sequence[str]) -> str:
    parts = [f"queue{'s' if len(queues) != 1 else ''} {', '.join(queues)}"]
    if f.state:
        parts.append(f"state {f.state}")
    if f.key_prefix:
        parts.append(f"keys starting {f.key_prefix!r}")
    if f.keys:
        parts.append(f"keys {', '.join(f.keys)}")
    parts.extend(f"{k}={v!r}" for k, v in f.payload.items())
    return "; ".join(parts)


@click.command()
@db_options
@queues_option("Only this queue (repeatable); default: every queue.")
@click.argument("keys", nargs=-1)
@filter_options(("due", "scheduled", "in_flight", "pending", "dead", "done"))
@click.option("--all", "everything", is_flag=True, help="Every message of the queues given.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (for scripts).")
@click.option("--dry-run", is_flag=True, help="Only count what would be dropped.")
@json_option
@click.pass_context
def drop(
    ctx: click.Context,
    app: str | None,
    url: str | None,
    table: str,
    queues: tuple[str, ...],
    keys: tuple[str, ...],
    state: str | None,
    key_prefix: str | None,
    where: tuple[str, ...],
    everything: bool,
    yes: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Delete messages: those stored under KEYS, or matching the filters, or --all of a queue.

    Asks for confirmation with the number of messages; --yes skips the question.
    """
    f = build_filter(state=state, key_prefix=key_prefix, where=where)
    if keys:
        f = replace(f, keys=tuple(dict.fromkeys(keys)))
    if everything and has_conditions(f):
        raise BadInput("--all drops every message: give it without keys or filters")
    if not everything and not has_conditions(f):
        raise BadInput("say what to drop: KEYS, --state, --key-prefix, --where, or --all with -q")
    if everything and not queues:
        raise BadInput("--all needs the queue(s) named with -q")
    db = open_db(ctx, url, table, app=app, queues=queues)
    names = db.resolve_queues(queues)
    matched = count_matching(db, names, f)
    counts = matched.counts
    total = sum(counts.values())
    if dry_run or not total:
        report(as_json, "drop", counts, 0, dry_run=True)
        return
    if not yes:
        click.confirm(
            f"Drop {total:,} message{'s' if total != 1 else ''} ({describe(f, names)})?",
            abort=True,
            err=True,
        )
    changed = run_chunked(db, matched, f, drop_chunk, "dropping")
    report(as_json, "drop", counts, changed)


# -- reschedule --------------------------------------------------------------------------------


@click.command()
@db_options
@queues_option("Only this queue (repeatable); default: every queue.")
@click.argument("keys", nargs=-1)
@filter_options(("due", "scheduled", "pending"))
@click.option("--all", "everything", is_flag=True, help="Every pending message of the queues.")
@when_option
@click.option(
    "--priority",
    type=click.IntRange(0, 32767),
    help="Also give them this priority (0 lowest; taken first by a queue with priorities).",
)
@json_option
@click.pass_context
def reschedule(
    ctx: click.Context,
    app: str | None,
    url: str | None,
    table: str,
    queues: tuple[str, ...],
    keys: tuple[str, ...],
    state: str | None,
    key_prefix: str | None,
    where: tuple[str, ...],
    everything: bool,
    at: datetime | None,
    delay: timedelta | None,
    priority: int | None,
    as_json: bool,
) -> None:
    """Move pending messages to now ("process now") or to --at/--in, and with --priority
    raise (or lower) their priority.

    Select them by KEYS or filters, or --all; messages in flight keep their lease.
    """
    when = resolve_when(at, delay)
    f = build_filter(state=state, key_prefix=key_prefix, where=where)
    if keys:
        f = replace(f, keys=tuple(dict.fromkeys(keys)))
    if everything and has_conditions(f):
        raise BadInput("--all moves every pending message: give it without keys or filters")
    if not everything and not has_conditions(f):
        raise BadInput("say what to reschedule: KEYS, --state, --key-prefix, --where, or --all")
    # Only messages the library will move: pending and not in flight.
    if f.state is None:
        f = replace(f, state="pending")
    db = open_db(ctx, url, table, app=app, queues=queues)
    names = db.resolve_queues(queues)
    matched = count_matching(db, names, f)
    changed = run_chunked(
        db,
        matched,
        f,
        lambda q, s, w: q.reschedule(s, w, at=when, priority=priority),
        "rescheduling",
    )
    report(as_json, "reschedule", matched.counts, changed)
