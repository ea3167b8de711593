"""Queue controls across processes: ``delayedq worker -p 4 -c 4`` (4 processes x 4 threads) on
PostgreSQL and MariaDB, as a deployment runs it. The handlers write when they started and
finished (``tests.cli_handlers:timed``); the tests check the limits on those records."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from sqla_delayedq import DelayedQueue
from tests import test_worker_processes as processes
from tests.test_worker_processes import QUEUE, offer, started_workers

supervise = processes.supervise  # the fixture: a ``delayedq worker -p N`` subprocess

LEASE = 60.0


def workers(*extra: str, mode: str = "lease") -> list[str]:
    return [
        "tests.cli_handlers:timed" if mode == "lease" else "tests.cli_handlers:timed_transactional",
        "--mode",
        mode,
        "-q",
        QUEUE,
        "-p",
        "4",
        "-c",
        "4",
        "--poll-interval",
        "0.2",
        "--lease",
        str(int(LEASE)),
        *extra,
    ]


def set_limits(backend: Any, **limits: Any) -> None:
    with backend.Session() as s, s.begin():
        DelayedQueue[Any](QUEUE).set_limits(s, **limits)


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_a_global_in_flight_limit_holds_across_4_processes_of_4_threads(
    server_backend, supervise, mode
):
    set_limits(server_backend, max_in_flight=3)
    run = supervise(server_backend, *workers(mode=mode))
    run.wait(started_workers(run, 4), "four worker processes consuming")
    keys = offer(server_backend, 150, sleep=0.02)
    run.wait(lambda: len(run.lines("done")) >= len(keys), "every message handled", timeout=120)
    assert run.stop() == 0, run.text()
    assert Counter(line[1] for line in run.lines("done")) == Counter(keys)  # each once
    events = [(float(line[3]), 1) for line in run.lines("start")]
    events += [(float(line[3]), -1) for line in run.lines("done")]
    in_flight, peak = 0, 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # a finish before a start
        in_flight += step
        peak = max(peak, in_flight)
    assert peak <= 3, peak
    assert peak == 3  # the limit, not one process, was what held them back
    assert len({line[2] for line in run.lines("start")}) > 1


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_a_global_rate_limit_holds_in_every_one_second_window(server_backend, supervise, mode):
    set_limits(server_backend, rate=(50, 1.0))
    run = supervise(server_backend, *workers(mode=mode))
    run.wait(started_workers(run, 4), "four worker processes consuming")
    keys = offer(server_backend, 250)
    started = time.monotonic()
    run.wait(lambda: len(run.lines("done")) >= len(keys), "every message handled", timeout=120)
    took = time.monotonic() - started
    assert run.stop() == 0, run.text()
    assert Counter(line[1] for line in run.lines("done")) == Counter(keys)
    takes = sorted(float(line[4]) - LEASE for line in run.lines("start"))
    # Every closed 1-second window that starts at a take holds at most 50 takes.
    j = 0
    for i, t in enumerate(takes):
        while j < len(takes) and takes[j] <= t + 1.0:
            j += 1
        assert j - i <= 50, (t, j - i)
    assert took >= 4.0  # 250 at 50 a second: the limit held them back
    assert len({line[2] for line in run.lines("start")}) > 1


def test_pause_and_resume_reach_every_process(server_backend, supervise):
    run = supervise(server_backend, *workers())
    run.wait(started_workers(run, 4), "four worker processes consuming")
    q: DelayedQueue[Any] = DelayedQueue(QUEUE)
    with server_backend.Session() as s, s.begin():
        q.pause(s)
    paused = time.time()
    # Workers re-read the controls at least every poll interval (0.2 s here); ten of them is
    # room for four loaded processes to have seen the pause (bench_controls times it).
    time.sleep(2.0)
    keys = offer(server_backend, 40)
    time.sleep(1.0)
    assert run.lines("start") == []
    with server_backend.Session() as s, s.begin():
        q.resume(s)
    resumed = time.time()
    run.wait(lambda: len(run.lines("done")) >= len(keys), "every message handled", timeout=60)
    assert run.stop() == 0, run.text()
    first = min(float(line[3]) for line in run.lines("start"))
    assert first > paused
    # A poll interval (0.2 s) and a take, timed by bench_controls; the bound only tells a
    # worker that re-reads the controls from one that waits for its 30 s re-check.
    assert first - resumed < 5.0
