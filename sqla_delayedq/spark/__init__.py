"""Spark pipelines: enqueue a DataFrame from the executors, read a queue back as a DataFrame.

Install the extra: ``pip install "sqla_delayedq[spark]"`` (pyspark 4, pyarrow, pandas, and
psycopg for the PostgreSQL fast path); the executors need the package too.

Enqueue one message per row, idempotently, from the executors::

    from sqla_delayedq.spark import offer_dataframe, read_queue

    counts = offer_dataframe(
        reminders,                        # columns: key, payload (struct or JSON), due
        "postgresql+psycopg://app@db/app",
        "reminders",
        scheduled_at="due",
    )
    counts.created, counts.updated, counts.ignored

Each partition opens its own connection and writes in one transaction: on PostgreSQL a
``COPY`` into a temporary table and one ``INSERT ... ON CONFLICT`` in key order (so partitions
sharing keys cannot deadlock), with exact counts whichever task attempts committed; elsewhere
``DelayedQueue.offer_batch`` in chunks. The offer modes are those of ``DelayedQueue.offer``,
so a retried task or a re-run job adds nothing that is already there.

Read a queue (and optionally its dead letters) for analytics::

    df = read_queue(spark, url, "reminders", payload_fields={"user_id": "long"})

Passwords stay on the driver: executors get the URL without it and find it in
``PGPASSWORD``, ``PGPASSFILE`` or ``~/.pgpass``, or call a ``connection_factory`` you supply.
Times are UTC instants end to end; a ``TIMESTAMP_NTZ`` schedule column is accepted only when
the session time zone is UTC (otherwise the error gives the conversion that names its zone).
See ``docs/spark.md``.
"""

from __future__ import annotations

try:
    import pyspark  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'sqla_delayedq.spark needs pyspark, pyarrow and pandas: pip install "sqla_delayedq[spark]"'
    ) from exc

from ._read import read_queue
from ._write import OfferCounts, offer_dataframe

__all__ = ["OfferCounts", "offer_dataframe", "read_queue"]
