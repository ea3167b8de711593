"""The poll statement is an index range scan on PostgreSQL, never a table scan."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import cast

import psycopg.sql
import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import asyncpg

from sqla_delayedq import DelayedMessage, DelayedQueue
from sqla_delayedq import _statements as st
from sqla_delayedq._cli_stats import bounded_stats_stmt
from sqla_delayedq._dialects import MariaDBStrategy, PostgreSQLStrategy

T = cast(sa.Table, DelayedMessage.__table__)


def explain(conn, stmt, params=None) -> str:
    # The take's limit is written into the text at execution (st.P.limit): expand it here too.
    state = stmt.compile(dialect=conn.dialect).construct_expanded_state(params)
    rows = conn.exec_driver_sql("EXPLAIN " + state.statement, state.parameters).scalars().all()
    return "\n".join(rows)


def fill_five_queues(pg, make_queue, clock) -> datetime:
    """10,000 due rows: 2,000 in each of the queues q0 to q4. Returns the clock's time."""
    now = clock()
    with pg.Session() as s, s.begin():
        for n in range(5):
            make_queue(f"q{n}").offer_batch(
                s, [(f"k{i}", {"i": i}, now + timedelta(seconds=i - 1000)) for i in range(2000)]
            )
    return now


def test_poll_uses_the_due_index_with_10000_rows(pg, make_queue, clock):
    now = fill_five_queues(pg, make_queue, clock)
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


def test_the_ack_that_takes_the_next_uses_an_index_look_up_and_the_due_index(pg, make_queue, clock):
    """The lease-mode statement that acknowledges and takes (``ack_and_claim``): the pick is a
    range scan of the due index, the acknowledgement an index look-up (by id or by lock token),
    with 10,000 rows."""
    now = fill_five_queues(pg, make_queue, clock)
    for done in (False, True):
        params = {
            **st.P.take("q3", now, now + timedelta(minutes=5), 1, "tok."),
            "s_id": 17,
            "s_token": "tok.17",
            **({"s_now": now} if done else {}),
        }
        with pg.engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE delayed_queue")
            plan = explain(conn, st.ack_and_claim(T, done, 1), params)
        assert "ix_delayed_queue_due" in plan, plan
        acked = r"CTE acked\n\s+->  (Delete|Update) on delayed_queue.*\n\s+->  Index Scan using "
        assert re.search(acked + r"(delayed_queue_pkey|ix_delayed_queue_lock_token)", plan), plan
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


def outer_scans(plan: str, name: str = "delayed_queue") -> list[str]:
    """The scan nodes of the statement's own relation (the pick's copy is ``delayed_queue_1``)."""
    return [
        line.strip().removeprefix("->  ")
        for line in plan.splitlines()
        if re.search(rf"Scan.* on {name}\s+\(", line)
    ]


def take_plans(conn, now) -> dict[str, str]:
    """The takes' plans for their values, and the plans PostgreSQL runs once they are prepared
    (as a worker's are; see ``test_a_worker_s_takes_run_generic_plans``)."""
    until = now + timedelta(minutes=5)
    return {
        f"{name} limit {limit}{' prepared' if prepared else ''}": (
            explain_prepared if prepared else explain
        )(conn, stmt, fused(now, until, limit))
        for limit in (1, 100)
        for name, stmt in (
            ("claim", st.claim_returning(T, "q", now, until, limit, "tok.")),
            ("consume", st.consume_returning(T, "q", now, limit, True)),
            ("consume ahead", st.consume_returning(T, "q", now, limit, True, ahead=True)),
            ("ack and claim", st.ack_and_claim(T, False, limit)),
        )
        for prepared in (False, True)
    }


def fused(now: datetime, until: datetime, limit: int) -> dict:
    """The values of a fused acknowledgement and take (``st.ack_and_claim``)."""
    return {**st.P.take("q", now, until, limit, "tok."), "s_id": 1, "s_token": "tok.1"}


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
    planner may read any index of the queue: there is nothing in it to read.

    A prepared statement's plan, made for any values, may read that range of the due index
    through a bitmap where the statistics say the queue holds a row or two (a bitmap reads the
    whole range, where the ordered scan stops at its first row; the plans made for the values
    read the queue through a bitmap of some index in that case too, until the next ``ANALYZE``).
    """
    for name, plan in plans.items():
        scans = ahead_scans(plan)
        if "ahead" not in name:
            assert not scans, plan
            continue
        assert len(scans) == 1, plan
        if bloated and "prepared" in name:
            assert re.search(r"ix_delayed_queue_due", subplan(plan, "ahead")), plan
        elif bloated:
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
        if name.startswith("ack and claim"):
            # The acknowledgement's scan (a look-up by id or by lock token); then the take's
            # update, the statement's third copy of the table.
            # On a table of a page or two the planner may read it any way: nothing to read.
            (acked,) = scans
            assert table_pages <= 2 or re.match(
                r"Index Scan using (delayed_queue_pkey|ix_delayed_queue_lock_token)", acked
            ), f"{name}: {acked}\n{plan}"
            scans = outer_scans(plan, "delayed_queue delayed_queue_2")
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
        hold = PostgreSQLStrategy(conn.dialect).group_hold(True)
        for grouping in ("dead_skips", "dead_blocks"):
            for stmt in (
                st.claim_returning(T, "orders", now, until, 10, "tok.", grouping, hold=hold),
                st.consume_returning(T, "orders", now, 10, True, grouping, hold=hold),
            ):
                plan = explain(conn, stmt)
                assert "ix_delayed_queue_due" in plan, plan
                assert "ix_delayed_queue_group" in plan, plan
                assert "Seq Scan" not in plan, plan
                assert_lease_probe_reads_the_leases(plan)


def subplan(plan: str, alias: str) -> str:
    """The text of the plan's subplan that reads the table under ``alias``."""
    sections = re.split(r"\n\s*(?:SubPlan|InitPlan|CTE) ", plan)
    (found,) = [s for s in sections if f" on delayed_queue {alias} " in s]
    return found


def assert_lease_probe_reads_the_leases(plan: str) -> None:
    """The head's second probe (is a message of its group under a lease?) walks the group index
    or the lock-token index (the rows under a lease): never the due index (every scheduled row
    of the queue) or the whole table. The bounded read of the table's leases that lets a take
    step over the groups in flight is read once (hashed), through the lock-token index."""
    probe = subplan(plan, "leased")
    assert "ix_delayed_queue_group" in probe or "ix_delayed_queue_lock_token" in probe, plan
    assert "ix_delayed_queue_due" not in probe and "Seq Scan" not in probe, plan
    skim = subplan(plan, "skim")
    assert "ix_delayed_queue_lock_token" in skim and "Seq Scan" not in skim, plan
    assert "hashed SubPlan" in plan, plan


def burst_with_heads_in_flight(backend, now: datetime) -> None:
    """200 groups of 20 messages all due at once, each group's in a row, and the heads of the
    first 16 groups under a lease (16 consumers busy): the take's worst case."""
    q = DelayedQueue[dict]("orders", groups=True)
    with backend.Session() as s, s.begin():
        q.offer_batch(
            s, [(f"o{g:03d}/{i:02d}", {}, now, f"o{g:03d}") for g in range(200) for i in range(20)]
        )
    with backend.engine.begin() as conn:
        heads = [f"o{g:03d}/00" for g in range(16)]
        conn.execute(
            sa.update(T)
            .where(T.c.queue == "orders", T.c.key.in_(heads))
            .values(
                lock_token=sa.literal("tok.") + sa.cast(T.c.id, sa.String),
                scheduled_at=now + timedelta(minutes=5),
            )
        )
        conn.exec_driver_sql(
            "ANALYZE delayed_queue"
            if backend.name == "postgresql"
            else "ANALYZE TABLE delayed_queue"
        )


def test_a_grouped_take_in_a_burst_steps_over_busy_groups_by_one_read_of_the_leases(pg, clock):
    """The 304 messages behind the 16 heads in flight cost a hash look-up each, not a probe of
    the group index each: the leases are read once, and only the rows of free groups probe.
    The take stops at the first free head: no row beyond its limit (a queue with groups has no
    look-ahead), and no lease probe of its own while the table holds fewer than 128 leases."""
    now = clock()
    burst_with_heads_in_flight(pg, now)
    hold = PostgreSQLStrategy(pg.engine.dialect).group_hold(True)
    stmt = st.claim_returning(
        T, "orders", now, now + timedelta(minutes=5), 1, "tok2.", "dead_skips", hold=hold
    )
    with pg.engine.connect() as conn:
        compiled = stmt.compile(dialect=conn.dialect)
        plan = "\n".join(
            conn.exec_driver_sql("EXPLAIN ANALYZE " + compiled.string, compiled.params).scalars()
        )
        conn.rollback()

    def loops(alias: str) -> int:
        (found,) = re.findall(r"loops=(\d+)", subplan(plan, alias).splitlines()[1])
        return int(found)

    assert_lease_probe_reads_the_leases(plan)
    assert loops("skim") == 1 and loops("tally") == 1, plan
    # The head of group 16 alone: nothing behind the heads in flight, nor behind it.
    assert loops("earlier") == 1, plan
    assert "(never executed)" in subplan(plan, "leased").splitlines()[1], plan


def test_a_grouped_take_in_a_burst_probes_each_group_once_on_mariadb(mariadb):
    """MariaDB caches a correlated subquery's answer by its outer values: the group probe runs
    once per group the walk meets, not once per row behind a head in flight."""
    now = datetime.now(UTC).replace(microsecond=0)
    burst_with_heads_in_flight(mariadb, now)
    strategy = MariaDBStrategy(mariadb.engine.dialect)
    for transactional in (False, True):
        stmt = st.select_due(
            T,
            "orders",
            now,
            2,
            strategy.poll_lock,
            "dead_skips",
            hold=strategy.group_hold(transactional),
        )
        compiled = stmt.compile(
            dialect=mariadb.engine.dialect, compile_kwargs={"render_postcompile": True}
        )
        params = {
            k: v.replace(tzinfo=None) if isinstance(v, datetime) else v
            for k, v in compiled.params.items()
        }
        with mariadb.engine.connect() as conn:
            doc = conn.exec_driver_sql(
                "ANALYZE FORMAT=JSON " + compiled.string, params
            ).scalar_one()
            conn.rollback()
        reads = maria_tables(json.loads(doc))
        index, _, walked = reads["delayed_queue"]
        assert index == "ix_delayed_queue_due" and walked >= 300, doc
        index, probes, _ = reads["earlier"]
        assert index == "ix_delayed_queue_group" and probes <= 25, doc


def maria_tables(node, found=None) -> dict[str, tuple[str, int, int]]:
    """Each table alias's (index, loops, rows read) in a MariaDB ``ANALYZE FORMAT=JSON``."""
    found = {} if found is None else found
    if isinstance(node, dict):
        table = node.get("table")
        if isinstance(table, dict) and "table_name" in table:
            found[table["table_name"]] = (
                table.get("key"),
                table.get("r_loops"),
                table.get("r_rows"),
            )
        for value in node.values():
            maria_tables(value, found)
    elif isinstance(node, list):
        for value in node:
            maria_tables(value, found)
    return found


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
        hold = PostgreSQLStrategy(conn.dialect).group_hold(True)
        for stmt in (
            st.claim_returning(T, "orders", now, until, 1, "tok.", "dead_skips", hold=hold),
            st.consume_returning(T, "orders", now, 1, True, "dead_blocks", hold=hold),
        ):
            # A worker's statements are prepared: PostgreSQL may plan them once, for any values.
            for plan in (explain(conn, stmt), explain_generic(conn, stmt)):
                probe = subplan(plan, "earlier")
                assert "ix_delayed_queue_group" in probe, plan
                assert "ix_delayed_queue_due" not in probe, plan
                assert_lease_probe_reads_the_leases(plan)


def explain_prepared(conn, stmt, params=None) -> str:
    """The plan PostgreSQL runs for a prepared statement from its sixth execution on, as it does
    for a worker's (psycopg prepares a statement run five times): the generic plan if its
    estimated cost is no more than that of the plans made for the values, else one of those.
    The five executions run in a transaction rolled back after."""
    state = stmt.compile(dialect=asyncpg.dialect()).construct_expanded_state(params)
    raw = conn.connection.driver_connection
    values = [state.parameters[name] for name in state.positiontup]
    args = ", ".join(psycopg.sql.Literal(v).as_string(raw) for v in values)
    # psycopg answers a rollback by deallocating every statement of the connection when it
    # prepared any (a pooled connection a worker used has): that would take worker_take with
    # it below. A rollback now, in a transaction, does it before worker_take exists.
    conn.exec_driver_sql("SELECT 1")
    conn.rollback()
    conn.exec_driver_sql("PREPARE worker_take AS " + state.statement)
    conn.commit()
    try:
        for _ in range(5):
            conn.exec_driver_sql(f"EXECUTE worker_take({args})")
        rows = conn.exec_driver_sql(f"EXPLAIN EXECUTE worker_take({args})").scalars().all()
    finally:
        conn.rollback()
        conn.exec_driver_sql("DEALLOCATE worker_take")
        conn.commit()
    return "\n".join(rows)


def over_time_with_heads_in_flight(backend, now: datetime, groups: bool) -> None:
    """200 groups of 20 messages, message i of every group due before message i + 1 of any (as
    ``bench_groups`` offers them), and 16 heads under a lease; without groups, the same rows
    with none."""
    q = DelayedQueue[dict]("orders", groups=True)
    with backend.Session() as s, s.begin():
        q.offer_batch(
            s,
            [
                (
                    f"o{g:03d}/{i:02d}",
                    {},
                    now - timedelta(milliseconds=20 - i),
                    f"o{g:03d}" if groups else None,
                )
                for i in range(20)
                for g in range(200)
            ],
        )
    with backend.engine.begin() as conn:
        conn.execute(
            sa.update(T)
            .where(T.c.queue == "orders", T.c.key.in_([f"o{g:03d}/00" for g in range(16)]))
            .values(
                lock_token=sa.literal("tok.") + sa.cast(T.c.id, sa.String),
                scheduled_at=now + timedelta(minutes=5),
            )
        )
        conn.exec_driver_sql("ANALYZE delayed_queue")


@pytest.mark.parametrize("groups", [False, True], ids=["plain", "groups"])
def test_a_prepared_take_keeps_one_plan_for_all_its_values(pg, clock, groups):
    """From its sixth execution a prepared take (a worker's are) runs the plan PostgreSQL made
    once for any values, not one planned again at every execution, which cost the server as
    much time as running the take (``bench_groups`` with ``pg_stat_statements``: 2,832
    plannings for 3,569 executions of the fused take, 0.66 ms each). Written into the text, the
    limits let that plan's estimate match the others' (``_statements.const``); bound, each
    ``LIMIT`` was estimated at a tenth of the rows and that plan was never chosen. The plan kept
    reads the due index, never the whole table."""
    now = clock()
    over_time_with_heads_in_flight(pg, now, groups)
    until = now + timedelta(minutes=5)
    grouping: st.Grouping = "dead_skips" if groups else None
    hold = PostgreSQLStrategy(pg.engine.dialect).group_hold(False)
    statements = {
        "claim": st.claim_returning(
            T, st.P.queue, st.P.now, st.P.until, st.P.limit, st.P.prefix, grouping, hold=hold
        ),
        "ack and claim": st.ack_and_claim(T, False, st.P.limit, grouping, hold),
        "consume": st.consume_returning(
            T, st.P.queue, st.P.now, st.P.limit, True, grouping, hold=hold
        ),
    }
    params = {**st.P.take("orders", now, until, 1, "tok2."), "s_id": 1, "s_token": "tok.1"}
    with pg.engine.connect() as conn:
        for name, stmt in statements.items():
            plan = explain_prepared(conn, stmt, params)
            # A plan made for the values shows them; the one kept for all shows $1, $2, ...
            due = re.search(r"Index Cond: \(\(\(?queue\)::text = (\S+)", plan)
            assert due and due.group(1).startswith("($"), f"{name}:\n{plan}"
            assert "ix_delayed_queue_due" in plan and "Seq Scan" not in plan, f"{name}:\n{plan}"


def explain_generic(conn, stmt, params=None) -> str:
    """The plan PostgreSQL makes once for a prepared statement, whatever its values."""
    state = stmt.compile(dialect=asyncpg.dialect()).construct_expanded_state(params)
    raw = conn.connection.driver_connection
    values = [state.parameters[name] for name in state.positiontup]
    args = ", ".join(psycopg.sql.Literal(v).as_string(raw) for v in values)
    conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
    conn.exec_driver_sql("PREPARE generic_take AS " + state.statement)
    try:
        rows = conn.exec_driver_sql(f"EXPLAIN EXECUTE generic_take({args})").scalars().all()
    finally:
        conn.exec_driver_sql("DEALLOCATE generic_take")
        conn.exec_driver_sql("RESET plan_cache_mode")
    return "\n".join(rows)


# -- bounded depth: each count reads at most at_most + 1 rows of its index range (issue 19) -------

CAP = 100
IN_FLIGHT = 40
#: Leases of queue ``other``: with ``q``'s, more than the cap.
OTHER_LEASES = 1000


def fill_depth(conn) -> None:
    """Queue ``q``: 3,000 due, 3,000 scheduled, 40 in flight, 500 dead and 500 done; queue
    ``other`` beside it (3,000 due, 1,000 in flight), so a read that left its range would show."""
    for queue in ("q", "other"):
        conn.exec_driver_sql(
            "INSERT INTO delayed_queue (queue, key, payload_type, payload, status, scheduled_at,"
            " scheduled_at_initially, created_at, lock_token, attempts)"
            " SELECT %(q)s::text, 'k' || g, 'json', '{}',"
            " CASE WHEN g <= 6000 OR g > 7000 THEN 'pending' WHEN g <= 6500 THEN 'dead'"
            "  ELSE 'done' END,"
            " CASE WHEN g <= 3000 THEN now() - g * interval '1 second'"
            "  WHEN g <= 6000 THEN now() + g * interval '1 second' WHEN g <= 7000 THEN NULL"
            "  ELSE now() + interval '1 minute' END,"
            " now(), now(), CASE WHEN g > 7000 THEN 'lease.' || %(q)s::text || g END, 1"
            " FROM generate_series(1, %(n)s) g",
            {"q": queue, "n": 7000 + IN_FLIGHT if queue == "q" else 3000},
        )
    conn.exec_driver_sql(
        "INSERT INTO delayed_queue (queue, key, payload_type, payload, status, scheduled_at,"
        " scheduled_at_initially, created_at, lock_token, attempts)"
        " SELECT 'other', 'f' || g, 'json', '{}', 'pending', now() + interval '1 minute', now(),"
        " now(), 'lease.other' || g, 1 FROM generate_series(1, %(n)s) g",
        {"n": OTHER_LEASES},
    )


def scans(node: dict) -> list[dict]:
    """The plan's scans of the message table."""
    found = [node] if node.get("Relation Name") == "delayed_queue" else []
    for child in node.get("Plans", []):
        found.extend(scans(child))
    return found


def index_of(scan: dict) -> str | None:
    """The index a scan reads (None for a sequential scan)."""
    if scan["Node Type"] == "Bitmap Heap Scan" and len(scan["Plans"]) == 1:
        return scan["Plans"][0].get("Index Name")
    return scan.get("Index Name")


def assert_each_read_stops_at_the_cap(plan: dict) -> None:
    """Range scans in index order that stop, each range read once: due rows (the oldest due
    among them), scheduled rows (past the rows in flight among them, which the heap check
    filters out), rows without a schedule (dead and done), each at most CAP + 1; and the leases
    of every queue (1,040), CAP + 1 of them, from the lock-token index."""
    ranges: dict[str, list[int]] = {}
    for s in scans(plan["Plan"]):
        index = index_of(s)
        read = s["Actual Rows"] + s.get("Rows Removed by Filter", 0)
        cond = s.get("Index Cond", "")
        if index == "ix_delayed_queue_lock_token":
            assert s["Node Type"] == "Index Scan", (s, plan)
            ranges.setdefault("leases", []).append(read)
            continue
        assert index == "ix_delayed_queue_due", (s, plan)
        assert s["Node Type"] in ("Index Scan", "Index Only Scan"), (s, plan)
        if "IS NULL" in cond:
            key = "no schedule"
        elif "scheduled_at <=" in cond:
            key = "due"
        else:
            assert "scheduled_at >" in cond, (s, plan)
            key = "scheduled"
        ranges.setdefault(key, []).append(read)
    assert ranges == {
        "due": [CAP + 1],
        "scheduled": [CAP + 1 + IN_FLIGHT],
        "leases": [CAP + 1],
        "no schedule": [CAP + 1],
    }, (ranges, plan)


def explain_analyze(conn, stmt) -> dict:
    compiled = stmt.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    sql = "EXPLAIN (ANALYZE, FORMAT JSON) " + compiled.string
    (doc,) = conn.exec_driver_sql(sql, compiled.params).scalar_one()
    return doc


def test_a_bounded_count_reads_at_most_cap_plus_one_rows_of_each_range(pg):
    """Analysed after the fill: each subquery is a range scan in index order that stops at the
    LIMIT. (On statistics much older than the table, e.g. taken while it was empty, PostgreSQL
    may read a range whole with a bitmap scan, as an exact count does.)"""
    with pg.engine.begin() as conn:
        fill_depth(conn)
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE delayed_queue")
    stmt = bounded_stats_stmt(T, ["q"], datetime.now(UTC), CAP)
    with pg.engine.connect() as conn:
        assert_each_read_stops_at_the_cap(explain_analyze(conn, stmt))


def test_a_bounded_count_stops_at_the_cap_under_a_generic_plan(pg):
    """psycopg prepares a statement run five times on a connection (an exporter's), and
    PostgreSQL may then plan it once for any parameters: the reads still stop at the cap."""
    with pg.engine.begin() as conn:
        fill_depth(conn)
    with pg.engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE delayed_queue")
    stmt = bounded_stats_stmt(T, ["q"], datetime.now(UTC), CAP)
    # $1, $2, ... placeholders
    compiled = stmt.compile(dialect=asyncpg.dialect(), compile_kwargs={"render_postcompile": True})
    with pg.engine.connect() as conn:
        raw = conn.connection.driver_connection
        values = [compiled.params[name] for name in compiled.positiontup]
        args = ", ".join(psycopg.sql.Literal(v).as_string(raw) for v in values)
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql("PREPARE bounded_depth AS " + compiled.string)
        sql = f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE bounded_depth({args})"
        (plan,) = conn.exec_driver_sql(sql).scalar_one()
        generic = conn.exec_driver_sql(
            "SELECT generic_plans FROM pg_prepared_statements WHERE name = 'bounded_depth'"
        ).scalar_one()
        conn.exec_driver_sql("DEALLOCATE bounded_depth")
        conn.exec_driver_sql("RESET plan_cache_mode")
    assert generic == 1
    assert_each_read_stops_at_the_cap(plan)


def test_a_bounded_count_stops_at_the_cap_on_mariadb(mariadb):
    """MariaDB reads each range in index order and stops (``ANALYZE`` counts the rows read): the
    rows without a schedule are ordered by id there, since it would sort the whole range for
    ``scheduled_at, id`` (``IS NULL`` is no constant for its ORDER BY); and the leases come from
    the lock-token index, not from a scan of another index in GROUP BY order."""
    now = datetime.now(UTC)
    q = DelayedQueue[dict]("q")
    with mariadb.Session() as s, s.begin():
        q.offer_batch(s, [(f"d{i}", {}, now - timedelta(seconds=i + 1)) for i in range(1000)])
        q.offer_batch(s, [(f"s{i}", {}, now + timedelta(seconds=i + 1)) for i in range(1000)])
        q.offer_batch(s, [(f"x{i}", {}, now - timedelta(hours=1)) for i in range(1000)])
    with mariadb.engine.begin() as conn:
        conn.execute(
            sa.update(T).where(T.c.key.like("x%")).values(status="dead", scheduled_at=None)
        )
        conn.exec_driver_sql("ANALYZE TABLE delayed_queue")
    compiled = bounded_stats_stmt(T, ["q"], now, CAP).compile(
        dialect=mariadb.engine.dialect, compile_kwargs={"render_postcompile": True}
    )
    # As DateTimeUTC stores them there: naive UTC.
    params = {
        k: v.replace(tzinfo=None) if isinstance(v, datetime) else v
        for k, v in compiled.params.items()
    }
    with mariadb.engine.connect() as conn:
        doc = conn.exec_driver_sql("ANALYZE FORMAT=JSON " + compiled.string, params).scalar_one()
    tables, sorts = maria_reads(json.loads(doc))
    # The table itself is read through the due index (three ranges, CAP + 1 rows each) and the
    # lock-token index (no lease here); nothing sorts its rows, only the leases' GROUP BY.
    assert sorted(tables) == [
        ("ix_delayed_queue_due", CAP + 1),
        ("ix_delayed_queue_due", CAP + 1),
        ("ix_delayed_queue_due", CAP + 1),
        ("ix_delayed_queue_lock_token", 0),
    ], doc
    assert all("delayed_queue." not in key for key in sorts), doc


def maria_reads(node, tables=None, sorts=None):
    """(index, rows read) of each access to the message table, and every filesort key, in a
    MariaDB ``ANALYZE FORMAT=JSON`` document."""
    tables = [] if tables is None else tables
    sorts = [] if sorts is None else sorts
    if isinstance(node, dict):
        table = node.get("table")
        if isinstance(table, dict) and table.get("table_name") == "delayed_queue":
            tables.append((table.get("key"), int(table["r_rows"])))
        if "sort_key" in node:
            sorts.append(node["sort_key"])
        for value in node.values():
            maria_reads(value, tables, sorts)
    elif isinstance(node, list):
        for value in node:
            maria_reads(value, tables, sorts)
    return tables, sorts
