"""``delayedq worker module:handler``: run a :class:`~sqla_delayedq.worker.Worker` until SIGTERM.

On SIGTERM or SIGINT the worker takes nothing new, lets in-flight handlers finish (up to
``--drain-timeout``), releases what could not finish, and exits 0; it exits 1 when it had to
release messages of handlers that did not finish in time.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import click
from sqlalchemy.orm import sessionmaker

from ._cli_base import (
    BadInput,
    RuntimeFailure,
    db_options,
    duration_option,
    open_db,
    queues_option,
)
from ._queue import DelayedQueue
from .retry import ExponentialBackoff
from .serializers import BytesSerializer, JsonSerializer, Serializer

if TYPE_CHECKING:
    from .worker import Mode

log = logging.getLogger("sqla_delayedq.cli")


def import_handler(spec: str) -> Any:
    """``package.module:function`` (or ``module:object.method``) -> the callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadInput(f"handler {spec!r} is not module:function (e.g. myapp.tasks:handle)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the project's modules are importable
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise BadInput(f"cannot import handler module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise BadInput(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(target):
        raise BadInput(f"handler {spec!r} is not callable")
    return target


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


@click.command()
@db_options
@click.argument("handler")
@queues_option("A queue to consume (repeatable).", required=True)
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
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Serve Prometheus metrics.")
@click.option("--otel", is_flag=True, help="OpenTelemetry spans and metrics (global providers).")
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
)
@click.pass_context
def worker(
    ctx: click.Context,
    url: str | None,
    table: str,
    handler: str,
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
    metrics_port: int | None,
    otel: bool,
    log_level: str,
) -> None:
    """Run HANDLER (module:function) on the messages of the queues given with -q.

    Example: delayedq worker myapp.tasks:handle -q emails --concurrency 4 --lease 5m
    """
    from .worker import Worker

    if lease <= timedelta(0) or poll_interval <= timedelta(0):
        raise BadInput("--lease and --poll-interval must be greater than 0")
    fn = import_handler(handler)
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
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
        )
        w.register(queue, fn, mode=cast("Mode", mode), lease=lease, handler_timeout=handler_timeout)
    log.info("consuming %s with %s (%s mode)", ", ".join(names), handler, mode)
    drained = w.run()
    if not drained:
        log.warning("some handlers did not finish within the drain timeout; released them")
        ctx.exit(1)
    log.info("stopped cleanly")
