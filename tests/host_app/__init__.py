"""A minimal host application: its own ``Base``, a domain model, an outbox on the mixin.

It stands for a user's project in ``tests/test_alembic.py``: its ``alembic.ini`` and
``migrations/`` are what a user writes, and the test runs both ways of getting the queue table
(autogenerate, and the hand-written revision in ``migrations/versions/``) on every backend.
By hand, from the repository root::

    alembic -c tests/host_app/alembic.ini -x url=sqlite:///host_app.sqlite upgrade head
"""
