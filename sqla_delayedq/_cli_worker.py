"""``delayedq worker TARGET``: run the user's worker, or a handler function, until SIGTERM.

TARGET is ``module:attr``:

- a :class:`~sqla_delayedq.worker.Worker` or :class:`~sqla_delayedq.aio.AsyncWorker` built in
  the user's code (or a function without arguments returning one): run as it is, with its own
  queues, models, serializers, leases, retry policies, handlers and sessionmaker. Flags that
  would contradict those objects are refused, never silently dropped or applied;
- the quick form, a plain handler function with ``-q NAME``: the queues are built from the
  flags (default table, JSON payloads unless ``--serializer``, exponential backoff).

On SIGTERM or SIGINT the worker takes nothing new, lets in-flight handlers finish (up to its
drain timeout), releases what could not finish, and exits 0; it exits 1 when it had to release
messages of handlers that did not finish in time, and 1 with one line when the worker stopped on
an error it must not retry (the traceback is in the log).

The worker is recorded in the dashboard's workers registry and per-minute counters
(:mod:`sqla_delayedq.monitor`) unless ``--no-monitor``; ``--heartbeat`` sets how often it writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Collection, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import click
from click.core import ParameterSource
from sqlalchemy import Engine, Table
from sqlalchemy.orm import sessionmaker

from ._cli_base import (
    ARGV,
    URL_ENV_VAR,
    BadInput,
    RuntimeFailure,
    duration_option,
    queues_option,
    table_option,
    table_problem,
    url_option,
)
from ._cli_target import (
    AppDatabase,
    article,
    as_worker,
    import_object,
    is_factory,
    is_worker,
    open_db,
)
from ._handlers import is_async_callable
from ._queue import DelayedQueue
from .entity import EntityQueue
from .models import table_key
from .retry import ExponentialBackoff
from .serializers import BytesSerializer, JsonSerializer, Serializer

if TYPE_CHECKING:
    from .worker import Mode

log = logging.getLogger("sqla_delayedq.cli")

#: The flags that configure a worker the quick form builds, and where a worker of one's own
#: sets the same thing instead.
WORKER_SETTINGS = {
    "url": "its sessionmaker's engine",
    "table": "its queues' model",
    "queues": "the queues registered on it",
    "concurrency": "Worker(concurrency=...)",
    "mode": "register(..., mode=...)",
    "lease": "DelayedQueue(lease=...) or register(..., lease=...)",
    "poll_interval": "Worker(poll_interval=...)",
    "batch_size": "Worker(batch_size=...) or register_batch",
    "max_attempts": "DelayedQueue(retry=ExponentialBackoff(max_attempts=...))",
    "handler_timeout": "register(..., handler_timeout=...)",
    "drain_timeout": "Worker(drain_timeout=...)",
    "serializer": "DelayedQueue(serializer=...)",
    "payload_type": "DelayedQueue(serializer=...)",
    "no_listen": "Worker(listen=False)",
    "groups": "DelayedQueue(groups=True)",
    "dead_blocks_group": "DelayedQueue(groups=True, dead_blocks_group=True)",
    "priorities": "DelayedQueue(priorities=True)",
    "priority_aging": "DelayedQueue(priorities=True, priority_aging=...)",
    "otel": "Worker(hooks=OtelHooks()) and register(queue, traced_handler(handler))",
}


def serializer_for(kind: str, type_name: str | None) -> Serializer[Any]:
    if kind == "bytes":
        return BytesSerializer(type_name or "bytes")
    return JsonSerializer(type_name or "json")


def metrics_hooks(
    db_sessions: sessionmaker[Any], table: Any, queues: list[str], port: int | None, otel: bool
) -> Any:
    """Prometheus and/or OpenTelemetry hooks, with their depth and lag collectors."""
    from . import metrics

    hooks: list[Any] = []
    if port is not None:
        try:
            hooks.append(metrics.serve_prometheus(port, db_sessions, table=table, queues=queues))
        except ImportError as exc:
            raise RuntimeFailure(
                f"--metrics-port needs prometheus-client ({exc}): "
                "pip install 'sqla_delayedq[prometheus]'"
            ) from exc
        except OSError as exc:  # in use, or not ours to bind
            raise RuntimeFailure(
                f"--metrics-port {port}: cannot serve metrics there "
                f"({exc.strerror or exc}); choose a free port"
            ) from exc
    if otel:
        try:
            hooks.append(metrics.OtelHooks())
            metrics.observe_queues(db_sessions, table=table, queues=queues)
        except ImportError as exc:
            raise RuntimeFailure(
                f"--otel needs opentelemetry-api ({exc}): pip install 'sqla_delayedq[otel]'"
            ) from exc
    if not hooks:
        return None
    return hooks[0] if len(hooks) == 1 else metrics.CompositeHooks(*hooks)


def configure_logging(ctx: click.Context, level: str) -> None:
    """Log to stderr at ``level``; an explicit ``--log-level`` also wins over the app's own."""
    from .processes import CHILD_ENV

    child = "[%(process)d] " if os.environ.get(CHILD_ENV) else ""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {child}%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if ctx.get_parameter_source("log_level") is ParameterSource.COMMANDLINE:
        logging.getLogger().setLevel(level.upper())


def refuse_worker_flags(ctx: click.Context, target: str) -> None:
    """One line naming every flag given that a worker of the user's own already decides."""
    given = [
        name
        for name in WORKER_SETTINGS
        if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]
    if not given:
        return
    opts = {p.name: p.opts for p in ctx.command.params}
    flags = [max(opts[name], key=len) for name in given]
    where = "; ".join(dict.fromkeys(WORKER_SETTINGS[name] for name in given))
    verb, them = ("does", "it") if len(flags) == 1 else ("do", "them")
    raise BadInput(
        f"{', '.join(flags)} {verb} not apply to {target}, a worker built in your code: "
        f"set {them} on your Worker ({where})"
    )


def ignore_environment(ctx: click.Context, target: str) -> None:
    """``$DELAYEDQ_DATABASE_URL`` and ``$DELAYEDQ_TABLE`` serve the other commands: say so."""
    for name, var in (("url", URL_ENV_VAR), ("table", "DELAYEDQ_TABLE")):
        if ctx.get_parameter_source(name) is ParameterSource.ENVIRONMENT:
            log.info("$%s is not used: %s uses %s", var, target, WORKER_SETTINGS[name])


def hook_metrics(worker: Any, target: str, port: int) -> AppDatabase:
    """Serve Prometheus metrics for a user's worker: its hooks are kept and ours added."""

    app = AppDatabase(worker, target)
    tables = app.tables()
    if len(tables) > 1:
        app.close()
        raise BadInput(
            f"--metrics-port reports the queues of one table; those of {target} live in "
            f"{', '.join(tables)}: serve metrics from your code (sqla_delayedq.metrics)"
        )
    (queues,) = tables.values()
    table: Table = queues[0].table
    hooks = metrics_hooks(app.sessions, table, [q.name for q in queues], port, otel=False)
    worker.add_hooks(hooks)
    return app


def _unreachable(exc: Exception) -> bool:
    """The check could not reach the database (refused, restarting, failing over): not a
    configuration error. The worker retries such errors itself, so it starts anyway; exiting
    would make ``--processes`` count a quick exit and, after three, stop every child."""
    from ._dialects import is_transient

    if not is_transient(exc):
        return False
    log.warning("could not check the tables (%s); starting, the worker retries", exc)
    return True


def _problem(conn: Any, tables: list[Table], entities: Collection[Table] = ()) -> str | None:
    """The first table that is missing or is not a message table (an entity-queue table, for
    those in ``entities``), as advice (None: all fine)."""
    for t in tables:
        problem = table_problem(conn, t, from_app=True, entity=t in entities)
        if problem is not None:
            return problem
    return None


@contextlib.contextmanager
def _unless_unreachable() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if not _unreachable(exc):
            raise


def check_tables(bind: Any, tables: list[Table], entities: Collection[Table] = ()) -> None:
    """Before running: each table exists and is a message table, or the entity-queue table of
    an ``EntityQueue`` for those in ``entities`` (advice when not)."""
    if not isinstance(bind, Engine):
        return  # a sessionmaker without one engine: the worker finds out itself
    problem = None
    with _unless_unreachable(), bind.connect() as conn:
        problem = _problem(conn, tables, entities)
    if problem is not None:
        raise RuntimeFailure(problem)


async def check_tables_async(
    bind: Any, tables: list[Table], entities: Collection[Table] = ()
) -> None:
    """:func:`check_tables` through an ``AsyncWorker``'s own engine and driver."""
    from sqlalchemy.ext.asyncio import AsyncEngine

    if not isinstance(bind, AsyncEngine):
        return
    problem = None
    with _unless_unreachable():
        async with bind.connect() as conn:
            problem = await conn.run_sync(_problem, tables, entities)
    if problem is not None:
        raise RuntimeFailure(problem)


STOP_NOTED = "delayedq.stop_noted"


def note_stop_signals(ctx: click.Context) -> None:
    """A supervised worker process (``-p N``) notes SIGTERM and SIGINT outside its worker's
    ``run()``, whose own handlers take them meanwhile. Ctrl-C reaches the process and its
    supervisor, which then sends SIGTERM as well: one that came after the worker had
    stopped killed the process (status -15, and the supervisor exited 1). One that came
    while the process started (the supervisor blocks both until here) stops its worker as
    soon as it runs."""
    from ._consumer import STOP_SIGNALS
    from .processes import CHILD_ENV

    if not os.environ.get(CHILD_ENV):
        return
    noted: list[int] = ctx.meta.setdefault(STOP_NOTED, [])
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _: noted.append(signum))
    if hasattr(signal, "pthread_sigmask"):  # POSIX: the supervisor blocked them
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def stop_if_noted(ctx: click.Context, worker: Any) -> None:
    """Just before ``run()``: a stop signal noted while the process started stops the worker
    at once (it drains nothing, as it took nothing). A child of ``--processes`` tells its
    supervisor here that it started: an exit before this is a failure to start."""
    from .processes import report_started

    report_started()
    if ctx.meta.get(STOP_NOTED):
        log.info("stopping at once: a stop signal came while the worker process started")
        worker.request_stop()


def monitor(worker: Any, heartbeat: float, no_monitor: bool) -> None:
    """Record the worker in the dashboard's tables (sqla_delayedq.monitor), unless told not to."""
    if no_monitor:
        return
    from .monitor import monitor_worker

    monitor_worker(worker, heartbeat=heartbeat, started_by="cli")


def run_user_worker(
    ctx: click.Context,
    target: str,
    worker: Any,
    metrics_port: int | None,
    heartbeat: float = 10.0,
    no_monitor: bool = False,
) -> None:
    from .worker import Worker

    monitor(worker, heartbeat, no_monitor)
    app = hook_metrics(worker, target, metrics_port) if metrics_port is not None else None
    if app is not None:
        ctx.call_on_close(app.close)
    queues: tuple[Any, ...] = tuple(worker.queues)  # DelayedQueue and EntityQueue sources
    log.info(
        "running %s: %s serving %s",
        target,
        type(worker).__name__,
        ", ".join(f"{q.name} ({table_key(q.table)})" for q in queues) or "no queue",
    )
    tables = list({q.table.key: q.table for q in queues}.values())
    entities = {q.table for q in queues if isinstance(q, EntityQueue)}
    if isinstance(worker, Worker):
        check_tables(worker.sessions.kw.get("bind"), tables, entities)
        stop_if_noted(ctx, worker)
        drained = worker.run()
    else:

        async def main() -> bool:
            bind = worker.sessions.kw.get("bind")
            try:
                await check_tables_async(bind, tables, entities)
                stop_if_noted(ctx, worker)
                return bool(await worker.run())
            finally:
                if hasattr(bind, "dispose"):  # close the pool while its event loop runs
                    await bind.dispose()

        drained = asyncio.run(main())
    if not drained:
        log.warning("some handlers did not finish within the drain timeout; released them")
        ctx.exit(1)
    log.info("stopped cleanly")


@click.command()
@url_option
@table_option
@click.argument("target", metavar="TARGET")
@queues_option("A queue to consume (repeatable); quick form only.")
@click.option("--concurrency", "-c", type=click.IntRange(min=1), default=4, show_default=True)
@click.option(
    "--mode",
    type=click.Choice(["lease", "transactional"]),
    default="lease",
    show_default=True,
    help="lease: handler(envelope), at-least-once; "
    "transactional: handler(envelope, session), one transaction with the ack.",
)
@duration_option("--lease", default="300", show_default=True, help="Lease length.")
@duration_option("--poll-interval", default="5", show_default=True, help="Longest idle sleep.")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--max-attempts", type=click.IntRange(min=1), default=5, show_default=True)
@duration_option("--handler-timeout", help="Stop extending the lease of a handler after this long.")
@duration_option(
    "--drain-timeout",
    default="30",
    show_default=True,
    help="On SIGTERM, how long in-flight handlers may run before their messages are released.",
)
@click.option("--serializer", type=click.Choice(["json", "bytes"]), default="json")
@click.option("--payload-type", help="The serializer's type name (default: json / bytes).")
@click.option("--no-listen", is_flag=True, help="Do not LISTEN for offers (PostgreSQL).")
@click.option(
    "--groups",
    is_flag=True,
    help="Deliver messages that share a group key one at a time, in schedule order.",
)
@click.option(
    "--dead-blocks-group",
    is_flag=True,
    help="With --groups: a dead message holds the rest of its group back.",
)
@click.option(
    "--priorities",
    is_flag=True,
    help="Take due messages with a higher priority first.",
)
@duration_option(
    "--priority-aging",
    help="With --priorities: a message due for longer than this goes before boosted ones.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics (added to a worker's own hooks).",
)
@click.option("--otel", is_flag=True, help="OpenTelemetry spans and metrics (quick form only).")
@duration_option(
    "--heartbeat",
    default="10",
    show_default=True,
    help="How often the worker writes its row and counters for the dashboard.",
)
@click.option(
    "--no-monitor",
    is_flag=True,
    help="Do not record this worker in the dashboard's tables (delayedq_workers, delayedq_stats).",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
)
@click.option(
    "--processes",
    "-p",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run TARGET in this many supervised processes (a dead one is replaced; SIGTERM "
    "drains them all).",
)
@click.pass_context
def worker(
    ctx: click.Context,
    url: str | None,
    table: str,
    target: str,
    queues: tuple[str, ...],
    concurrency: int,
    mode: str,
    lease: timedelta,
    poll_interval: timedelta,
    batch_size: int,
    max_attempts: int,
    handler_timeout: timedelta | None,
    drain_timeout: timedelta,
    serializer: str,
    payload_type: str | None,
    no_listen: bool,
    groups: bool,
    dead_blocks_group: bool,
    priorities: bool,
    priority_aging: timedelta | None,
    metrics_port: int | None,
    otel: bool,
    heartbeat: timedelta,
    no_monitor: bool,
    log_level: str,
    processes: int,
) -> None:
    """Run TARGET: your Worker or AsyncWorker, or (quick form) a handler function with -q.

    \b
    delayedq worker myapp.jobs:worker          a Worker/AsyncWorker built in your code, as is
    delayedq worker myapp.jobs:make_worker     a function without arguments returning one
    delayedq worker myapp.tasks:handle -q emails --concurrency 4 --lease 5m
                                               quick form: the queue is built from the flags
    delayedq worker myapp.jobs:worker -p 2     two processes of it, supervised
    """
    note_stop_signals(ctx)
    # What every child would refuse fails here, once, not in every child.
    obj = import_object(target, "TARGET")
    own_worker = is_worker(obj) or is_factory(obj)
    if own_worker:
        refuse_worker_flags(ctx, target)
        if heartbeat <= timedelta(0):
            raise BadInput("--heartbeat must be greater than 0")
    else:
        refuse_quick_form(target, obj, queues)
    if processes > 1:
        from .processes import run_processes

        if metrics_port is not None:  # every child would serve it: all but one fail to bind
            raise BadInput(
                "--metrics-port serves one process's metrics, and --processes starts several: "
                "run one worker per port (a process each, as a process manager starts them), "
                "or use --otel, which pushes each process's figures"
            )

        configure_logging(ctx, log_level)
        ctx.exit(run_processes(target, processes, child_args(ctx, target)))
    if own_worker:
        user_worker = as_worker(obj, target, "TARGET")
        configure_logging(ctx, log_level)
        ignore_environment(ctx, target)
        run_user_worker(
            ctx, target, user_worker, metrics_port, heartbeat.total_seconds(), no_monitor
        )
        return
    params = {k: v for k, v in ctx.params.items() if k not in ("target", "processes")}
    run_quick_form(ctx, target=target, fn=obj, **params)


def refuse_quick_form(target: str, obj: Any, queues: tuple[str, ...]) -> None:
    """The quick form's checks of TARGET (a handler function) and -q."""
    if is_async_callable(obj):
        raise BadInput(
            f"{target} is an async function: the quick form runs plain functions on threads; "
            "build an AsyncWorker (sqla_delayedq.aio) in your code, register it there and "
            "pass module:worker"
        )
    if not callable(obj):
        raise BadInput(
            f"TARGET {target!r} is {article(type(obj).__name__)}: pass a Worker, an AsyncWorker, a "
            "function returning one, or a handler function with -q"
        )
    if not queues:
        raise BadInput(
            "Missing option '--queue' / '-q': the quick form module:function consumes the "
            "queues named with -q (or pass module:worker, a Worker built in your code)"
        )


def run_quick_form(
    ctx: click.Context,
    *,
    url: str | None,
    table: str,
    target: str,
    fn: Any,
    queues: tuple[str, ...],
    concurrency: int,
    mode: str,
    lease: timedelta,
    poll_interval: timedelta,
    batch_size: int,
    max_attempts: int,
    handler_timeout: timedelta | None,
    drain_timeout: timedelta,
    serializer: str,
    payload_type: str | None,
    no_listen: bool,
    groups: bool,
    dead_blocks_group: bool,
    priorities: bool,
    priority_aging: timedelta | None,
    metrics_port: int | None,
    otel: bool,
    heartbeat: timedelta,
    no_monitor: bool,
    log_level: str,
) -> None:
    """A Worker built from the flags, with ``fn`` on every queue named with ``-q``."""
    from .worker import Worker

    if lease <= timedelta(0) or poll_interval <= timedelta(0) or heartbeat <= timedelta(0):
        raise BadInput("--lease, --poll-interval and --heartbeat must be greater than 0")
    if handler_timeout is not None and handler_timeout <= timedelta(0):
        raise BadInput("--handler-timeout must be greater than 0")
    if dead_blocks_group and not groups:
        raise BadInput("--dead-blocks-group needs --groups")
    if priority_aging is not None and not priorities:
        raise BadInput("--priority-aging needs --priorities")
    if priority_aging is not None and priority_aging <= timedelta(0):
        raise BadInput("--priority-aging must be greater than 0")
    configure_logging(ctx, log_level)
    db = open_db(ctx, url, table, pool_size=concurrency + 4, max_overflow=concurrency)
    names = list(dict.fromkeys(queues))
    if otel:
        from .metrics import traced_handler

        fn = traced_handler(fn)
    hooks = metrics_hooks(db.sessions, db.table, names, metrics_port, otel)
    w = Worker(
        db.sessions,
        concurrency=concurrency,
        poll_interval=poll_interval.total_seconds(),
        batch_size=batch_size,
        listen=not no_listen,
        drain_timeout=drain_timeout.total_seconds(),
        hooks=hooks,
    )
    for name in names:
        queue: DelayedQueue[Any] = DelayedQueue(
            name,
            model=db.model,
            serializer=serializer_for(serializer, payload_type),
            lease=lease,
            retry=ExponentialBackoff(max_attempts=max_attempts),
            groups=groups,
            dead_blocks_group=dead_blocks_group,
            priorities=priorities,
            priority_aging=priority_aging,
        )
        w.register(queue, fn, mode=cast("Mode", mode), lease=lease, handler_timeout=handler_timeout)
    monitor(w, heartbeat.total_seconds(), no_monitor)
    log.info("consuming %s with %s (%s mode)", ", ".join(names), target, mode)
    stop_if_noted(ctx, w)
    drained = w.run()
    if not drained:
        log.warning("some handlers did not finish within the drain timeout; released them")
        ctx.exit(1)
    log.info("stopped cleanly")


def child_args(ctx: click.Context, target: str) -> list[str]:
    """The options this command was given, without TARGET and ``--processes``: what each child
    process of ``--processes N`` runs with (``delayedq worker TARGET ARGS``). Read from the
    arguments the command line was run with (``main(argv)`` too), not ``sys.argv``."""
    argv = list(ctx.meta.get(ARGV, sys.argv[1:]))
    rest = argv[argv.index("worker") + 1 :] if "worker" in argv else []
    if target in rest:
        rest.remove(target)
    args: list[str] = []
    skip = False
    for arg in rest:
        if skip:
            skip = False
        elif arg in ("--processes", "-p"):
            skip = True
        elif arg.startswith("--processes=") or (arg.startswith("-p") and arg[2:].isdigit()):
            continue
        else:
            args.append(arg)
    return args
