"""The poll statement is an index range scan on PostgreSQL, never a table scan."""

from __future__ import annotations

from datetime import timedelta
from typing import cast

import sqlalchemy as sa

from sqla_delayedq import DelayedMessage
from sqla_delayedq import _statements as st

T = cast(sa.Table, DelayedMessage.__table__)


def explain(conn, stmt) -> str:
    compiled = stmt.compile(dialect=conn.dialect)
    rows = conn.exec_driver_sql("EXPLAIN " + compiled.string, compiled.params).scalars().all()
    return "\n".join(rows)


def test_poll_uses_the_due_index_with_10000_rows(pg, make_queue, clock):
    queues = [make_queue(f"q{i}") for i in range(5)]
    now = clock()
    with pg.Session() as s, s.begin():
        for q in queues:
            q.offer_batch(
                s, [(f"k{i}", {"i": i}, now + timedelta(seconds=i - 1000)) for i in range(2000)]
            )
    with pg.engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE delayed_queue")
        claim = st.claim_returning(T, "q3", now, now + timedelta(minutes=5), 1, "tok.")
        plan = explain(conn, claim)
        assert "ix_delayed_queue_due" in plan, plan
        assert "Seq Scan" not in plan, plan
        many = st.claim_returning(T, "q3", now, now + timedelta(minutes=5), 100, "tok.")
        plan = explain(conn, many)
        assert "ix_delayed_queue_due" in plan, plan
        assert "Seq Scan" not in plan, plan
