"""What every ``delayedq`` command shares: errors, options, the database, and output.

- Errors: the command group turns library and SQLAlchemy errors into one line on stderr and an
  exit code (2 for bad input, 1 for everything else); tracebacks are for bugs only
  (``DELAYEDQ_DEBUG=1`` shows them for handled errors too).
- Options: ``--url`` (or ``$DELAYEDQ_DATABASE_URL``), ``--table``, ``--queue/-q``, filters
  (``--state``, ``--key-prefix``, ``--where FIELD=VALUE``) and ``--json``.
- Output: tables through rich on stdout, progress bars on stderr (only on a terminal), JSON with
  stable keys and ISO 8601 UTC datetimes.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

import click
import sqlalchemy as sa
from click.core import ParameterSource
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from ._codec import RawCodec, check_name
from ._filters import parse_field_filters
from ._queue import DelayedQueue
from ._types import MessageFilter, MessageInfo, State
from .errors import DelayedQueueError, InvalidArgument
from .models import NAMING_CONVENTION, QUEUE_MAX, DelayedMessage, QueueMessageMixin

F = TypeVar("F", bound=Callable[..., Any])

URL_ENV_VAR = "DELAYEDQ_DATABASE_URL"
TABLE_ENV_VAR = "DELAYEDQ_TABLE"
APP_ENV_VAR = "DELAYEDQ_APP"
DEBUG_ENV_VAR = "DELAYEDQ_DEBUG"
INSTALL_HINT = "pip install 'sqla_delayedq[cli]'"

# -- errors ------------------------------------------------------------------------------------


class RuntimeFailure(click.ClickException):
    """A failure that is not the user's input: exit code 1."""

    exit_code = 1


class BadInput(click.UsageError):
    """Input the command cannot use: exit code 2."""


def first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def translate(exc: BaseException) -> click.ClickException | None:
    """The one-line error for an exception a command let through; None for bugs."""
    if isinstance(exc, InvalidArgument):
        return BadInput(str(exc))
    if isinstance(exc, DelayedQueueError):
        return RuntimeFailure(first_line(str(exc)))
    if isinstance(exc, sa_exc.ArgumentError):
        return BadInput(f"bad database URL: {first_line(str(exc))}")
    if isinstance(exc, sa_exc.DBAPIError):
        cause = first_line(str(exc.orig)) if exc.orig is not None else first_line(str(exc))
        if isinstance(exc, sa_exc.OperationalError):
            return RuntimeFailure(f"database error: {cause}")
        return RuntimeFailure(f"database error ({type(exc.orig).__name__}): {cause}")
    if isinstance(exc, sa_exc.SQLAlchemyError):
        return RuntimeFailure(f"database error: {first_line(str(exc))}")
    return None


#: ``Context.meta``: the command line's arguments as given (without the program's name).
ARGV = "delayedq.argv"


class DelayedqGroup(click.Group):
    """A click group whose errors are one line on stderr, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            err = translate(exc)
            if err is None or os.environ.get(DEBUG_ENV_VAR):
                raise
            raise err from exc

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        # The arguments as given, for what re-runs the command (``worker --processes``).
        argv = list(args)
        ctx = super().make_context(info_name, args, parent, **extra)
        ctx.meta.setdefault(ARGV, argv)
        return ctx

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            click.echo(f"Error: {first_line(e.format_message())}{hint}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"Error: {first_line(e.format_message())}", err=True)
            sys.exit(e.exit_code)
        except (click.Abort, EOFError, KeyboardInterrupt):
            click.echo("Aborted.", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


# -- parameter types ---------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> timedelta:
    """``300``, ``2.5``, ``90s``, ``5m``, ``1h30m``, ``2d`` -> timedelta; ValueError otherwise."""
    text = text.strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        pos, seconds = 0, 0.0
        for m in _DURATION.finditer(text):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if pos != len(text) or not text:
            raise ValueError(f"{text!r} is not a duration (e.g. 300, 90s, 5m, 1h30m)") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{text!r} is not a duration (e.g. 300, 90s, 5m, 1h30m)")
    if seconds >= timedelta.max.total_seconds():
        raise ValueError(f"{text!r} is longer than any duration (999999999 days)")
    return timedelta(seconds=seconds)


def duration_option(*names: str, **kwargs: Any) -> Callable[[F], F]:
    """An option taking a duration (``300``, ``90s``, ``5m``, ``1h30m``) as a timedelta."""

    def convert(ctx: click.Context, param: click.Parameter, value: Any) -> timedelta | None:
        if value is None or isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None

    return click.option(*names, metavar="DURATION", callback=convert, **kwargs)


def datetime_option(*names: str, **kwargs: Any) -> Callable[[F], F]:
    """An option taking an ISO 8601 datetime with a UTC offset (or ``now``), in UTC."""

    def convert(ctx: click.Context, param: click.Parameter, value: Any) -> datetime | None:
        if value is None or isinstance(value, datetime):
            return value
        text = str(value).strip()
        if text.lower() == "now":
            return datetime.now(UTC)
        try:
            parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise click.BadParameter(
                f"{text!r} is not an ISO 8601 datetime (e.g. 2030-01-01T12:00:00Z)", ctx, param
            ) from None
        if parsed.tzinfo is None:
            raise click.BadParameter(
                f"{text!r} has no UTC offset; add one, e.g. {text}Z", ctx, param
            )
        try:
            return parsed.astimezone(UTC)
        except OverflowError:
            raise click.BadParameter(
                f"{text!r} is outside the datetimes UTC can hold (years 1 to 9999)", ctx, param
            ) from None

    return click.option(*names, metavar="DATETIME", callback=convert, **kwargs)


def parse_where(items: Sequence[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` pairs; values are JSON when they parse (``3345`` is an int), else strings."""
    try:
        return parse_field_filters(items)
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc), param_hint="'--where'") from None


# -- options -----------------------------------------------------------------------------------


def _check_queue_name(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    names = value if isinstance(value, tuple) else (value,)
    for name in names:
        if name is not None:
            try:
                check_name(name, "queue name", QUEUE_MAX)
            except InvalidArgument as exc:
                raise click.BadParameter(str(exc), ctx, param) from None
    return value


def url_option(f: F) -> F:
    return click.option(
        "--url",
        envvar=URL_ENV_VAR,
        metavar="URL",
        help=f"SQLAlchemy database URL (or ${URL_ENV_VAR}).",
    )(f)


def table_option(f: F) -> F:
    return click.option(
        "--table",
        envvar=TABLE_ENV_VAR,
        default=DelayedMessage.__tablename__,
        show_default=True,
        help=f"The message table (or ${TABLE_ENV_VAR}).",
    )(f)


def db_options(f: F) -> F:
    """``--app``, ``--url`` and ``--table``."""
    f = click.option(
        "--app",
        envvar=APP_ENV_VAR,
        metavar="MODULE:ATTR",
        help="Your Worker or AsyncWorker (or a function returning one): the database and the "
        f"table come from it and its queues (or ${APP_ENV_VAR}).",
    )(f)
    return url_option(table_option(f))


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON on stdout.")(
        f
    )


def queues_option(help_text: str, *, required: bool = False) -> Callable[[F], F]:
    return click.option(
        "--queue",
        "-q",
        "queues",
        multiple=True,
        required=required,
        callback=_check_queue_name,
        help=help_text,
    )


def filter_options(states: Sequence[str] | None = None) -> Callable[[F], F]:
    """``--key-prefix`` and ``--where``, plus ``--state`` limited to ``states`` (if given)."""

    def decorate(f: F) -> F:
        f = click.option(
            "--where",
            "where",
            multiple=True,
            metavar="FIELD=VALUE",
            help="Top-level JSON payload field equal to VALUE (JSON if it parses: "
            "companyId=3345 is a number). Repeatable.",
        )(f)
        f = click.option("--key-prefix", help="Keys starting with this text.")(f)
        if states is not None:
            f = click.option(
                "--state", type=click.Choice(list(states)), help="Messages in this state."
            )(f)
        return f

    return decorate


def build_filter(
    *, state: str | None = None, key_prefix: str | None = None, where: Sequence[str] = ()
) -> MessageFilter:
    return MessageFilter(state=state, key_prefix=key_prefix or None, payload=parse_where(where))


def has_conditions(f: MessageFilter) -> bool:
    return bool(f.state or f.key_prefix or f.payload or f.keys)


ALL_STATES = tuple(s.value for s in State)

# -- the database ------------------------------------------------------------------------------


class RawQueue(DelayedQueue[Any]):
    """A queue for inspection: shows stored payloads whatever their serializer or type name."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.codec = RawCodec(self.serializer)


@functools.cache
def model_for(table: str) -> type[QueueMessageMixin]:
    """The default mapped class, or one mapped on ``table`` for a table of the user's own:
    ``schema.name`` names a table in a schema (on MariaDB/MySQL, in another database of the
    server), as the application's model does with ``schema=``."""
    if table == DelayedMessage.__tablename__:
        return DelayedMessage
    schema, dot, name = table.rpartition(".")
    if not name or (dot and not schema):
        raise BadInput(f"--table: {table!r} is not a table name, nor schema.name")

    class Base(DeclarativeBase):
        metadata = sa.MetaData(schema=schema or None, naming_convention=NAMING_CONVENTION)

    model = type("CliMessage", (QueueMessageMixin, Base), {"__tablename__": name})
    return cast("type[QueueMessageMixin]", model)


@dataclass
class Db:
    """An engine, a sessionmaker and the message table, for one command run."""

    url: str
    table_name: str
    engine: Engine
    sessions: sessionmaker[Session]
    model: type[QueueMessageMixin]
    _queues: dict[str, RawQueue] = field(default_factory=dict)

    @property
    def table(self) -> sa.Table:
        t: sa.Table = self.model.__table__  # type: ignore[attr-defined]
        return t

    def queue(self, name: str) -> RawQueue:
        if name not in self._queues:
            self._queues[name] = RawQueue(name, model=self.model, notify=False)
        return self._queues[name]

    def known_queues(self) -> list[str]:
        from ._cli_stats import list_queues

        with self.sessions() as s:
            return list_queues(s, self.table)

    def resolve_queues(self, given: Sequence[str]) -> list[str]:
        """The queues a command works on: those given (each must exist), else all of them."""
        known = self.known_queues()
        if not given:
            return known
        missing = [q for q in given if q not in known]
        if missing:
            listing = ", ".join(known) if known else "none: the table is empty"
            raise RuntimeFailure(
                f"unknown queue {missing[0]!r}: no messages in table {self.table_name!r} "
                f"(queues: {listing})"
            )
        return list(dict.fromkeys(given))


def require_url(url: str | None) -> str:
    if not url:
        raise BadInput(f"no database URL: pass --url or set ${URL_ENV_VAR}")
    return url


def sqlite_file_missing(url: str) -> str | None:
    """The path of a SQLite file URL whose file does not exist (connecting would create an
    empty database there); None for anything else."""
    from ._engine import Family, url_family

    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        return None  # create_engine says what is wrong with it
    path = parsed.database
    if url_family(parsed) is not Family.SQLITE or not path or path == ":memory:":
        return None
    if path.startswith("file:") or parsed.query.get("uri"):
        return None  # a URI filename: SQLite's own options decide
    return None if Path(path).exists() else path


def require_sqlite_file(url: str) -> None:
    """A command that reads or changes a table refuses a SQLite file that does not exist,
    rather than create an empty database there (a mistyped path)."""
    path = sqlite_file_missing(url)
    if path is not None:
        raise BadInput(
            f"no SQLite database at {path!r}: check the path in the URL (a new database is "
            "made by 'delayedq db upgrade' or by your own migrations)"
        )


def create_db_engine(url: str | sa.URL, **kwargs: Any) -> Engine:
    """:func:`sqla_delayedq.create_engine`, with a missing driver reported as a one-liner."""
    from ._engine import create_engine

    try:
        return create_engine(url, **kwargs)
    except ImportError as exc:
        raise RuntimeFailure(
            f"the database driver is not installed ({exc}); install it, e.g. "
            "pip install 'sqla_delayedq[postgresql]' and use postgresql+psycopg://..."
        ) from exc


def given(ctx: click.Context, name: str) -> bool:
    """Whether the user set parameter ``name`` (on the command line or in the environment)."""
    source = ctx.get_parameter_source(name)
    return source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


#: Every column of a message table (QueueMessageMixin).
MESSAGE_COLUMNS = tuple(c.name for c in DelayedMessage.__table__.columns)
#: The column that marks a table made with EntityQueueMixin.
ENTITY_COLUMN = "queue_next_attempt_at"


def check_message_table(db: Db, *, from_app: bool = False) -> None:
    """The table exists and is a message table; else one line of advice that fits."""
    with db.engine.connect() as conn:
        problem = table_problem(conn, db.table, from_app=from_app)
    if problem is not None:
        raise RuntimeFailure(problem)


def table_problem(
    conn: sa.Connection, t: sa.Table, *, from_app: bool = False, entity: bool = False
) -> str | None:
    """Why ``t`` cannot serve as a message table on ``conn`` (None when it can); with
    ``entity``, as the table of an ``EntityQueue`` (it has the ``EntityQueueMixin`` columns).

    A missing table gets the advice that fits whose table it is: ours (``delayed_queue``, made by
    ``delayedq db upgrade``) or the application's (its own migrations). A table made with
    ``EntityQueueMixin``, or any table without the message columns, is named as such.
    """
    inspector = sa.inspect(conn)
    where = conn.engine.url.render_as_string(hide_password=True)
    if not inspector.has_table(t.name, schema=t.schema):
        if t.fullname == DelayedMessage.__tablename__:
            advice = "create it with 'delayedq db upgrade'"
        else:
            advice = (
                "it is your application's table: create it with your own migrations "
                "(e.g. alembic upgrade head)"
            )
        return f"table {t.fullname!r} does not exist in {where}; {advice}"
    columns = {c["name"] for c in inspector.get_columns(t.name, t.schema)}
    if entity:
        if ENTITY_COLUMN in columns:
            return None
        return (
            f"table {t.fullname!r} in {where} is not an entity-queue table: it lacks the "
            f"EntityQueueMixin column {ENTITY_COLUMN}; migrate it to your model "
            "(e.g. alembic upgrade head)"
        )
    missing = [c for c in MESSAGE_COLUMNS if c not in columns]
    if not missing:
        return None
    if ENTITY_COLUMN in columns:
        return (
            f"table {t.fullname!r} is an entity-queue table (it has {ENTITY_COLUMN}, from "
            "EntityQueueMixin), not a message table: the delayedq commands read tables made "
            "with QueueMessageMixin; count entity queues with EntityQueue.counts() in your code"
        )
    advice = "; migrate it to your model (e.g. alembic upgrade head)" if from_app else ""
    return (
        f"table {t.fullname!r} in {where} is not a message table: it lacks the "
        f"QueueMessageMixin column{'s' if len(missing) > 1 else ''} {', '.join(missing)}{advice}"
    )


# -- output ------------------------------------------------------------------------------------


def out() -> Console:
    """A console on the current stdout (tests swap it), wide enough not to wrap tables."""
    width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160"))
    return Console(file=sys.stdout, highlight=False, width=width)


def new_table(*columns: str, right: Sequence[str] = ()) -> Table:
    """A plain table with a header line; ``right`` names the right-aligned (numeric) columns."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left")
    return table


def err() -> Console:
    return Console(file=sys.stderr, highlight=False)


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat()


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def message_dict(m: MessageInfo) -> dict[str, Any]:
    """A message as ``--json`` shows it: stable keys, ISO datetimes, bytes in base64."""
    payload, encoding = m.payload, "json"
    if isinstance(payload, (bytes, bytearray, memoryview)):
        payload, encoding = base64.b64encode(bytes(payload)).decode("ascii"), "base64"
    return {
        "id": m.id,
        "queue": m.queue,
        "key": m.key,
        "state": m.state.value,
        "status": m.status,
        "payload_type": m.payload_type,
        "payload_encoding": encoding,
        "payload": payload,
        "scheduled_at": iso(m.scheduled_at),
        "scheduled_at_initially": iso(m.scheduled_at_initially),
        "created_at": iso(m.created_at),
        "attempts": m.attempts,
        "last_attempt_at": iso(m.last_attempt_at),
        "last_error": m.last_error,
        "lock_token": m.lock_token,
        "headers": dict(m.headers),
        "group": m.group,
        "priority": m.priority,
    }


def human_seconds(seconds: float) -> str:
    seconds = abs(seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{int(seconds // size)}{unit}")
            seconds %= size
        if len(parts) == 2:
            break
    return " ".join(parts)


def human_time(value: datetime | None, now: datetime) -> str:
    if value is None:
        return "-"
    delta = (value - now).total_seconds()
    when = value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    rel = f"in {human_seconds(delta)}" if delta > 0 else f"{human_seconds(delta)} ago"
    return f"{when} ({rel})"


def short(text: str | None, width: int = 60) -> str:
    if not text:
        return ""
    line = first_line(text)
    return line if len(line) <= width else line[: width - 1] + "…"


def compact_json(value: Any, width: int = 60) -> str:
    return short(json.dumps(value, ensure_ascii=False, default=_json_default), width)


@contextmanager
def progress(label: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr, shown only when stderr is a terminal; yields ``advance(n)``."""
    console = err()
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def fail(message: str) -> NoReturn:
    raise RuntimeFailure(message)
