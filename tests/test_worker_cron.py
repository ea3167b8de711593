"""The worker runs cron services: ticks are installed while it runs and handled by it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

from sqla_delayedq import CronConfig, CronService, DelayedQueue, PeriodicTick
from sqla_delayedq.worker import Worker


def test_a_worker_installs_and_handles_its_cron_ticks(backend):
    q: DelayedQueue[Any] = DelayedQueue("cron-in-worker")
    service = CronService(
        q,
        [CronConfig("heartbeat", PeriodicTick(timedelta(seconds=1)))],
        lookahead=timedelta(seconds=5),
    )
    handled: list[str] = []
    lock = threading.Lock()

    def handle(envelope: Any) -> None:
        with lock:
            handled.append(envelope.key)

    worker = Worker(backend.Session, concurrency=2, poll_interval=0.2, listen=False)
    worker.register(q, handle).add_cron(service, interval=timedelta(seconds=1))
    worker.start()
    try:
        deadline = time.monotonic() + 15
        while len(handled) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        assert worker.stop(5)
    assert len(handled) >= 3
    assert len(handled) == len(set(handled))  # each tick once
    assert all(key.startswith("heartbeat/") for key in handled)
