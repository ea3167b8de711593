"""The ``delayedq`` command group: every command, assembled."""

from __future__ import annotations

import click

from ._cli_admin import drop, requeue, reschedule, retry
from ._cli_base import DelayedqGroup
from ._cli_controls import controls, limit, pause, resume
from ._cli_ops import cron, db, doctor
from ._cli_read import ls, search, show, stats
from ._cli_web import web
from ._cli_worker import worker

__all__ = ["cli"]

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(cls=DelayedqGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="sqla_delayedq", prog_name="delayedq")
def cli() -> None:
    """Operate sqla_delayedq queues: run workers, inspect and repair messages, migrate.

    The database URL comes from --url or $DELAYEDQ_DATABASE_URL, e.g.
    postgresql+psycopg://user@host/app. Add --json to a command for machine-readable output.
    """


for command in (
    worker,
    stats,
    ls,
    search,
    show,
    retry,
    requeue,
    drop,
    reschedule,
    pause,
    resume,
    limit,
    controls,
    cron,
    db,
    doctor,
    web,
):
    cli.add_command(command)
