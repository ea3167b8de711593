"""Clock skew: how far this host's clock is from the database server's.

The queue decides by the application's clock (each queue's ``clock``), not the database's: due
times are written by the producers' clocks, leases by the workers'. A worker whose host clock is
fast takes messages before they are due and sees other workers' leases as run out while their
handlers still run: it runs those messages beside them, and counts a lost attempt. A slow one
delays every due message, and its own leases end early in the others' eyes. Workers measure the
skew at start and every few minutes (:class:`SkewCheck`); ``delayedq doctor`` reports it.

Only queues on the default clock (:func:`~sqla_delayedq._time.system_clock`) are checked: an
injected clock is the caller's own time (a test's manual clock stands far from the database's on
purpose). SQLite runs in this process, on this host's clock: nothing to check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from ._dialects import is_transient, strategy_for, strategy_for_bind
from ._time import Clock, system_clock

__all__ = ["CHECK_EVERY", "WARN_ABOVE", "SkewCheck", "checked", "describe", "measure"]

log = logging.getLogger("sqla_delayedq.worker")

#: A skew above this (seconds) is logged as a WARNING; at least half a lease, as an ERROR.
WARN_ABOVE = 1.0
#: How often a worker measures the skew again (seconds).
CHECK_EVERY = 300.0


def checked(source: Any) -> bool:
    """Whether a worker checks the clock of this queue: the default system clock only."""
    return getattr(source, "clock", None) is system_clock


def measure(db: Session | Connection, clock: Clock | None = None) -> timedelta | None:
    """``clock`` (the system clock when None) minus the database server's clock (None on
    SQLite), read at the midpoint of the round trip so that network delay is not counted as
    skew; the better of two reads, as the first may pay for connecting."""
    clock = clock or system_clock
    strategy = strategy_for(db) if isinstance(db, Session) else strategy_for_bind(db)
    best: tuple[timedelta, timedelta] | None = None
    for _ in range(2):
        before = clock()
        server = strategy.server_now(db)
        after = clock()
        if server is None:
            return None
        trip = after - before
        if best is None or trip < best[0]:
            best = (trip, before + trip / 2 - server)
    assert best is not None
    return best[1]


def describe(skew: timedelta) -> str:
    """``"12.3 s ahead of"`` or ``"0.2 s behind"`` (the database server's clock)."""
    seconds = skew.total_seconds()
    return f"{abs(seconds):.1f} s {'ahead of' if seconds > 0 else 'behind'}"


class SkewCheck:
    """A worker's periodic task: ``check(sessions)`` measures the skew of the queues' clock and
    logs what it risks: a WARNING above :data:`WARN_ABOVE`, an ERROR from half a lease up."""

    def __init__(self, worker: str, clock: Clock, leases: Sequence[tuple[str, timedelta]]) -> None:
        self.worker = worker
        self.clock = clock
        self.leases = leases
        #: The last skew measured (None: not yet, or SQLite).
        self.skew: timedelta | None = None

    def __call__(self, sessions: Callable[[], Session]) -> None:
        try:
            with sessions() as session:
                self.skew = skew = measure(session, self.clock)
        except Exception as exc:
            if not is_transient(exc):
                raise
            log.debug("%s: clock skew not measured: %s", self.worker, exc)  # consumers report it
            return
        if skew is None:
            return
        log.debug("%s: this host's clock is %s the database server's", self.worker, describe(skew))
        short = sorted({name for name, lease in self.leases if abs(skew) * 2 >= lease})
        if short:
            log.error(
                "%s: this host's clock is %s the database server's, at least half the lease of "
                "%s: a message may run twice at the same time (a worker takes it while another "
                "one's handler still runs, and counts a lost attempt). Synchronise this host's "
                "clock with NTP (chrony, systemd-timesyncd), or lengthen the lease",
                self.worker,
                describe(skew),
                ", ".join(short),
            )
        elif abs(skew.total_seconds()) > WARN_ABOVE:
            log.warning(
                "%s: this host's clock is %s the database server's: messages run that much %s "
                "and leases are judged that much off; keep the clocks in sync with NTP",
                self.worker,
                describe(skew),
                "early" if skew > timedelta(0) else "late",
            )
