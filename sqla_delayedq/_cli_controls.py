"""The commands that steer queues: ``pause``, ``resume``, ``limit`` and ``controls``.

Each changes (or shows) rows of ``delayedq_queue_controls`` (see :mod:`sqla_delayedq.controls`);
every worker process obeys within its poll interval, at once on PostgreSQL.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import click
from sqlalchemy import select

from ._cli_base import BadInput, db_options, emit_json, json_option, parse_duration, queues_option
from ._cli_target import open_db
from .controls import UNSET, QueueControls
from .errors import InvalidArgument
from .models import controls_table, table_key


def parse_rate(text: str) -> tuple[int, timedelta]:
    """``50/s``, ``50/1s``, ``1000/5m`` -> (count, period)."""
    count, sep, period = text.partition("/")
    if not sep or not count.strip().isdigit():
        raise ValueError(f"a rate is COUNT/PERIOD, like 50/s or 1000/5m; got {text!r}")
    period = period.strip()
    return int(count), parse_duration(period if period[:1].isdigit() else f"1{period}")


def describe(c: QueueControls) -> dict[str, Any]:
    return {
        "paused": c.paused,
        "max_in_flight": c.max_in_flight,
        "rate": None
        if c.rate_limit is None or c.rate_period is None
        else {"count": c.rate_limit, "period_seconds": c.rate_period.total_seconds()},
    }


def line(queue: str, c: QueueControls) -> str:
    parts = ["paused" if c.paused else "running"]
    if c.max_in_flight is not None:
        parts.append(f"at most {c.max_in_flight} in flight")
    if c.rate_limit is not None and c.rate_period is not None:
        parts.append(f"at most {c.rate_limit} per {c.rate_period.total_seconds():g} s")
    return f"{queue}: {', '.join(parts)}"


def change(
    ctx: click.Context, app: str | None, url: str | None, table: str, queues: Any, **kw: Any
) -> None:
    db = open_db(ctx, url, table, app=app, queues=queues)
    results: dict[str, QueueControls] = {}
    try:
        with db.sessions() as s, s.begin():
            for name in queues:
                queue = db.queue(name)
                paused = kw.get("paused")
                if paused is True:
                    queue.pause(s)
                elif paused is False:
                    queue.resume(s)
                if "max_in_flight" in kw or "rate" in kw:
                    queue.set_limits(
                        s,
                        max_in_flight=kw.get("max_in_flight", UNSET),
                        rate=kw.get("rate", UNSET),
                    )
                results[name] = queue.controls(s)
    except InvalidArgument as exc:
        raise BadInput(str(exc)) from None
    if kw.get("as_json"):
        emit_json({q: describe(c) for q, c in results.items()})
    else:
        for q, c in results.items():
            click.echo(line(q, c))


@click.command()
@db_options
@queues_option("The queue to pause (repeatable).", required=True)
@json_option
@click.pass_context
def pause(
    ctx: click.Context, app: str | None, url: str | None, table: str, queues: Any, as_json: bool
) -> None:
    """Pause queues for every worker: offers are kept, nothing is taken until ``resume``."""
    change(ctx, app, url, table, queues, paused=True, as_json=as_json)


@click.command()
@db_options
@queues_option("The queue to resume (repeatable).", required=True)
@json_option
@click.pass_context
def resume(
    ctx: click.Context, app: str | None, url: str | None, table: str, queues: Any, as_json: bool
) -> None:
    """Resume paused queues; idle workers wake at once on PostgreSQL."""
    change(ctx, app, url, table, queues, paused=False, as_json=as_json)


@click.command()
@db_options
@queues_option("The queue to limit (repeatable).", required=True)
@click.option("--max-in-flight", type=int, help="At most N messages in flight across every worker.")
@click.option("--no-max-in-flight", is_flag=True, help="Remove the in-flight limit.")
@click.option("--rate", help="At most COUNT takes per PERIOD across every worker: 50/s, 1000/5m.")
@click.option("--no-rate", is_flag=True, help="Remove the rate limit.")
@json_option
@click.pass_context
def limit(
    ctx: click.Context,
    app: str | None,
    url: str | None,
    table: str,
    queues: Any,
    max_in_flight: int | None,
    no_max_in_flight: bool,
    rate: str | None,
    no_rate: bool,
    as_json: bool,
) -> None:
    """Set or remove a queue's global limits, which every worker obeys."""
    kw: dict[str, Any] = {}
    if max_in_flight is not None and no_max_in_flight:
        raise BadInput("give --max-in-flight or --no-max-in-flight, not both")
    if rate is not None and no_rate:
        raise BadInput("give --rate or --no-rate, not both")
    if max_in_flight is not None or no_max_in_flight:
        kw["max_in_flight"] = max_in_flight
    if rate is not None:
        try:
            kw["rate"] = parse_rate(rate)
        except ValueError as exc:
            raise BadInput(f"--rate: {exc}") from None
    elif no_rate:
        kw["rate"] = None
    if not kw:
        raise BadInput(
            "give at least one of --max-in-flight, --no-max-in-flight, --rate, --no-rate"
        )
    change(ctx, app, url, table, queues, as_json=as_json, **kw)


@click.command()
@db_options
@json_option
@click.pass_context
def controls(
    ctx: click.Context, app: str | None, url: str | None, table: str, as_json: bool
) -> None:
    """List the queues of the table that are paused or limited."""
    db = open_db(ctx, url, table, app=app)
    t = controls_table
    stmt = select(t.c.queue).where(t.c.table_name == table_key(db.table)).order_by(t.c.queue)
    with db.sessions() as s:
        found = {q: db.queue(q).controls(s) for q in s.scalars(stmt)}
    found = {q: c for q, c in found.items() if not c.plain}
    if as_json:
        emit_json({q: describe(c) for q, c in found.items()})
    elif not found:
        click.echo("every queue is plain: none paused or limited")
    else:
        for q, c in found.items():
            click.echo(line(q, c))
