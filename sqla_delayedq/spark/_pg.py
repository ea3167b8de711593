"""PostgreSQL on the executors: ``COPY`` in, one upsert per transaction, ``COPY`` out.

Writing a partition: ``COPY`` its rows (as CSV that Arrow renders in C++) into a temporary
staging table, then one ``INSERT ... SELECT ... ORDER BY queue, key ON CONFLICT (queue, key)``
that applies the offer mode to every row at once, counts what it created and updated
(``RETURNING xmax = 0``), reports that on the call's ledger channel and commits. That one
statement takes every row lock of the transaction, in key order, so overlapping partitions
wait for each other instead of deadlocking. The transaction covers
the whole partition (or each ``commit_every`` slice), so a failed task leaves nothing or whole
slices behind, and the retry finds those rows identical and leaves them alone (unless a
worker acknowledged one meanwhile, which deletes it: see docs/spark.md on retries).

Reading a range of ids: ``COPY (SELECT ...) TO STDOUT`` as CSV, parsed by Arrow into record
batches of the schema Spark expects. Statement builders are pure; only ``write_partition`` and
``read_range`` do I/O.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.csv as pcsv  # type: ignore[import-untyped]
from psycopg import sql
from sqlalchemy import table as sa_table

from .._dialects import PostgreSQLStrategy
from .._rules import FRESH, HELD, OFFER_RULES
from .._types import OfferMode
from .._wakeup import payload as wake_payload
from ..errors import InvalidArgument
from ..models import table_key
from ._common import (
    NO_PASSWORD_HINT,
    ROW_COLUMNS,
    TIMESTAMP_COLUMNS,
    ConnectSpec,
    Counts,
    ReadPlan,
    WritePlan,
    normalise,
)
from ._ledger import entry as ledger_entry

STAGE = sql.Identifier("sqla_delayedq_stage")

_CSV_OUT = pcsv.WriteOptions(include_header=False)

#: Bytes of ``COPY TO`` output gathered before Arrow parses them into one record batch.
READ_BLOCK_BYTES = 16 << 20

# -- statements (pure) -----------------------------------------------------------------------


def stage_ddl() -> sql.Composed:
    return sql.SQL(
        "CREATE TEMP TABLE {} (queue text, key text, payload text, at timestamptz) ON COMMIT DROP"
    ).format(STAGE)


def copy_in() -> sql.Composed:
    return sql.SQL("COPY {} (queue, key, payload, at) FROM STDIN (FORMAT csv)").format(STAGE)


def _mode_clause(mode: OfferMode, marked: bool) -> sql.Composable:
    """The ``ON CONFLICT`` clause of :func:`upsert`, written from the offers' own rule
    (:data:`sqla_delayedq._rules.OFFER_RULES`), so a bulk offer does what ``offer`` does."""
    rule = OFFER_RULES[mode]
    if not rule.updates:
        return sql.SQL("DO NOTHING")
    new_payload = sql.SQL(
        "(t.payload_type, t.payload, t.payload_bytes) IS DISTINCT FROM "
        "(EXCLUDED.payload_type, EXCLUDED.payload, EXCLUDED.payload_bytes)"
    )
    fresh = sql.SQL(", ").join(
        [
            sql.SQL("payload_type = EXCLUDED.payload_type"),
            sql.SQL("payload = EXCLUDED.payload"),
            sql.SQL("payload_bytes = NULL"),
            sql.SQL("headers = NULL"),  # the offer's headers: a bulk offer sends none
            sql.SQL("priority = 0"),  # and its priority: the default
            *(
                sql.SQL("{} = {}").format(sql.Identifier(c), sql.Literal(v))
                for c, v in FRESH.items()
                if c != "lock_token"  # below: an update of a message in flight holds it
            ),
        ]
    )
    changed: sql.Composable = new_payload
    if rule.compares_schedule and marked:
        # A row offered without a time ("as soon as possible") arrives with a NULL
        # scheduled_at: with an identical payload it is already there, whatever its schedule.
        changed = sql.SQL(
            "{} OR (EXCLUDED.scheduled_at IS NOT NULL AND "
            "t.scheduled_at_initially IS DISTINCT FROM EXCLUDED.scheduled_at_initially)"
        ).format(new_payload)
    # Unmarked, every staged row was offered without a time: only the payload can differ.
    schedule: sql.Composable
    if rule.reschedules:
        due = sql.SQL("EXCLUDED.scheduled_at_initially")
        schedule = sql.SQL("scheduled_at_initially = EXCLUDED.scheduled_at_initially, ")
    else:  # a done or dead row gets the offered time, an in-flight one is due now
        due = sql.SQL(
            "CASE WHEN t.status <> 'pending' THEN EXCLUDED.scheduled_at "
            # held for an old delivery: the held version's own time (as _rules.offer_changes)
            "WHEN t.lock_token ~ '^~-?[0-9]*~' THEN COALESCE(timestamptz 'epoch' + "
            "NULLIF(substring(t.lock_token FROM '^~(-?[0-9]*)~'), '')::bigint "
            "* interval '1 microsecond', t.scheduled_at) "
            "WHEN t.lock_token IS NOT NULL THEN %(now)s::timestamptz ELSE t.scheduled_at END"
        )
        schedule = sql.SQL("")
    # In flight: held until the old delivery ends, as _rules.hold writes it (the token keeps
    # the due time, in µs since the epoch, when the lease ends later).
    held = sql.SQL(
        "t.status = 'pending' AND t.lock_token IS NOT NULL "
        "AND t.scheduled_at > %(now)s::timestamptz"
    )
    schedule += sql.SQL(
        "scheduled_at = CASE WHEN {held} THEN t.scheduled_at ELSE {due} END, "
        "lock_token = CASE WHEN {held} THEN {mark} "
        "|| (extract(epoch FROM GREATEST({due}, timestamptz 'epoch')) * 1000000)::bigint::text "
        "|| {mark} "
        "|| regexp_replace(t.lock_token, {old}, '') END"
    ).format(held=held, due=due, mark=sql.Literal(HELD), old=sql.Literal(f"^{HELD}-?[0-9]*{HELD}"))
    return sql.SQL("DO UPDATE SET {}, {} WHERE {}").format(fresh, schedule, changed)


def upsert(table: Sequence[str], mode: OfferMode, *, timed: bool = True) -> sql.Composed:
    """Apply every staged row to the table in one statement; returns one row.

    The row is (created, updated, ids to finish): one ``INSERT ... SELECT ... ORDER BY queue,
    key ON CONFLICT`` takes every row lock of the transaction, in (queue, key) order in the "C"
    collation, so writers that share keys wait for each other and never deadlock.

    ``REPLACE`` treats a row offered with a time and one offered without differently (the
    latter is ``IGNORED`` when its payload is identical, as ``offer(at=None)``). With
    ``timed`` (some staged row has a time), a row without one is proposed with a NULL
    ``scheduled_at`` so that ``EXCLUDED`` tells the two apart inside the one statement; the
    rows this statement *created* that way come back as the third column, for
    :func:`finish_untimed` to give them their schedule. Without ``timed`` nothing is marked.

    A key staged twice is applied once: SKIP keeps its first occurrence, the other modes
    its last (``ON CONFLICT DO UPDATE`` may touch a row only once per statement). ``ON
    CONFLICT`` probes the unique index for every row, whatever the table's statistics say,
    and its ``WHERE`` leaves identical rows alone (``IGNORED``).
    """
    order = sql.SQL("ASC" if mode is OfferMode.SKIP else "DESC")
    marked = mode is OfferMode.REPLACE and timed
    scheduled = sql.SQL("s.at" if marked else "COALESCE(s.at, %(now)s::timestamptz)")
    return sql.SQL(
        'WITH s AS (SELECT DISTINCT ON (queue COLLATE "C", key COLLATE "C") queue, key, '
        "payload::jsonb AS payload, at FROM {stage} "
        'ORDER BY queue COLLATE "C", key COLLATE "C", ctid {order}), '
        "w AS (INSERT INTO {table} AS t (queue, key, payload_type, payload, payload_bytes, "
        "status, scheduled_at, scheduled_at_initially, created_at, attempts) "
        "SELECT s.queue, s.key, %(payload_type)s::text, s.payload, NULL, "
        "'pending', {scheduled}, COALESCE(s.at, %(now)s::timestamptz), "
        "%(now)s::timestamptz, 0 FROM s "
        'ORDER BY s.queue COLLATE "C", s.key COLLATE "C" '
        "ON CONFLICT (queue, key) {mode} "
        "RETURNING t.id, (t.xmax = 0) AS created, t.scheduled_at IS NULL AS untimed) "
        "SELECT count(*) FILTER (WHERE created), count(*) FILTER (WHERE NOT created), "
        "array_agg(id) FILTER (WHERE created AND untimed) FROM w"
    ).format(
        table=sql.Identifier(*table),
        stage=STAGE,
        order=order,
        scheduled=scheduled,
        mode=_mode_clause(mode, marked),
    )


def finish_untimed(table: Sequence[str]) -> sql.Composed:
    """Give the rows :func:`upsert` created without a time their schedule (``now``).

    Only rows this transaction inserted: no other transaction can hold or wait for their
    locks, so this second statement cannot take part in a deadlock.
    """
    return sql.SQL(
        "UPDATE {} SET scheduled_at = scheduled_at_initially WHERE id = ANY(%s::bigint[])"
    ).format(sql.Identifier(*table))


def notify(table: Sequence[str]) -> sql.Composed:
    """Wake the workers of the table (one payload per queue, see :mod:`.._wakeup`)."""
    return sql.SQL("SELECT pg_notify({}, p) FROM unnest(%s::text[]) AS p").format(
        sql.Literal(
            PostgreSQLStrategy.channel(
                table_key(sa_table(table[-1], schema=None if len(table) == 1 else table[0]))
            )
        )
    )


# -- write ------------------------------------------------------------------------------------


class _Slice:
    """One transaction: a staging table filled by ``COPY``, then the upsert and the commit."""

    def __init__(self, conn: Any, plan: WritePlan, partition: int) -> None:
        self.conn = conn
        self.plan = plan
        self.partition = partition
        self.counts = Counts()
        self.queues: set[str] = set()
        self.with_at = False
        conn.execute(stage_ddl())
        self._copy_cm = conn.cursor().copy(copy_in())
        self._copy = self._copy_cm.__enter__()

    def write(self, batch: pa.RecordBatch) -> None:
        buf = io.BytesIO()
        pcsv.write_csv(batch, buf, _CSV_OUT)
        self._copy.write(buf.getbuffer())
        self.counts.staged += batch.num_rows
        at = batch.column(3)
        self.with_at = self.with_at or at.null_count < len(at)
        if self.plan.notify:
            self.queues.update(pc.unique(batch.column(0)).to_pylist())

    def commit(self) -> Counts:
        self._copy_cm.__exit__(None, None, None)
        plan = self.plan
        params = {"payload_type": plan.payload_type, "now": plan.now}
        if self.counts.staged:
            stmt = upsert(plan.table, plan.mode, timed=self.with_at)
            try:
                with self.conn.transaction():  # a savepoint: the staged rows outlive an error
                    created, updated, untimed = self.conn.execute(stmt, params).fetchone()
            except psycopg.errors.DataError as exc:
                bad = first_bad_payload(self.conn)
                if bad is None:
                    raise
                key, text, error = bad
                raise InvalidArgument(
                    f"the payload of key {key!r} in partition {self.partition} is not JSON "
                    f"({error}): {text[:80]!r}"
                ) from exc
            if untimed:
                self.conn.execute(finish_untimed(plan.table), [untimed])
            self.counts.created += created
            self.counts.updated += updated
            if plan.notify and (self.counts.created or self.counts.updated):
                written = self.counts.created + self.counts.updated
                notes = [wake_payload(q, written) for q in sorted(self.queues)]
                self.conn.execute(notify(plan.table), [notes])
        if plan.ledger is not None:
            self.conn.execute(ledger_entry(plan.ledger), (self.counts.created, self.counts.updated))
        self.conn.commit()
        return self.counts


def first_bad_payload(conn: Any) -> tuple[str, str, str] | None:
    """(key, payload, error) of the first staged payload PostgreSQL cannot read as JSON.

    Only after the upsert failed: it bisects the staged rows, asking PostgreSQL itself (each
    probe in a savepoint), so "bad" means what the upsert's ``::jsonb`` means.
    """
    rows = conn.execute(
        sql.SQL("SELECT key, payload FROM {} ORDER BY ctid").format(STAGE)
    ).fetchall()
    probe = "SELECT count(v::jsonb) FROM unnest(%s::text[]) AS v"

    def error(lo: int, hi: int) -> str | None:
        try:
            with conn.transaction():
                conn.execute(probe, [[r[1] for r in rows[lo:hi]]])
        except psycopg.errors.DataError as exc:
            return str(exc).splitlines()[0]
        return None

    lo, hi = 0, len(rows)
    if error(lo, hi) is None:
        return None
    while hi - lo > 1:  # rows[lo:hi] holds a bad payload
        mid = (lo + hi) // 2
        if error(lo, mid) is not None:
            hi = mid
        else:
            lo = mid
    return rows[lo][0], rows[lo][1] or "", error(lo, hi) or ""


def write_partition(
    spec: ConnectSpec, plan: WritePlan, batches: Iterator[pa.RecordBatch], partition: int
) -> Counts:
    """Offer every row of one partition; one transaction, or one per ``commit_every`` rows."""
    total = Counts()
    with spec.pg() as conn:
        if conn.autocommit:
            conn.autocommit = False
        conn.execute("SET temp_buffers = '64MB'")
        conn.execute("SET work_mem = '64MB'")
        conn.commit()
        current = _Slice(conn, plan, partition)
        limit = plan.commit_every
        for raw in batches:
            batch = normalise(raw, partition)
            offset = 0
            while offset < batch.num_rows:
                take = batch.num_rows - offset
                if limit:
                    take = min(take, limit - current.counts.staged)
                current.write(batch.slice(offset, take))
                offset += take
                if limit and current.counts.staged >= limit:
                    _commit(current, total, partition)
                    current = _Slice(conn, plan, partition)
        _commit(current, total, partition)
    return total


def _commit(current: _Slice, total: Counts, partition: int) -> None:
    total.add(current.commit())
    if current.plan.after_commit is not None:
        current.plan.after_commit(partition, total.staged)


# -- read -------------------------------------------------------------------------------------


def _column_expr(name: str, as_text: bool) -> sql.Composable:
    ident = sql.Identifier(name)
    if name == "payload":
        return sql.SQL("{}::text").format(ident)
    if not as_text:
        return ident
    if name in TIMESTAMP_COLUMNS:
        return sql.SQL("({} AT TIME ZONE 'UTC')").format(ident)
    if name == "payload_bytes":
        return sql.SQL("encode({}, 'hex')").format(ident)
    return ident


def select_range(
    plan: ReadPlan, lo: int | None, hi: int | None, *, as_text: bool = False
) -> sql.Composed:
    """The rows of ids in ``[lo, hi)`` (``None``: no bound), payload fields as text.

    ``as_text`` shapes every value for a text ``COPY`` that Arrow parses: times as naive UTC,
    bytes as hex.
    """
    exprs: list[sql.Composable] = [_column_expr(c, as_text) for c in plan.columns]
    exprs += [sql.SQL("payload ->> {}").format(sql.Literal(f)) for f in plan.fields]
    conds: list[sql.Composable] = [sql.SQL("TRUE")]
    if plan.queue is not None:
        conds.append(sql.SQL("queue = {}").format(sql.Literal(plan.queue)))
    conds += status_conditions(plan.dead_letters)
    # OFFSET 0 fences the id range into its own scan (primary key or heap order): otherwise a
    # table without statistics invites the (queue, scheduled_at, id) index, which would walk
    # the whole queue in due order and fetch the heap at random for every range.
    bounds: list[sql.Composable] = [sql.SQL("TRUE")]
    if lo is not None:
        bounds.append(sql.SQL("id >= {}").format(sql.Literal(lo)))
    if hi is not None:
        bounds.append(sql.SQL("id < {}").format(sql.Literal(hi)))
    return sql.SQL("SELECT {} FROM (SELECT * FROM {} WHERE {} OFFSET 0) AS m WHERE {}").format(
        sql.SQL(", ").join(exprs),
        sql.Identifier(*plan.table),
        sql.SQL(" AND ").join(bounds),
        sql.SQL(" AND ").join(conds),
    )


def status_conditions(dead_letters: str) -> list[sql.Composable]:
    if dead_letters == "exclude":
        return [sql.SQL("status <> 'dead'")]
    if dead_letters == "only":
        return [sql.SQL("status = 'dead'")]
    return []


_ARROW_IN = {"BIGINT": pa.int64(), "INT": pa.int32(), "TIMESTAMP": pa.timestamp("us")}
_TYPES = dict(ROW_COLUMNS)


def _csv_options(plan: ReadPlan) -> tuple[Any, Any, Any]:
    names = [*plan.columns, *(f"\0field{i}" for i in range(len(plan.fields)))]
    types = {n: _ARROW_IN.get(_TYPES.get(n, ""), pa.string()) for n in names}
    read = pcsv.ReadOptions(column_names=names, block_size=READ_BLOCK_BYTES)
    parse = pcsv.ParseOptions(newlines_in_values=True)
    convert = pcsv.ConvertOptions(
        column_types=types,
        null_values=[""],
        strings_can_be_null=True,
        quoted_strings_can_be_null=False,
    )
    return read, parse, convert


def _to_batch(table: pa.Table, schema: pa.Schema) -> pa.RecordBatch:
    arrays = []
    for i, field in enumerate(schema):
        column = table.column(i).combine_chunks()
        if pa.types.is_binary(field.type) and column.null_count < len(column):
            column = pa.array(
                [None if v is None else bytes.fromhex(v) for v in column.to_pylist()],
                field.type,
            )
        arrays.append(column.cast(field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def read_range(
    spec: ConnectSpec, plan: ReadPlan, lo: int | None, hi: int | None, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    """Stream the rows of ids ``[lo, hi)`` as record batches of ``schema``.

    With the ADBC PostgreSQL driver installed (part of the ``spark`` extra) and no connection
    factory, libpq's binary ``COPY`` lands in Arrow without Python touching a row; otherwise a
    text ``COPY`` through psycopg is parsed by Arrow's CSV reader.
    """
    if spec.factory is None and _has_adbc():
        yield from _read_adbc(spec, select_range(plan, lo, hi), schema)
    else:
        yield from _read_csv(spec, plan, select_range(plan, lo, hi, as_text=True), schema)


def _has_adbc() -> bool:
    try:
        import adbc_driver_postgresql.dbapi  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return True


def _read_adbc(
    spec: ConnectSpec, query: sql.Composed, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    import adbc_driver_postgresql.dbapi as adbc  # type: ignore[import-untyped,unused-ignore]

    try:
        conn = adbc.connect(spec.conninfo)
    except adbc.Error as exc:
        if "password" in str(exc).lower():
            raise adbc.OperationalError(f"{exc}\n{NO_PASSWORD_HINT}") from exc
        raise
    with conn, conn.cursor() as cursor:
        cursor.execute(query.as_string(None))
        for batch in cursor.fetch_record_batch():
            columns = [batch.column(i).cast(f.type) for i, f in enumerate(schema)]
            yield pa.RecordBatch.from_arrays(columns, schema=schema)


def _read_csv(
    spec: ConnectSpec, plan: ReadPlan, query: sql.Composed, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    options = _csv_options(plan)
    with spec.pg() as conn:
        conn.execute("SET DateStyle = 'ISO, YMD'")
        conn.execute("SET client_encoding = 'UTF8'")
        with conn.cursor().copy(sql.SQL("COPY ({}) TO STDOUT (FORMAT csv)").format(query)) as copy:
            block: list[Any] = []
            size = 0
            for data in copy:
                block.append(data)
                size += len(data)
                if size >= READ_BLOCK_BYTES:
                    yield _parse(block, options, schema)
                    block, size = [], 0
            if block:
                yield _parse(block, options, schema)
        conn.rollback()


def _parse(block: list[Any], options: tuple[Any, Any, Any], schema: pa.Schema) -> pa.RecordBatch:
    read, parse, convert = options
    table = pcsv.read_csv(
        pa.py_buffer(b"".join(block)),
        read_options=read,
        parse_options=parse,
        convert_options=convert,
    )
    return _to_batch(table, schema)
