"""The poll statement is an index range scan on PostgreSQL, never a table scan."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import cast

import sqlalchemy as sa

from sqla_delayedq import DelayedMessage, DelayedQueue
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


def test_in_flight_count_reads_only_leased_rows(pg, make_queue, clock):
    """A limited queue's take counts unexpired leases: on ``ix_delayed_queue_lock_token``, which
    holds only leased rows (``delayedq_0007``), or on the due index past ``now`` (a lease is
    the row's due time); either way the 10,000 due rows are not read."""
    q = make_queue("q")
    now = clock()
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(f"k{i}", {}, now - timedelta(seconds=i)) for i in range(10_000)])
    with pg.Session() as s, s.begin():
        assert len(q.try_poll_many(s, 50)) == 50
    with pg.engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE delayed_queue")
        indexdef = conn.exec_driver_sql(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_delayed_queue_lock_token'"
        ).scalar_one()
        assert indexdef.endswith("WHERE (lock_token IS NOT NULL)"), indexdef
        entries = conn.exec_driver_sql(
            "SELECT reltuples FROM pg_class WHERE relname = 'ix_delayed_queue_lock_token'"
        ).scalar_one()
        assert entries == 50
        plan = explain(conn, st.in_flight(st.message_shape(T), "q", now, False))
        assert "Seq Scan" not in plan, plan
        if "ix_delayed_queue_lock_token" not in plan:
            assert "ix_delayed_queue_due" in plan, plan
            assert re.search(r"Index Cond: .*scheduled_at > ", plan), plan


# -- the look-up of the picked rows does not depend on statistics (issue 19) -----------------


def outer_scans(plan: str) -> list[str]:
    """The scan nodes of the statement's own relation (the pick's copy is ``delayed_queue_1``)."""
    return [
        line.strip().removeprefix("->  ")
        for line in plan.splitlines()
        if re.search(r"Scan.* on delayed_queue\s+\(", line)
    ]


def take_plans(conn, now) -> dict[str, str]:
    until = now + timedelta(minutes=5)
    return {
        f"{name} limit {limit}": explain(conn, stmt)
        for limit in (1, 100)
        for name, stmt in (
            ("claim", st.claim_returning(T, "q", now, until, limit, "tok.")),
            ("consume", st.consume_returning(T, "q", now, limit, True)),
            ("consume ahead", st.consume_returning(T, "q", now, limit, True, ahead=True)),
        )
    }


def ahead_scans(plan: str) -> list[str]:
    """The scan nodes of a transactional take's look-ahead (``next_pending``, alias ``ahead``)."""
    return [
        line.strip().removeprefix("->  ")
        for line in plan.splitlines()
        if re.search(r"Scan.* on delayed_queue ahead\s+\(", line)
    ]


def assert_look_ahead_probes_the_due_index(plans: dict[str, str], *, bloated: bool) -> None:
    """One look-ahead probe, in the transactional take only; on a bloated table (where a wrong
    index would read the dead rows) a probe of the due index. On an analysed empty table the
    planner may read any index of the queue: there is nothing in it to read."""
    for name, plan in plans.items():
        scans = ahead_scans(plan)
        if "ahead" not in name:
            assert not scans, plan
            continue
        assert len(scans) == 1, plan
        if bloated:
            assert re.match(r"Index (Only )?Scan using ix_delayed_queue_due", scans[0]), plan


def insert_rows(conn, prefix: str, n: int) -> None:
    conn.exec_driver_sql(
        "INSERT INTO delayed_queue (queue, key, payload_type, payload, status, scheduled_at,"
        " scheduled_at_initially, created_at, attempts) SELECT 'q', %(p)s || g, 'json', '{}',"
        " 'pending', now() - interval '1 hour', now(), now(), 0 FROM generate_series(1, %(n)s) g",
        {"p": prefix, "n": n},
    )


def pages(conn) -> int:
    return conn.exec_driver_sql("SELECT pg_relation_size('delayed_queue') / 8192").scalar_one()


def assert_picked_rows_found_by_tid(plans: dict[str, str], table_pages: int) -> None:
    for name, plan in plans.items():
        scans = outer_scans(plan)
        assert scans, plan
        for scan in scans:
            # A TID scan; a sequential scan only of a table of a page or two (cheaper than TIDs).
            assert scan.startswith("Tid Scan") or (
                scan.startswith("Seq Scan") and table_pages <= 2
            ), f"{name}: {scan}\n{plan}"


def test_take_finds_picked_rows_by_tid_on_an_analysed_empty_table(pg, clock):
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE delayed_queue")
    with pg.engine.connect() as conn:
        plans = take_plans(conn, clock())
        assert_picked_rows_found_by_tid(plans, pages(conn))
        assert_look_ahead_probes_the_due_index(plans, bloated=False)


def test_take_finds_picked_rows_by_tid_on_a_bloated_table_analysed_when_nearly_empty(pg, clock):
    """Statistics say three rows; the heap and indexes hold 100,000 dead ones (a pinned horizon)."""
    with pg.engine.begin() as conn:
        insert_rows(conn, "live/", 3)
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE delayed_queue")
    with pg.engine.begin() as conn:
        insert_rows(conn, "dead/", 100_000)
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM delayed_queue WHERE key LIKE 'dead/%%'")
    with pg.engine.connect() as conn:
        table_pages = pages(conn)
        assert table_pages > 100
        plans = take_plans(conn, clock())
        assert_picked_rows_found_by_tid(plans, table_pages)
        assert all("Tid Scan" in plan for plan in plans.values()), plans
        assert_look_ahead_probes_the_due_index(plans, bloated=True)


def test_take_finds_picked_rows_by_tid_on_a_bloated_table_analysed_after(pg, clock):
    with pg.engine.begin() as conn:
        insert_rows(conn, "k/", 50_000)
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM delayed_queue WHERE key NOT LIKE 'k/1%%'")
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE delayed_queue")
    with pg.engine.connect() as conn:
        plans = take_plans(conn, clock())
        assert_picked_rows_found_by_tid(plans, pages(conn))
        assert_look_ahead_probes_the_due_index(plans, bloated=True)


# -- a queue with groups: the pick stays on the due index, the head probe on the group index -----


def test_a_grouped_take_probes_the_group_index_with_10000_rows(pg, clock):
    now = clock()
    q = DelayedQueue[dict]("orders", groups=True)
    with pg.Session() as s, s.begin():
        q.offer_batch(
            s,
            [
                (f"o{g}/{i}", {"i": i}, now - timedelta(seconds=1000 - i), f"o{g}")
                for g in range(500)
                for i in range(20)
            ],
        )
        DelayedQueue[dict]("plain").offer_batch(s, [(f"p{i}", {}) for i in range(2000)])
    with pg.engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE delayed_queue")
        until = now + timedelta(minutes=5)
        for grouping in ("dead_skips", "dead_blocks"):
            for stmt in (
                st.claim_returning(T, "orders", now, until, 10, "tok.", grouping),
                st.consume_returning(T, "orders", now, 10, True, grouping),
            ):
                plan = explain(conn, stmt)
                assert "ix_delayed_queue_due" in plan, plan
                assert "ix_delayed_queue_group" in plan, plan
                assert "Seq Scan" not in plan, plan


# -- a queue with priorities: the boosted probe reads the priority index, in its order -----------


def test_the_boosted_probe_is_a_range_scan_of_the_priority_index(pg, clock):
    now = clock()
    q = DelayedQueue[dict]("jobs", priorities=True)
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(f"low{i}", {}, now - timedelta(seconds=i)) for i in range(5000)])
        for level in (1, 5, 9):
            q.offer_batch(
                s,
                [(f"p{level}/{i}", {}, now - timedelta(seconds=i)) for i in range(100)],
                priority=level,
            )
        q.offer_batch(s, [(f"later{i}", {}, now + timedelta(hours=1)) for i in range(2000)])
    with pg.engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE delayed_queue")
        until = now + timedelta(minutes=5)
        for stmt in (
            st.claim_returning(T, "jobs", now, until, 10, "tok.", None, True),
            st.consume_returning(T, "jobs", now, 10, True, None, True),
        ):
            plan = explain(conn, stmt)
            lines = plan.splitlines()
            (scan,) = [i for i, line in enumerate(lines) if "ix_delayed_queue_priority" in line]
            # Locked straight from the index scan, in its order: no sort of the boosted rows.
            assert "Index Scan using" in lines[scan] and "LockRows" in lines[scan - 1], plan
            assert "Seq Scan" not in plan, plan


def test_the_group_probe_reads_the_group_index_on_a_table_analysed_when_empty(pg, clock):
    """Statistics that say the table is empty (a new deployment) must not send the head probe
    through the due index, which would read the whole queue for every candidate."""
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE delayed_queue")
    now = clock()
    q = DelayedQueue[dict]("orders", groups=True)
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(f"o{g}/{i}", {}, now, f"o{g}") for g in range(200) for i in range(20)])
    with pg.engine.connect() as conn:
        until = now + timedelta(minutes=5)
        for stmt in (
            st.claim_returning(T, "orders", now, until, 1, "tok.", "dead_skips"),
            st.consume_returning(T, "orders", now, 1, True, "dead_blocks"),
        ):
            plan = explain(conn, stmt)
            probe = plan.split("SubPlan 1\n")[1]
            assert "ix_delayed_queue_group" in probe, plan
            assert "ix_delayed_queue_due" not in probe, plan
