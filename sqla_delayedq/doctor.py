"""What keeps the database from cleaning up after a queue, and what to do about it.

A queue turns rows over fast: every message is inserted, updated when taken (lease mode) and
deleted. PostgreSQL reclaims the dead row versions with ``VACUUM``, but only those older than
the oldest snapshot still in use (the *xmin horizon*). One session left ``idle in transaction``
(a report, a forgotten ``BEGIN`` in a console), a replication slot whose consumer went away, or a
prepared transaction nobody committed pins that horizon: dead rows and index entries pile up and
every take walks more of them. MariaDB/MySQL have the same failure with InnoDB's purge and the
history list. ``docs/operations.md`` explains the failure and the remedies.

:func:`diagnose` reads, with ordinary catalog queries and no extension:

- the sessions, replication slots and prepared transactions holding the horizon, oldest first
  (PostgreSQL); the oldest open InnoDB transactions and the history list length (MariaDB/MySQL);
- each message table's live and dead rows, its heap and index sizes, and when autovacuum last
  ran and whether it is due (PostgreSQL);
- how far this host's clock is from the database server's (the queue decides by the
  application's clock: see ``docs/operations.md``);
- advice, one line per finding.

``delayedq doctor`` prints it; :class:`~sqla_delayedq.metrics.QueueStatsCollector` can export the
horizon's age as a metric. SQLite has no concurrent snapshots to pin: nothing to report there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, text

from . import _skew
from ._codec import check_strings
from ._engine import Family, family

__all__ = ["Diagnosis", "HorizonHolder", "TableHealth", "diagnose"]

#: A transaction older than this (seconds) is reported as holding the horizon.
DEFAULT_THRESHOLD = 60.0


@dataclass(frozen=True)
class HorizonHolder:
    """Something that keeps old row versions alive: a session, a slot, a prepared transaction."""

    kind: str
    #: Who it is: ``pid 4242`` for a session, the slot's name, the prepared transaction's gid.
    name: str
    #: How long its transaction (or the slot's lag) has been open, in seconds; None if unknown.
    age_seconds: float | None
    #: How many transactions the horizon is behind because of it (PostgreSQL), or None.
    xmin_age: int | None = None
    pid: int | None = None
    user: str | None = None
    application: str | None = None
    client: str | None = None
    state: str | None = None
    #: The session's last statement, shortened.
    query: str | None = None


@dataclass(frozen=True)
class TableHealth:
    """Dead rows and size of one message table (PostgreSQL statistics: estimates)."""

    table: str
    live_rows: int
    dead_rows: int
    table_bytes: int
    index_bytes: int
    last_autovacuum: datetime | None
    last_vacuum: datetime | None
    #: Dead rows at which autovacuum starts on this table (threshold + scale factor x rows).
    autovacuum_at: int
    #: Whether a VACUUM (auto or manual) is running on the table right now.
    vacuuming: bool

    @property
    def dead_ratio(self) -> float:
        total = self.live_rows + self.dead_rows
        return self.dead_rows / total if total else 0.0


@dataclass(frozen=True)
class Diagnosis:
    """What :func:`diagnose` found."""

    backend: str
    holders: list[HorizonHolder] = field(default_factory=list)
    tables: list[TableHealth] = field(default_factory=list)
    #: InnoDB's history list length (undo records purge has not removed), MariaDB/MySQL.
    history_length: int | None = None
    #: This host's clock minus the database server's, in seconds (None on SQLite).
    clock_skew_seconds: float | None = None
    advice: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.advice

    @property
    def horizon_age_seconds(self) -> float:
        """Age of the oldest holder at or above the threshold (0 when none)."""
        ages = [h.age_seconds for h in self.holders if h.age_seconds is not None]
        return max(ages, default=0.0)


def diagnose(
    conn: Connection, tables: Sequence[str], *, threshold: float = DEFAULT_THRESHOLD
) -> Diagnosis:
    """Diagnose the database behind ``conn`` for the message ``tables`` (names as in the
    database; a schema-qualified ``schema.table`` is accepted on PostgreSQL).

    ``threshold``: seconds a transaction must have been open to count as holding the horizon.
    """
    tables = check_strings(tables, "tables")
    kind = family(conn.dialect)
    if kind is Family.POSTGRESQL:
        return _postgresql(conn, tables, threshold)
    if kind is Family.MYSQL:
        return _mysql(conn, threshold)
    return Diagnosis("SQLite")


def _skew_seconds(conn: Connection) -> float:
    skew = _skew.measure(conn)
    assert skew is not None  # a server has a clock of its own
    return skew.total_seconds()


# -- PostgreSQL -----------------------------------------------------------------------------------

_PG_SESSIONS = text(
    """
    SELECT pid, usename, application_name, client_addr::text AS client, state,
           greatest(age(backend_xmin), age(backend_xid)) AS xmin_age,
           extract(epoch FROM now() - xact_start) AS xact_seconds,
           left(regexp_replace(query, '\\s+', ' ', 'g'), 200) AS query
    FROM pg_stat_activity
    WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) AND pid <> pg_backend_pid()
      AND xact_start < now() - make_interval(secs => :threshold)
      -- Another database's transactions hold back only shared catalogs (VACUUM of a table
      -- looks at its own database's); walsenders, of no database, hold every one.
      AND (datname = current_database() OR datid IS NULL OR datid = 0)
    ORDER BY 6 DESC
    LIMIT 10
    """
)
_PG_SLOTS = text(
    """
    SELECT slot_name, slot_type, active,
           greatest(age(xmin), age(catalog_xmin)) AS xmin_age
    FROM pg_replication_slots
    WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
    ORDER BY 4 DESC
    """
)
_PG_PREPARED = text(
    """
    SELECT gid, owner, age(transaction) AS xmin_age,
           extract(epoch FROM now() - prepared) AS seconds
    FROM pg_prepared_xacts
    WHERE prepared < now() - make_interval(secs => :threshold)
      AND database = current_database()
    ORDER BY prepared
    """
)
_PG_TABLE = text(
    """
    SELECT s.relname, s.n_live_tup, s.n_dead_tup,
           pg_relation_size(s.relid) AS table_bytes, pg_indexes_size(s.relid) AS index_bytes,
           s.last_autovacuum, s.last_vacuum,
           (current_setting('autovacuum_vacuum_threshold')::float8
            + current_setting('autovacuum_vacuum_scale_factor')::float8
              * greatest(c.reltuples, 0))::bigint AS autovacuum_at,
           EXISTS (SELECT 1 FROM pg_stat_progress_vacuum v WHERE v.relid = s.relid) AS vacuuming
    FROM pg_stat_all_tables s JOIN pg_class c ON c.oid = s.relid
    WHERE s.relid = to_regclass(:table)
    """
)


def _postgresql(conn: Connection, tables: Sequence[str], threshold: float) -> Diagnosis:
    found = Diagnosis("PostgreSQL", clock_skew_seconds=_skew_seconds(conn))
    params = {"threshold": threshold}
    for r in conn.execute(_PG_SESSIONS, params):
        found.holders.append(
            HorizonHolder(
                kind="session",
                name=f"pid {r.pid}",
                age_seconds=None if r.xact_seconds is None else float(r.xact_seconds),
                xmin_age=r.xmin_age,
                pid=r.pid,
                user=r.usename,
                application=r.application_name or None,
                client=r.client,
                state=r.state,
                query=r.query,
            )
        )
    for r in conn.execute(_PG_SLOTS):
        state = "active" if r.active else "inactive"
        found.holders.append(
            HorizonHolder(
                kind=f"{r.slot_type} replication slot",
                name=r.slot_name,
                age_seconds=None,
                xmin_age=r.xmin_age,
                state=state,
            )
        )
    for r in conn.execute(_PG_PREPARED, params):
        found.holders.append(
            HorizonHolder(
                kind="prepared transaction",
                name=r.gid,
                age_seconds=float(r.seconds),
                xmin_age=r.xmin_age,
                user=r.owner,
            )
        )
    quote = conn.dialect.identifier_preparer.quote_identifier
    for name in tables:
        # Quoted, as in the database: to_regclass folds an unquoted JobQueue to jobqueue.
        schema, dot, bare = name.partition(".")
        regclass = f"{quote(schema)}.{quote(bare)}" if dot else quote(name)
        row = conn.execute(_PG_TABLE, {"table": regclass}).first()
        if row is not None:
            found.tables.append(
                TableHealth(
                    table=name,
                    live_rows=int(row.n_live_tup),
                    dead_rows=int(row.n_dead_tup),
                    table_bytes=int(row.table_bytes),
                    index_bytes=int(row.index_bytes),
                    last_autovacuum=row.last_autovacuum,
                    last_vacuum=row.last_vacuum,
                    autovacuum_at=int(row.autovacuum_at),
                    vacuuming=bool(row.vacuuming),
                )
            )
    found.advice.extend(_advice(found, postgresql=True))
    return found


# -- MariaDB / MySQL ------------------------------------------------------------------------------

_INNODB_TRX = text(
    """
    SELECT t.trx_mysql_thread_id AS thread_id, t.trx_state,
           TIMESTAMPDIFF(MICROSECOND, t.trx_started, NOW(6)) / 1e6 AS seconds,
           p.USER AS user, p.HOST AS host, p.COMMAND AS command,
           LEFT(COALESCE(t.trx_query, p.INFO, ''), 200) AS query
    FROM information_schema.INNODB_TRX t
    LEFT JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id
    WHERE t.trx_mysql_thread_id <> CONNECTION_ID()
      AND t.trx_started < NOW(6) - INTERVAL :threshold SECOND
    ORDER BY t.trx_started
    LIMIT 10
    """
)
_HISTORY = text(
    "SELECT `COUNT` FROM information_schema.INNODB_METRICS WHERE NAME = 'trx_rseg_history_len'"
)


def _mysql(conn: Connection, threshold: float) -> Diagnosis:
    history = conn.execute(_HISTORY).scalar()
    found = Diagnosis(
        "MariaDB/MySQL",
        history_length=None if history is None else int(history),
        clock_skew_seconds=_skew_seconds(conn),
    )
    for r in conn.execute(_INNODB_TRX, {"threshold": threshold}):
        found.holders.append(
            HorizonHolder(
                kind="session",
                name=f"thread {r.thread_id}",
                age_seconds=float(r.seconds),
                pid=int(r.thread_id),
                user=r.user,
                client=r.host,
                state=r.command,
                query=r.query or None,
            )
        )
    found.advice.extend(_advice(found, postgresql=False))
    return found


# -- advice ---------------------------------------------------------------------------------------

#: A table whose dead rows outnumber this share of all rows is reported as bloated.
DEAD_SHARE = 0.5
#: ... once it has at least this many dead rows (a small table's ratio means little).
DEAD_MIN = 10_000


def _advice(found: Diagnosis, *, postgresql: bool) -> list[str]:
    lines = []
    for h in found.holders:
        if h.kind == "session":
            who = ", ".join(
                f"{label} {value}"
                for label, value in (
                    ("user", h.user),
                    ("application", h.application),
                    ("from", h.client),
                )
                if value
            )
            age = "" if h.age_seconds is None else f" for {_duration(h.age_seconds)}"
            stop = f"SELECT pg_terminate_backend({h.pid})" if postgresql else f"KILL {h.pid}"
            lines.append(
                f"{h.name} ({who or 'unknown client'}; {h.state or 'unknown state'}) has held a "
                f"transaction open{age}: the database cannot clean up rows deleted since. End "
                f"it in its application, or `{stop}`; "
                + (
                    "set idle_in_transaction_session_timeout so it cannot happen again."
                    if postgresql
                    else "keep reporting transactions short (or on a replica)."
                )
            )
        elif h.kind.endswith("replication slot"):
            if h.state == "inactive":
                lines.append(
                    f"replication slot {h.name!r} is inactive and holds the horizon "
                    f"{h.xmin_age} transactions back: drop it "
                    f"(SELECT pg_drop_replication_slot('{h.name}')) or reconnect its consumer."
                )
            elif h.xmin_age is not None and h.xmin_age > 1_000_000:
                lines.append(
                    f"replication slot {h.name!r} is {h.xmin_age} transactions behind: its "
                    "consumer (or hot_standby_feedback on a replica) pins the horizon."
                )
        else:
            lines.append(
                f"prepared transaction {h.name!r} has been waiting "
                f"{_duration(h.age_seconds or 0)}: COMMIT PREPARED or ROLLBACK PREPARED it."
            )
    for t in found.tables:
        if t.dead_rows >= DEAD_MIN and t.dead_ratio >= DEAD_SHARE:
            blocked = " (the holders above keep VACUUM from removing them)" if found.holders else ""
            lines.append(
                f"table {t.table} holds {t.dead_rows:,} dead rows for {t.live_rows:,} live "
                f"ones{blocked}; takes walk their index entries. Once nothing pins the horizon, "
                f"autovacuum removes them (it starts at {t.autovacuum_at:,} dead rows); "
                f"`VACUUM {t.table}` does it at once."
            )
    if found.history_length is not None and found.history_length > 1_000_000:
        lines.append(
            f"InnoDB's history list is {found.history_length:,} long: purge is behind, usually "
            "because of a long transaction; end it."
        )
    skew = found.clock_skew_seconds
    if skew is not None and abs(skew) > _skew.WARN_ABOVE:
        lines.append(
            f"this host's clock is {_skew.describe(timedelta(seconds=skew))} the database "
            "server's: messages run that much early or late, and a skew of half a lease lets "
            "workers run a message twice at the same time; keep the clocks in sync with NTP."
        )
    return lines


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def as_dict(found: Diagnosis) -> dict[str, Any]:
    """A JSON-ready form of a diagnosis (``delayedq doctor --json``)."""
    from dataclasses import asdict

    data = asdict(found)
    data["healthy"] = found.healthy
    data["horizon_age_seconds"] = found.horizon_age_seconds
    for t, health in zip(data["tables"], found.tables, strict=True):
        t["dead_ratio"] = round(health.dead_ratio, 4)
        for key in ("last_autovacuum", "last_vacuum"):
            value = t[key]
            t[key] = None if value is None else value.isoformat()
    return data
