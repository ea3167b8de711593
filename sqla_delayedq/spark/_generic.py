"""MariaDB/MySQL and SQLite on the executors, through SQLAlchemy Core.

These backends have no ``COPY``; a partition goes through :meth:`DelayedQueue.offer_batch`,
which already writes chunked multi-row insert-ignores under each backend's parameter limit,
folds repeated keys in input order and applies the offer modes exactly. Reads page through an
id range with a server-side cursor. PostgreSQL never comes here (see ``_pg``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
from sqlalchemy import MetaData, Table, select
from sqlalchemy.orm import DeclarativeBase, Session

from .._codec import Codec
from .._queue import DelayedQueue
from .._types import Outcome
from ..errors import InvalidArgument
from ..models import NAMING_CONVENTION, DelayedMessage, QueueMessageMixin
from ..serializers import JsonSerializer
from ._common import ConnectSpec, Counts, ReadPlan, WritePlan, normalise

#: Messages handed to one ``offer_batch`` call.
BATCH = 5000


def write_partition(
    spec: ConnectSpec, plan: WritePlan, batches: Iterator[pa.RecordBatch], partition: int
) -> Counts:
    """Offer a partition with ``offer_batch``, one transaction (or one per ``commit_every``)."""
    total = Counts()
    model = model_class(plan.table)
    serializer: JsonSerializer[Any] = JsonSerializer(plan.payload_type)
    queues: dict[str, DelayedQueue[Any]] = {}
    engine = spec.engine()
    since_commit = 0
    try:
        with Session(engine) as session:
            session.begin()
            for raw in batches:
                rows = normalise(raw, partition).to_pylist()
                start = 0
                while start < len(rows):
                    size = BATCH
                    if plan.commit_every:
                        size = min(size, plan.commit_every - since_commit)
                    chunk = rows[start : start + size]
                    start += len(chunk)
                    by_queue: dict[str, list[Any]] = {}
                    for r in chunk:
                        by_queue.setdefault(r["queue"], []).append(
                            (r["key"], _payload(r["key"], r["payload"]), r["at"])
                        )
                    for name, messages in by_queue.items():
                        q = queues.get(name)
                        if q is None:
                            q = queues[name] = DelayedQueue(
                                name,
                                model=model,
                                serializer=serializer,
                                clock=lambda: plan.now,
                                notify=False,
                            )
                        for result in q.offer_batch(session, messages, mode=plan.mode):
                            total.created += result.outcome is Outcome.CREATED
                            total.updated += result.outcome is Outcome.UPDATED
                    total.staged += len(chunk)
                    since_commit += len(chunk)
                    if plan.commit_every and since_commit >= plan.commit_every:
                        session.commit()
                        since_commit = 0
                        if plan.after_commit is not None:
                            plan.after_commit(partition, total.staged)
                        session.begin()
            session.commit()
            if plan.after_commit is not None:
                plan.after_commit(partition, total.staged)
    finally:
        engine.dispose()
    return total


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _payload(key: str, text: str) -> Any:
    try:  # NaN / Infinity are not JSON: refuse them here, naming the row, as PostgreSQL does
        value = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise InvalidArgument(f"the payload of key {key!r} is not JSON: {exc}") from None
    try:
        _CODEC.serialize(value)  # NUL, lone surrogates: what offer refuses, with the key
    except InvalidArgument as exc:
        raise InvalidArgument(f"the payload of key {key!r} cannot be stored: {exc}") from None
    return value


_CODEC: Codec[Any] = Codec(JsonSerializer())


@functools.cache
def model_class(parts: tuple[str, ...]) -> type[QueueMessageMixin]:
    if parts == (DelayedMessage.__tablename__,):
        return DelayedMessage

    class Base(DeclarativeBase):
        metadata = MetaData(
            naming_convention=NAMING_CONVENTION, schema=parts[0] if len(parts) == 2 else None
        )

    return type("Message", (QueueMessageMixin, Base), {"__tablename__": parts[-1]})


def read_range(
    spec: ConnectSpec, plan: ReadPlan, lo: int | None, hi: int | None, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    t: Table = model_class(plan.table).__table__  # type: ignore[attr-defined]
    stmt = select(*(t.c[c] for c in plan.columns), t.c.payload.label("_payload"))
    if lo is not None:
        stmt = stmt.where(t.c.id >= lo)
    if hi is not None:
        stmt = stmt.where(t.c.id < hi)
    if plan.queue is not None:
        stmt = stmt.where(t.c.queue == plan.queue)
    if plan.dead_letters == "exclude":
        stmt = stmt.where(t.c.status != "dead")
    elif plan.dead_letters == "only":
        stmt = stmt.where(t.c.status == "dead")
    engine = spec.engine()
    try:
        with engine.connect() as conn:
            result = conn.execution_options(yield_per=10_000).execute(stmt)
            for rows in result.partitions():
                yield _batch(rows, plan, schema)
    finally:
        engine.dispose()


def _field_text(payload: Any, name: str) -> str | None:
    """What PostgreSQL's ``payload ->> name`` gives: strings bare, other values as JSON."""
    if not isinstance(payload, dict) or payload.get(name) is None:
        return None
    value = payload[name]
    return value if isinstance(value, str) else json.dumps(value)


def _batch(rows: Any, plan: ReadPlan, schema: pa.Schema) -> pa.RecordBatch:
    columns: list[list[Any]] = [[] for _ in schema]
    n = len(plan.columns)
    for row in rows:
        for i in range(n):
            columns[i].append(row[i])
        payload = row[n]
        for j, name in enumerate(plan.fields):
            columns[n + j].append(_field_text(payload, name))
    if "payload" in plan.columns:
        i = plan.columns.index("payload")
        columns[i] = [None if p is None else json.dumps(p) for p in columns[i]]
    arrays = [pa.array(values, field.type) for values, field in zip(columns, schema, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
