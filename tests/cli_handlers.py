"""Handlers for the CLI tests' worker subprocesses (``delayedq worker tests.cli_handlers:...``).

Each writes what it did to the file named by ``$DELAYEDQ_TEST_OUT``, one line per event.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from sqla_delayedq import Envelope


def _note(text: str) -> None:
    with Path(os.environ["DELAYEDQ_TEST_OUT"]).open("a", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()


def slow(envelope: Envelope[Any]) -> None:
    """Sleeps ``payload["sleep"]`` seconds between a start and a done line."""
    _note(f"start {envelope.key}")
    time.sleep(float(envelope.payload.get("sleep", 2.0)))
    _note(f"done {envelope.key}")


def slow_transactional(envelope: Envelope[Any], session: Session) -> None:
    slow(envelope)


def failing(envelope: Envelope[Any]) -> None:
    _note(f"fail {envelope.key}")
    raise RuntimeError(f"cannot handle {envelope.key}")


not_callable = 42


async def async_handler(envelope: Envelope[Any]) -> None:
    """What the quick form must refuse: the thread worker would never await it."""
    _note(f"async {envelope.key}")


def with_pid(envelope: Envelope[Any], session: Session | None = None) -> None:
    """``start KEY PID``, ``payload["sleep"]`` seconds (0 by default), ``done KEY PID``."""
    pid = os.getpid()
    _note(f"start {envelope.key} {pid}")
    time.sleep(float(envelope.payload.get("sleep", 0)))
    _note(f"done {envelope.key} {pid}")


def timed(envelope: Envelope[Any]) -> None:
    """``start KEY PID T LEASE_UNTIL``, ``payload["sleep"]`` seconds, ``done KEY PID T``
    (T: ``time.time()``; the take's time is ``LEASE_UNTIL`` minus the lease)."""
    pid = os.getpid()
    _note(f"start {envelope.key} {pid} {time.time():.6f} {envelope.lease_until.timestamp():.6f}")
    time.sleep(float(envelope.payload.get("sleep", 0)))
    _note(f"done {envelope.key} {pid} {time.time():.6f}")


def timed_transactional(envelope: Envelope[Any], session: Session) -> None:
    timed(envelope)
