"""PostgreSQL ``LISTEN`` for idle workers, on a connection of its own.

A notification only wakes pollers early; polling stays authoritative. The listener reconnects
with backoff when its connection drops, and wakes everyone after reconnecting in case
notifications were lost meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine

log = logging.getLogger("sqla_delayedq.listener")


class PgListener:
    """A daemon thread that ``LISTEN``s on channels and calls ``wake(queue)`` per notification."""

    def __init__(self, engine: Engine, channels: list[str], wake: Callable[[str | None], None]):
        self.engine = engine
        self.channels = sorted(set(channels))
        self.wake = wake
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delayedq-listen", daemon=True)
        self._conn: Any = None
        self.connected = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _connect(self) -> Any:
        import psycopg

        url = self.engine.url.set(drivername="postgresql")
        conninfo = url.render_as_string(hide_password=False)
        conn = psycopg.connect(conninfo, autocommit=True)
        for channel in self.channels:
            conn.execute(f'LISTEN "{channel}"')
        return conn

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                conn = self._conn = self._connect()
            except Exception as exc:
                log.warning("LISTEN connection failed (%s); polling covers meanwhile", exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            self.connected.set()
            self.wake(None)  # anything sent while we were away
            try:
                while not self._stop.is_set():
                    for note in conn.notifies(timeout=0.5):
                        self.wake(note.payload or None)
            except Exception as exc:
                if not self._stop.is_set():
                    log.warning("LISTEN connection lost (%s); reconnecting", exc)
            finally:
                self.connected.clear()
                try:
                    conn.close()
                except Exception:
                    log.debug("closing the LISTEN connection failed", exc_info=True)
            if not self._stop.is_set():
                time.sleep(0.05)
