"""Keep PostgreSQL's planner statistics of the queue tables from lagging a burst.

The take is an ordered index range scan only while the planner knows roughly how many rows the
table holds. After a queue drains, ``VACUUM``/``ANALYZE`` record an empty table; when a burst
arrives before autovacuum analyses again (it looks once a minute), the planner believes the
due range holds a handful of rows and reads it with a bitmap scan and a sort of every due row:
a take of ten messages from 100,000 costs 127 ms instead of under 1 ms, and a grouped take pays
that per probe. A worker therefore looks every :data:`INTERVAL` seconds at what the statistics
say against the live-row count PostgreSQL keeps anyway, and runs ``ANALYZE`` on a table the
planner underestimates by more than half (:func:`stale`). One catalog read per look, and an
``ANALYZE`` only on such a jump (after a drain, a burst; a backlog doubling), from one worker of
the fleet at a time, never on a table analysed in the last :data:`MIN_GAP` seconds.

A table this role may not analyse (it is not its owner) is left to autovacuum: said once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from sqlalchemy import Table, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ._dialects import is_transient

__all__ = ["INTERVAL", "MIN_GAP", "MIN_ROWS", "StatisticsKeeper", "stale"]

log = logging.getLogger("sqla_delayedq.worker")

#: Seconds between two looks at a table's statistics.
INTERVAL = 1.0
#: Below this many live rows any plan of the take is cheap: no ``ANALYZE``.
MIN_ROWS = 1000
#: A table analysed (by anyone) less than this many seconds ago is not analysed again.
MIN_GAP = 1.0

_LOOK = text(
    """
    SELECT c.reltuples,
           pg_stat_get_live_tuples(c.oid) AS live,
           extract(epoch FROM now() - greatest(pg_stat_get_last_analyze_time(c.oid),
                                               pg_stat_get_last_autoanalyze_time(c.oid))) AS ago,
           pg_has_role(c.relowner, 'USAGE') AS may
    FROM pg_class c
    WHERE c.oid = to_regclass(:name)
    """
)


def stale(reltuples: float, live: int, analysed_ago: float | None) -> bool:
    """Whether the planner's row count of a table is too far below the live rows to trust.

    ``reltuples`` is what the last ``VACUUM`` or ``ANALYZE`` recorded (-1: never), ``live`` the
    statistics collector's running count, ``analysed_ago`` seconds since the last analyse
    (None: never).
    """
    if live < MIN_ROWS or live <= 2 * max(reltuples, 0.0):
        return False
    return analysed_ago is None or analysed_ago >= MIN_GAP


class StatisticsKeeper:
    """A worker's periodic task (see module): ``keeper(sessions)`` looks at every table once."""

    def __init__(self, tables: Sequence[Table], quote: Callable[[Table], str]) -> None:
        self.names = sorted({quote(t) for t in tables})
        self._refused: set[str] = set()
        #: How many times this keeper analysed each table.
        self.analysed: dict[str, int] = {}

    def __call__(self, sessions: Callable[[], Session]) -> None:
        for name in self.names:
            if name in self._refused:
                continue
            try:
                with sessions() as session, session.begin():
                    self._look(session, name)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                # The database is away: the consumers report it; look again next time.
                log.debug("%s: statistics not read: %s", name, exc)
                return

    def _look(self, session: Session, name: str) -> None:
        row = session.execute(_LOOK, {"name": name}).first()
        if row is None:
            return  # not created yet: the consumers say so
        reltuples, live, ago, may = row
        if not stale(float(reltuples), int(live), None if ago is None else float(ago)):
            return
        if not may:
            self._refused.add(name)
            log.info(
                "%s: the planner's statistics lag the table (%d live rows, %d recorded) and "
                "this role may not ANALYZE it; autovacuum will, within autovacuum_naptime",
                name,
                live,
                max(reltuples, 0),
            )
            return
        # One worker of the fleet at a time; never wait behind autovacuum for long.
        key = f"sqla_delayedq analyze {name}"
        if not session.execute(
            text("SELECT pg_try_advisory_xact_lock(hashtext(:key))"), {"key": key}
        ).scalar():
            return
        session.execute(text("SET LOCAL lock_timeout = '1s'"))
        try:
            with session.begin_nested():
                session.execute(text(f"ANALYZE {name}"))
        except DBAPIError as exc:
            log.info("%s: ANALYZE skipped: %s", name, exc.orig)
            return
        self.analysed[name] = self.analysed.get(name, 0) + 1
        log.info(
            "%s: analysed, its statistics lagged a burst (%d live rows, %d recorded)",
            name,
            live,
            max(reltuples, 0),
        )
