"""The repository's Alembic environment: sqla_delayedq's packaged migrations, run from a checkout.

``alembic.ini`` points ``version_locations`` at ``sqla_delayedq/migrations/versions`` (the
revisions that ship in the wheel) and this file runs the packaged environment, so
``alembic upgrade head`` here does exactly what ``delayedq db upgrade`` does from a pip install,
recorded in the same version table. ``alembic revision`` here writes the next revision into the
package, from ``script.py.mako`` (a link to the package's template).
"""

from sqla_delayedq.migrations import run_environment

run_environment()
