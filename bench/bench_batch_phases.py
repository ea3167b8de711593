"""Where a batch offer's time goes (E2's gap to the same-contract reference), PostgreSQL.

Interleaved on one fresh database, ``--rounds`` batches of ``--size`` new messages each:

- **ours**: ``offer_batch`` in a ``sessions.begin()`` block, split by cursor events into the
  client's work before the insert (checking and serialising the messages, building the
  column arrays), the insert statement's round trip, the client's work after it (reading back
  which keys were written, the outcomes) and the rest (the commit: the insert carries the wake-up);
- **our statement alone**: the same compiled insert sent through bare psycopg with its column
  arrays built beforehand: what the server and the wire cost;
- **reference**: the hand-written same-contract batch of ``bench.workloads.contract_e2``
  (one ``json.dumps`` and one insert-select that returns the keys written).

Each cell is the median per batch in milliseconds; CPU is this process's. In process, on
purpose: the question is which side of the wire the time is on.

    .venv/bin/python -m bench.bench_batch_phases --rounds 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import sessionmaker

from sqla_delayedq import DelayedQueue, create_engine
from sqla_delayedq import _statements as st
from sqla_delayedq.models import metadata

from ._env import fresh_database
from .workloads import INSERT_MANY, QUEUE, _libpq, payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_batch_phases", description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--size", type=int, default=1000)
    args = parser.parse_args(argv)
    import psycopg

    cells: dict[str, list[float]] = {}

    def add(name: str, ms: float) -> None:
        cells.setdefault(name, []).append(ms)

    with tempfile.TemporaryDirectory() as tmp, fresh_database("postgresql", Path(tmp)) as url:
        engine = create_engine(url)
        sessions = sessionmaker(engine)
        queue: DelayedQueue[Any] = DelayedQueue(QUEUE)
        with sessions.begin() as s:
            queue.offer_batch(s, [("warm-up", payload(-1))])
        marks: list[float] = []
        event.listen(engine, "before_cursor_execute", lambda *a: marks.append(time.perf_counter()))
        event.listen(engine, "after_cursor_execute", lambda *a: marks.append(time.perf_counter()))
        compiled = st.recordset_insert(metadata.tables["delayed_queue"]).compile(
            dialect=postgresql.psycopg.dialect()
        )
        ours_sql = str(compiled)
        raw = psycopg.connect(_libpq(url))
        for r in range(args.rounds):
            keys = range(r * args.size, (r + 1) * args.size)

            messages = [(f"o-{i}", payload(i)) for i in keys]
            marks.clear()
            cpu, started = time.process_time(), time.perf_counter()
            with sessions.begin() as s:
                queue.offer_batch(s, messages)
                returned = time.perf_counter()
            ended = time.perf_counter()
            insert_sent, insert_back = marks[0], marks[1]
            add("ours: total", (ended - started) * 1e3)
            add("ours: client CPU", (time.process_time() - cpu) * 1e3)
            add("ours: before the insert (client)", (insert_sent - started) * 1e3)
            add("ours: the insert's round trip", (insert_back - insert_sent) * 1e3)
            add("ours: after the insert (client)", (returned - insert_back) * 1e3)
            add("ours: commit", (ended - returned) * 1e3)

            now = datetime.now(UTC)
            params = {"u_queue": QUEUE, "u_type": "json", "u_now": now}
            params |= {f"u_{name}": None for name in st.RECORDSET_COLUMNS}
            params["u_k"] = json.dumps([f"s-{i}" for i in keys])
            params["u_p"] = json.dumps([payload(i) for i in keys])
            params |= {k: v for k, v in compiled.params.items() if k not in params}
            started = time.perf_counter()
            with raw.transaction():
                raw.execute(ours_sql, params).fetchall()
            add("our statement alone (bare psycopg)", (time.perf_counter() - started) * 1e3)

            cpu, started = time.process_time(), time.perf_counter()
            now = datetime.now(UTC)
            doc = json.dumps([{"k": f"r-{i}", "p": payload(i)} for i in keys])
            with raw.transaction():
                written = raw.execute(INSERT_MANY, (QUEUE, now, now, now, doc)).fetchall()
            add("reference: total", (time.perf_counter() - started) * 1e3)
            add("reference: client CPU", (time.process_time() - cpu) * 1e3)
            if len(written) != args.size:
                raise RuntimeError(f"the reference wrote {len(written)} of {args.size}")
        raw.close()
        engine.dispose()
    print(f"Batches of {args.size} new messages, {args.rounds} rounds interleaved, in process")
    print("| per batch | median ms |")
    print("|---|---|")
    for name, values in cells.items():
        print(f"| {name} | {statistics.median(values):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
