"""The Alembic environment of sqla_delayedq's own migrations: see :mod:`sqla_delayedq.migrations`.

Alembic runs this file; importing it does nothing useful outside an Alembic command.
"""

from sqla_delayedq.migrations import run_environment

run_environment()
