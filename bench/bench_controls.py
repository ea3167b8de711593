"""Queue controls: what each costs, and that the plain path is unchanged.

    python -m bench.bench_controls                     # PostgreSQL, 3 rounds
    python -m bench.bench_controls --backends postgresql,mariadb --runs 5 --n 4000
    python -m bench.bench_controls --only plain        # also runs on a tree without controls

In process (label: the producer fills the table before the drain, the worker runs in this
process): a thread worker with 4 threads drains ``--n`` due messages in lease mode, the
handler does nothing, for each setting in turn, alternating settings within each round so
drift on a shared machine hits all of them:

- **plain**: no controls row (the path every queue took before controls existed);
- **limit 1000**: ``max_in_flight=1000``, a limit that never binds: the cost of the limited
  take (lock the controls row, count the leases running) alone;
- **in flight 3**: ``max_in_flight=3``, handlers of 2 ms: the rate under a binding limit, and
  the peak in flight seen by the handlers (never above 3);
- **rate 500/s**: ``rate=(500, 1 s)``: the achieved rate, and the most takes seen in any
  1-second window; once with takes of one message (the worker's default ``batch_size``), once
  with takes of 20 (limited takes serialise on the controls row, so fewer takes go faster);
- **priorities**: a queue with ``priorities=True`` and no boosted message (each take costs one
  more probe, which finds nothing), and with every tenth message boosted (priority 5);
- **steering** (with every setting): a busy worker (4 threads, 5 ms handlers, poll interval
  0.5 s) paused and then resumed by another process, as an operator would: the time from the
  pause's commit to the last handler start, and from the resume's commit to the first. On
  PostgreSQL ``NOTIFY`` carries the change at once; elsewhere a worker sees it within its poll
  interval.

It prints a table (median, min and max over the rounds) and ``--json`` writes the figures. No
timed assertion anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL
from sqlalchemy.orm import sessionmaker

from ._env import fresh_database, truncate

QUEUE = "controls"
SETTINGS = (
    "plain",
    "limit 1000",
    "in flight 3",
    "rate 500/s",
    "rate 500/s, takes of 20",
    "priorities",
    "priorities 10 % boosted",
)


def _limits(setting: str) -> dict[str, Any] | None:
    return {
        "plain": None,
        "limit 1000": {"max_in_flight": 1000},
        "in flight 3": {"max_in_flight": 3},
        "rate 500/s": {"rate": (500, timedelta(seconds=1))},
        "rate 500/s, takes of 20": {"rate": (500, timedelta(seconds=1))},
        "priorities": None,
        "priorities 10 % boosted": None,
    }[setting]


def _fill(sessions: Any, queue: Any, n: int, boosted: bool = False) -> None:
    """``n`` due messages; with ``boosted``, every tenth with priority 5."""
    now = datetime.now(UTC)
    for start in range(0, n, 5000):
        indexes = range(start, min(n, start + 5000))
        with sessions.begin() as s:
            queue.offer_batch(
                s, [(f"m{i}", {"i": i}, now) for i in indexes if not (boosted and i % 10 == 0)]
            )
            if boosted:
                boost = [(f"m{i}", {"i": i}, now) for i in indexes if i % 10 == 0]
                queue.offer_batch(s, boost, priority=5)


def drain(url: URL, setting: str, n: int) -> dict[str, float]:
    """One drain of ``n`` messages under ``setting``: rate, peak in flight, busiest second."""
    from sqla_delayedq import DelayedQueue, create_engine
    from sqla_delayedq.worker import Worker

    truncate(url)
    engine = create_engine(url, pool_size=8)
    sessions = sessionmaker(engine)
    prioritised = setting.startswith("priorities")
    queue: DelayedQueue[Any] = (
        DelayedQueue(QUEUE, priorities=True) if prioritised else DelayedQueue(QUEUE)
    )
    limits = _limits(setting)
    with sessions.begin() as s:
        if limits is not None:  # every limit given: none is kept from the setting before
            queue.set_limits(s, **{"max_in_flight": None, "rate": None, **limits})
        elif hasattr(queue, "set_limits"):  # a tree without controls runs "plain" too
            queue.set_limits(s, max_in_flight=None, rate=None)
    _fill(sessions, queue, n, boosted=setting.endswith("boosted"))
    lock = threading.Lock()
    state = {"running": 0, "peak": 0}
    takes: list[float] = []

    work = 0.002 if setting == "in flight 3" else 0.0  # long enough for handlers to overlap

    def handler(env: Any) -> None:
        with lock:
            state["running"] += 1
            state["peak"] = max(state["peak"], state["running"])
            takes.append(env.lease_until.timestamp())
        if work:
            time.sleep(work)
        with lock:
            state["running"] -= 1

    batch = 20 if setting.endswith("takes of 20") else 1
    worker = Worker(sessions, concurrency=4, poll_interval=0.05, listen=False, batch_size=batch)
    worker.register(queue, handler)
    started = time.perf_counter()
    worker.start()
    deadline = time.monotonic() + 600
    while len(takes) < n and time.monotonic() < deadline:
        time.sleep(0.002)
    took = time.perf_counter() - started
    worker.stop(5)
    engine.dispose()
    if len(takes) < n:
        raise RuntimeError(f"{setting}: only {len(takes)} of {n} handled")
    takes.sort()
    busiest, j = 0, 0
    for i, t in enumerate(takes):
        while j < len(takes) and takes[j] <= t + 1.0:
            j += 1
        busiest = max(busiest, j - i)
    return {"rate": n / took, "peak_in_flight": state["peak"], "busiest_second": busiest}


STEER = (
    "import sys, time\n"
    "from sqlalchemy.orm import Session\n"
    "from sqla_delayedq import DelayedQueue, create_engine\n"
    "engine = create_engine(sys.argv[1])\n"
    "with Session(engine) as s, s.begin():\n"
    "    getattr(DelayedQueue(sys.argv[2]), sys.argv[3])(s)\n"
    "print(time.time())\n"
)


def steer(url: URL, action: str) -> float:
    """``pause`` or ``resume`` the queue from another process; when its commit returned."""
    done = subprocess.run(
        [sys.executable, "-c", STEER, url.render_as_string(hide_password=False), QUEUE, action],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.strip())


def steering_latency(url: URL) -> dict[str, float]:
    """A busy worker (4 threads, 5 ms handlers, poll interval 0.5 s) paused and resumed from
    another process: seconds from the pause's commit to the last handler start, and from the
    resume's commit to the first."""
    from sqla_delayedq import DelayedQueue, create_engine
    from sqla_delayedq.worker import Worker

    truncate(url)
    engine = create_engine(url, pool_size=8)
    sessions = sessionmaker(engine)
    queue: DelayedQueue[Any] = DelayedQueue(QUEUE)
    with sessions.begin() as s:
        queue.set_limits(s, max_in_flight=None, rate=None)
    _fill(sessions, queue, 4000)
    starts: list[float] = []

    def handler(env: Any) -> None:
        starts.append(time.time())
        time.sleep(0.005)

    worker = Worker(sessions, concurrency=4, poll_interval=0.5)
    worker.register(queue, handler)
    worker.start()
    try:
        time.sleep(1.0)
        paused = steer(url, "pause")
        time.sleep(1.5)
        last = max(starts)
        seen = len(starts)
        resumed = steer(url, "resume")
        deadline = time.monotonic() + 10
        while len(starts) == seen and time.monotonic() < deadline:
            time.sleep(0.0005)
        if len(starts) == seen:
            raise RuntimeError("no message handled within 10 s of the resume")
        return {"pause": max(0.0, last - paused), "resume": starts[seen] - resumed}
    finally:
        worker.stop(5)
        engine.dispose()


def run(
    backends: list[str], settings: list[str], runs: int, n: int, resume: bool
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            per: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
            latencies: list[dict[str, float]] = []
            with fresh_database(backend, Path(tmp)) as url:
                for r in range(runs):
                    order = settings if r % 2 == 0 else list(reversed(settings))
                    for setting in order:
                        per[setting].append(drain(url, setting, n))
                    if resume:
                        latencies.append(steering_latency(url))
            results[backend] = {
                s: {k: _stats([m[k] for m in ms]) for k in ms[0]} for s, ms in per.items()
            }
            if latencies:
                results[backend]["steering"] = {
                    k: _stats([m[k] for m in latencies]) for k in ("pause", "resume")
                }
    return results


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _row(label: str, figures: dict[str, dict[str, float]], fmt: Callable[[str, float], str]) -> str:
    cells = [
        f"{fmt(k, v['median'])} ({fmt(k, v['min'])}–{fmt(k, v['max'])})" for k, v in figures.items()
    ]
    return f"| {label} | " + " | ".join(cells) + " |"


def report(results: dict[str, Any], n: int, runs: int) -> str:
    """The printed tables of :func:`run`'s results."""

    def fmt(key: str, value: float) -> str:
        return f"{value:,.0f}" if key != "seconds" else f"{value * 1000:.1f} ms"

    lines: list[str] = []
    for backend, figures in results.items():
        lines += [
            f"\nQueue controls, {backend}, in process, {n} messages per drain, {runs} rounds",
            "| setting | msg/s | peak in flight | busiest second |",
            "|---|---|---|---|",
        ]
        for setting, f in figures.items():
            if setting != "steering":
                lines.append(_row(setting, f, fmt))
        if "steering" in figures:
            lines.append("\nfrom another process (poll interval 0.5 s):")
            for what, label in (
                ("pause", "pause to last start"),
                ("resume", "resume to first start"),
            ):
                sec = figures["steering"][what]
                lines.append(
                    f"- {label}: {fmt('seconds', sec['median'])}"
                    f" (min {fmt('seconds', sec['min'])}, max {fmt('seconds', sec['max'])})"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="postgresql")
    parser.add_argument(
        "--only", default=";".join(SETTINGS), help="settings to run, separated by ';'"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--n", type=int, default=4000, help="messages per drain")
    parser.add_argument("--no-resume", action="store_true", help="skip the pause/resume latency")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    settings = [s.strip() for s in args.only.split(";") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    resume = not args.no_resume and settings == list(SETTINGS)
    results = run(args.backends.split(","), settings, args.runs, args.n, resume)
    print(report(results, args.n, args.runs))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
