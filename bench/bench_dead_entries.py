"""Dead index entries a message leaves behind while the vacuum horizon is pinned (issue 19).

For each consumption mode (lease: take, then ack by token; transactional: ``process_one``) and
each form of the lock-token index (``full``, as before ``delayedq_0007``, and ``partial``, ``WHERE
lock_token IS NOT NULL``), in a fresh database: a session holds a ``REPEATABLE READ`` snapshot
open (so nothing the run deletes or updates can be vacuumed or marked dead in an index), ``--n``
messages are offered one per transaction and consumed one at a time, then every leaf page of
every index of the table is read with ``pageinspect`` and its heap pointers counted (a
deduplicated posting list counts each pointer it holds). Every entry beyond the table's live
rows is dead: the figure is entries per message, per index and in all.

Needs the ``pageinspect`` extension (PostgreSQL's contrib, which Debian's server package
includes) and a superuser, as the test database here has. Run from the repository root::

    .venv/bin/python -m bench.bench_dead_entries --n 2000
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from sqla_delayedq import DelayedQueue, create_engine

from ._env import fresh_database

MODES = ("lease", "transactional")
FORMS = ("full", "partial")


def index_entries(conn: sa.Connection, index: str) -> int:
    """Heap pointers in the leaf pages of ``index`` (a page's high key is not one)."""
    pages = conn.execute(sa.text("SELECT pg_relation_size(:i) / 8192"), {"i": index}).scalar_one()
    total = 0
    for page in range(1, pages):  # page 0 is the metapage
        kind, right = conn.execute(
            sa.text("SELECT type, btpo_next FROM bt_page_stats(:i, :p)"), {"i": index, "p": page}
        ).one()
        if kind != "l":
            continue
        first = 2 if right != 0 else 1  # item 1 of a page that is not the rightmost: high key
        total += conn.execute(
            sa.text(
                "SELECT coalesce(sum(coalesce(cardinality(tids), 1)), 0)"
                " FROM bt_page_items(:i, :p) WHERE itemoffset >= :first"
            ),
            {"i": index, "p": page, "first": first},
        ).scalar_one()
    return int(total)


def run(mode: str, form: str, n: int, tmp: Path) -> dict[str, float]:
    """Index entries per message after ``n`` messages went through ``mode``."""
    with fresh_database("postgresql", tmp) as url:
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pageinspect")
            if form == "full":
                conn.exec_driver_sql("DROP INDEX ix_delayed_queue_lock_token")
                conn.exec_driver_sql(
                    "CREATE INDEX ix_delayed_queue_lock_token ON delayed_queue (lock_token)"
                )
        pin = engine.connect()
        try:
            pin.exec_driver_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
            pin.exec_driver_sql("SELECT 1 FROM pg_class LIMIT 1").all()  # takes the snapshot
            sessions, queue = sessionmaker(engine), DelayedQueue[dict[str, int]]("q")
            for i in range(n):
                with sessions() as s, s.begin():
                    queue.offer(s, f"k{i}", {"i": i})
            consumed = 0
            while True:
                with sessions() as s, s.begin():
                    if mode == "transactional":
                        if queue.process_one(s, lambda env, session: None) is None:
                            break
                        consumed += 1
                        continue
                    envelope = queue.try_poll(s)
                if envelope is None:
                    break
                with sessions() as s, s.begin():
                    assert queue.ack(s, envelope)
                consumed += 1
            assert consumed == n, (consumed, n)
            with engine.connect() as conn:
                names = conn.exec_driver_sql(
                    "SELECT indexname FROM pg_indexes WHERE tablename = 'delayed_queue'"
                    " ORDER BY indexname"
                ).scalars()
                return {name: index_entries(conn, name) / n for name in names}
        finally:
            pin.rollback()
            pin.close()
            engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="messages per run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"index entries per message, {args.n} messages, horizon pinned (PostgreSQL)")
        for mode in MODES:
            for form in FORMS:
                per_index = run(mode, form, args.n, Path(tmp))
                detail = ", ".join(
                    f"{name.removeprefix('ix_delayed_queue_')} {value:.2f}"
                    for name, value in per_index.items()
                    if value
                )
                print(
                    f"{mode:<13} lock-token index {form:<7}: {sum(per_index.values()):.2f}"
                    f"  ({detail})"
                )


if __name__ == "__main__":
    main()
