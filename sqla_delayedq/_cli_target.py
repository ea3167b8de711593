"""What ``delayedq`` is pointed at: ``module:attr`` naming the user's own objects.

- ``delayedq worker TARGET`` runs a :class:`~sqla_delayedq.worker.Worker` or
  :class:`~sqla_delayedq.aio.AsyncWorker` built in the user's code (or returned by a
  zero-argument callable) as it is, or, in the quick form, a plain handler function.
- ``--app TARGET`` on the read and admin commands takes the database and the message table from
  such a worker: its sessionmaker's engine (a synchronous engine derived from the URL of an
  ``AsyncWorker``'s) and its queues' own mapped classes, never a rebuilt class.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Sequence
from typing import Any

import click
from click.core import ParameterSource
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import Session, sessionmaker

from ._cli_base import (
    BadInput,
    Db,
    check_message_table,
    create_db_engine,
    given,
    model_for,
    require_sqlite_file,
    require_url,
)
from ._engine import SYNC_DRIVERS, sync_driver_url
from ._handlers import is_async_callable
from ._queue import DelayedQueue
from .models import QueueMessageMixin, table_key

__all__ = [
    "APP_ENV_VAR",
    "AppDatabase",
    "app_database",
    "article",
    "as_worker",
    "import_object",
    "is_worker",
    "pick_model",
    "sync_url",
]

APP_ENV_VAR = "DELAYEDQ_APP"

SHAPES = "a Worker, an AsyncWorker, or a function without arguments that returns one"


def import_object(spec: str, what: str) -> Any:
    """``package.module:attr`` (or ``module:obj.attr``) -> the object, imported with the
    current directory on ``sys.path`` as ``python -m`` would."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadInput(
            f"{what} {spec!r} is not module:attribute "
            "(e.g. myapp.jobs:worker or myapp.tasks:handle)"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise BadInput(f"cannot import module {module_name!r} of {what} {spec!r}: {exc}") from exc
    except Exception as exc:  # the module itself failed (a missing setting, a bug): one line
        raise BadInput(
            f"importing module {module_name!r} of {what} {spec!r} failed: "
            f"{type(exc).__name__}: {exc} (python -c 'import {module_name}' shows where)"
        ) from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise BadInput(f"module {module_name!r} has no attribute {attr!r}") from None
    return target


def _worker_classes() -> tuple[type, ...]:
    from .worker import Worker

    # An AsyncWorker can only exist if its module was imported: never import it (or asyncio
    # SQLAlchemy) just to ask.
    aio = sys.modules.get("sqla_delayedq.aio")
    return (Worker,) if aio is None else (Worker, aio.AsyncWorker)


def is_worker(obj: Any) -> bool:
    return isinstance(obj, _worker_classes())


def is_factory(obj: Any) -> bool:
    """A plain callable that can be called without arguments (a worker factory)."""
    if not callable(obj) or isinstance(obj, type) or is_async_callable(obj):
        return False
    try:
        inspect.signature(obj).bind()
    except (TypeError, ValueError):
        return False
    return True


def as_worker(obj: Any, spec: str, what: str) -> Any:
    """``obj`` if it is a worker, the worker a factory returns, else a one-line error."""
    if is_worker(obj):
        return obj
    if is_factory(obj):
        made = obj()
        if is_worker(made):
            return made
        raise BadInput(f"{spec}() returned {type(made).__name__}; {what} must be {SHAPES}")
    raise BadInput(f"{what} {spec!r} is {describe(obj)}; it must be {SHAPES}")


def describe(obj: Any) -> str:
    if isinstance(obj, DelayedQueue):
        return "a DelayedQueue (register it on a Worker and name the worker)"
    if isinstance(obj, type):
        return f"the class {obj.__name__}, not an instance"
    if callable(obj):
        return "a function that takes arguments"
    return article(type(obj).__name__)


def article(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def sync_url(url: URL) -> URL:
    """The synchronous driver's URL for an ``AsyncWorker``'s database."""
    sync = sync_driver_url(url)
    if sync is None:
        known = ", ".join(sorted(SYNC_DRIVERS))
        raise BadInput(
            f"cannot derive a synchronous driver from {url.drivername!r} (known: {known}); "
            "pass --url with a synchronous URL of the same database and --table"
        )
    return sync


def _bound_engine(sessions: Any, spec: str) -> Any:
    bind = getattr(sessions, "kw", {}).get("bind")
    if bind is None:
        raise BadInput(
            f"the sessionmaker of {spec!r} is not bound to an engine: "
            "build it as sessionmaker(engine) (or pass --url and --table instead of --app)"
        )
    return bind


class AppDatabase:
    """The database of a user's worker, opened the way the commands need it (synchronously)."""

    def __init__(self, worker: Any, spec: str) -> None:
        self.worker = worker
        self.spec = spec
        self.queues: tuple[DelayedQueue[Any], ...] = tuple(worker.queues)
        bind = _bound_engine(worker.sessions, spec)
        if isinstance(bind, Engine):
            self.engine = bind
            self.sessions: sessionmaker[Session] = worker.sessions
        elif hasattr(bind, "sync_engine"):  # an AsyncEngine: the same database, a sync driver
            self.engine = create_db_engine(sync_url(bind.url))
            self.sessions = sessionmaker(self.engine)
        else:
            raise BadInput(
                f"the sessionmaker of {spec!r} is bound to a {type(bind).__name__}, "
                "not an engine: build it as sessionmaker(engine)"
            )

    def close(self) -> None:
        """Close the pooled connections (the command is over; the engine stays usable)."""
        self.engine.dispose()

    def tables(self) -> dict[str, list[DelayedQueue[Any]]]:
        by_table: dict[str, list[DelayedQueue[Any]]] = {}
        for q in self.queues:
            by_table.setdefault(table_key(q.table), []).append(q)
        return by_table


def pick_model(
    app: AppDatabase, table: str | None, names: Sequence[str]
) -> type[QueueMessageMixin]:
    """The app's mapped class for the table the command works on.

    One table: that one. Several: the table given with ``--table``, else the one holding the
    queues named with ``-q``; otherwise the user is asked to choose.
    """
    by_table = app.tables()
    if not by_table:
        raise BadInput(f"{app.spec!r} has no queues registered: register them before using it")
    listing = "; ".join(f"{t}: {', '.join(q.name for q in qs)}" for t, qs in by_table.items())
    if table is not None:
        if table not in by_table:
            raise BadInput(
                f"table {table!r} holds none of the queues of {app.spec!r} ({listing}); "
                "drop --table or --app"
            )
        return by_table[table][0].model
    if len(by_table) == 1:
        return next(iter(by_table.values()))[0].model
    if names:
        served = {q.name for q in app.queues}
        unknown = [n for n in names if n not in served]
        if unknown:
            raise BadInput(
                f"queue {unknown[0]!r} is not a queue of {app.spec!r} ({listing}); "
                "pick the table with --table"
            )
        tables = [t for t, qs in by_table.items() if any(q.name in names for q in qs)]
        if len(tables) == 1:
            return by_table[tables[0]][0].model
        raise BadInput(
            f"the queues named with -q live in several tables ({', '.join(tables)}): "
            "pick one with --table"
        )
    raise BadInput(
        f"the queues of {app.spec!r} live in several tables ({listing}): "
        "name the queues with -q or pick a table with --table"
    )


def app_database(
    ctx: click.Context, spec: str, table: str | None, names: Sequence[str]
) -> tuple[AppDatabase, Db]:
    """The command's :class:`Db` from ``--app``: the worker's engine and its queue's model."""
    worker = as_worker(import_object(spec, "--app"), spec, "--app")
    app = AppDatabase(worker, spec)
    ctx.call_on_close(app.close)
    model = pick_model(app, table, names)
    name = table_key(model.__table__)  # type: ignore[attr-defined]
    url = app.engine.url.render_as_string(hide_password=False)
    return app, Db(url, name, app.engine, app.sessions, model)


def open_db(
    ctx: click.Context,
    url: str | None,
    table: str,
    *,
    app: str | None = None,
    queues: Sequence[str] = (),
    check_table: bool = True,
    **kwargs: Any,
) -> Db:
    """Connect (the engine is disposed when the command ends) and check the table.

    With ``app`` (``--app``) the engine and the table's mapped class come from the user's
    worker (see :mod:`sqla_delayedq._cli_target`); otherwise from ``--url`` and ``--table``.
    """
    if app:
        if ctx.get_parameter_source("url") is ParameterSource.COMMANDLINE:
            raise BadInput("--url and --app both name the database: give one of them")
        _, db = app_database(ctx, app, table if given(ctx, "table") else None, queues)
    else:
        url = require_url(url)
        require_sqlite_file(url)
        engine = create_db_engine(url, **kwargs)
        ctx.call_on_close(engine.dispose)
        db = Db(url, table, engine, sessionmaker(engine), model_for(table))
    if check_table:
        check_message_table(db, from_app=bool(app))
    return db
