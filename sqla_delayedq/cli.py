"""The ``delayedq`` command line (optional extra: ``pip install 'sqla_delayedq[cli]'``).

::

    delayedq worker myapp.jobs:worker       # your Worker or AsyncWorker, run as you built it
    delayedq worker myapp.tasks:handle -q emails --concurrency 4 --lease 5m   # quick form
    delayedq stats                          # per queue: due, scheduled, in flight, dead, lag
    delayedq ls -q emails --state dead      # list; `search` adds payloads and a count
    delayedq search -q invoices --where companyId=3345
    delayedq show -q emails welcome/42
    delayedq retry -q emails welcome/42     # one dead message; `requeue` for all that match
    delayedq drop -q emails --state dead --key-prefix welcome/ --yes
    delayedq reschedule -q emails --key-prefix welcome/     # "process now"
    delayedq cron ls
    delayedq db upgrade

The database URL comes from ``--url`` or ``$DELAYEDQ_DATABASE_URL``, and the table from
``--table``; or both from the user's worker with ``--app myapp.jobs:worker`` (``$DELAYEDQ_APP``).
Human output is tables;
``--json`` gives stable keys and ISO 8601 UTC datetimes. Bad input exits 2 and other failures
exit 1, each with one line on stderr. The commands are built with click and rich; without them
:func:`main` prints how to install them. ``import sqla_delayedq`` never imports either.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import click

__all__ = ["cli", "main"]

INSTALL_HINT = "pip install 'sqla_delayedq[cli]'"
_CLI_PACKAGES = ("click", "rich")


def _missing_cli_package(exc: ImportError) -> bool:
    name = exc.name or ""
    return any(name == p or name.startswith(p + ".") for p in _CLI_PACKAGES)


def main(argv: list[str] | None = None) -> None:
    """The console script: run the command line, or say how to install what it needs."""
    try:
        from ._cli_app import cli
    except ImportError as exc:
        if not _missing_cli_package(exc):
            raise
        print(f"delayedq needs {exc.name}: {INSTALL_HINT}", file=sys.stderr)
        raise SystemExit(1) from None
    cli.main(args=argv, prog_name="delayedq")


def __getattr__(name: str) -> Any:
    if name == "cli":
        from ._cli_app import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    cli: click.Group

if __name__ == "__main__":
    main()
