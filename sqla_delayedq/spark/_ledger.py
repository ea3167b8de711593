"""Exact counts on PostgreSQL: every write transaction tells the driver what it did, on commit.

Spark reports one result per partition, from the attempt that finished first. Another attempt
of the same partition (a retry after a partial commit, a speculative copy that committed and
then stalled, a task whose result was lost) may have committed rows too, and the reporting
attempt then finds them already there. Counting what the reporting attempt saw would move those
rows from ``created`` to ``ignored``.

So each transaction of an ``offer_dataframe`` call sends, before it commits, one ``NOTIFY`` on
a channel of that call with what it created and updated. PostgreSQL delivers a notification
only if its transaction commits, and in commit order, so the driver, listening from before the
job starts, hears exactly the committed transactions of every attempt. When the job is done it
sends a notification of its own and waits for it: everything committed before it has then
arrived. The sum is exact whichever attempts ran; if the listener fails, the counts fall back
to the reporting attempts and say they are approximate.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql
from sqlalchemy.engine import URL

from ._common import ConnectionFactory, driver_pg_connection

log = logging.getLogger("sqla_delayedq.spark")

#: How long the driver waits for its own closing notification before giving up on the ledger.
SETTLE_SECONDS = 30.0
_POLL_SECONDS = 0.05


def new_channel() -> str:
    """A channel name of its own for one call (an identifier under 63 bytes)."""
    return f"sqla_delayedq_spark_{secrets.token_hex(12)}"


def entry(channel: str) -> sql.Composed:
    """The statement a write transaction runs before it commits: ``(created, updated)``."""
    return sql.SQL("SELECT pg_notify({}, %s::text || ' ' || %s::text)").format(sql.Literal(channel))


@dataclass
class Ledger:
    """The driver's listener on one call's channel."""

    channel: str
    conn: Any
    created: int = 0
    updated: int = 0
    transactions: int = 0
    _end: str = field(default_factory=lambda: f"end {secrets.token_hex(8)}")
    _ended: bool = False
    _broken: str | None = None

    @classmethod
    def open(cls, url: str | URL, factory: ConnectionFactory | None) -> Ledger | None:
        """Listen on a new channel; ``None`` (counts approximate) if that is not possible."""
        try:
            conn = driver_pg_connection(url, factory)
        except Exception as exc:
            log.warning("no exact counts for this offer_dataframe call: %s", exc)
            return None
        try:
            conn.autocommit = True
            ledger = cls(new_channel(), conn)
            conn.add_notify_handler(ledger._heard)
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(ledger.channel)))
        except Exception as exc:
            log.warning("no exact counts for this offer_dataframe call: %s", exc)
            conn.close()
            return None
        return ledger

    def _heard(self, notify: Any) -> None:
        if notify.channel != self.channel or self._ended:
            return  # a transaction that commits after the call returned changes nothing here
        if notify.payload == self._end:
            self._ended = True
            return
        try:
            created, updated = (int(v) for v in notify.payload.split())
        except ValueError:
            self._broken = f"unexpected notification {notify.payload!r}"
            return
        self.created += created
        self.updated += updated
        self.transactions += 1

    def settle(self, timeout: float = SETTLE_SECONDS) -> tuple[int, int] | None:
        """(created, updated) over every committed transaction so far; None if unknown."""
        try:
            self.conn.execute("SELECT pg_notify(%s, %s)", (self.channel, self._end))
            deadline = time.monotonic() + timeout
            while not self._ended and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
                self.conn.execute("SELECT 1")  # reads the notifications that have arrived
        except Exception as exc:
            log.warning("counts of this offer_dataframe call are approximate: %s", exc)
            return None
        if not self._ended or self._broken:
            log.warning(
                "counts of this offer_dataframe call are approximate: %s",
                self._broken or f"the ledger did not settle within {timeout:.0f} s",
            )
            return None
        return self.created, self.updated

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken connection
            self.conn.close()
