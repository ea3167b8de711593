"""Pure statement builders: each returns a Core construct and does no I/O.

Unit tests compile them for each dialect and read the SQL; operations execute them on the
caller's Session. Every value is a bound parameter, so SQLAlchemy's compiled-statement cache
serves repeated calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    DateTime,
    Integer,
    String,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    column,
    delete,
    false,
    func,
    literal,
    literal_column,
    or_,
    select,
    text,
    true,
    tuple_,
    type_coerce,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import ColumnElement, Delete, Select, Update
from sqlalchemy.sql.expression import ColumnClause
from sqlalchemy.sql.visitors import InternalTraversal

from ._codec import LenientJSON
from ._rules import HELD, INSERT_COLUMNS
from ._time import DateTimeUTC

Lock = Literal["update", "share", "update_skip_locked"] | None


@dataclass(frozen=True, eq=False)
class Shape:
    """Where a table keeps its queue state: the columns every take and settle reads and writes.

    A message table keeps it in its own columns (:func:`message_shape`); an entity table in the
    ``queue_`` columns of :class:`~sqla_delayedq.EntityQueueMixin` (``EntityQueue`` builds its
    shape). The take, the settles and the due filter are built from a shape, so both kinds of
    queue take, acknowledge, fail, release and extend with the same statements.
    """

    table: Table
    id: Any
    due: Any
    token: Any
    attempts: Any
    error: Any
    attempted_at: Any
    status: Any
    #: The queue-name column of a message table; None when the table is one queue.
    queue: Any | None
    #: The status of an acknowledged row that is kept, and of a row out of attempts.
    done: str
    dead: str
    #: The status a retried failure sets (None: leave it).
    retrying: str | None = None
    #: Whether an acknowledgement also records the attempt count.
    done_counts_attempt: bool = False
    #: Tokens embed the row id (``prefix || id``), else one token per take.
    row_tokens: bool = True
    #: A row due again after it was done (an entity scheduled again by writing its due time,
    #: not by ``schedule``) starts a fresh run: its take counts attempts from 0.
    fresh_when_done: bool = False
    #: Columns of the table's owner that an update would change on its own (``onupdate``,
    #: ``server_onupdate``: an entity's ``updated_at``): the queue's statements set them to
    #: themselves, so that its takes, heartbeats and settles leave them as they were.
    kept: tuple[Any, ...] = ()


def keeping(shape: Shape) -> dict[Any, Any]:
    """SET clauses that keep ``shape.kept`` as they are (see :attr:`Shape.kept`)."""
    return {column: column for column in shape.kept}


@functools.cache
def message_shape(t: Table) -> Shape:
    """The shape of a message table (``QueueMessageMixin``)."""
    c = t.c
    return Shape(
        table=t,
        id=c.id,
        due=c.scheduled_at,
        token=c.lock_token,
        attempts=c.attempts,
        error=c.last_error,
        attempted_at=c.last_attempt_at,
        status=c.status,
        queue=c.queue,
        done="done",
        dead="dead",
    )


# Every column of a message row, in a fixed order, for selects and RETURNING.
ROW_COLUMNS = (
    "id",
    "queue",
    "key",
    "payload_type",
    "payload",
    "payload_bytes",
    "status",
    "scheduled_at",
    "scheduled_at_initially",
    "created_at",
    "lock_token",
    "attempts",
    "last_attempt_at",
    "last_error",
    "headers",
    "group_key",
    "priority",
)


#: What a take needs of a row: everything but the status and the last failure's details (an
#: error text can be kilobytes; a take never reads it).
TAKE_COLUMNS = tuple(c for c in ROW_COLUMNS if c not in ("status", "last_attempt_at", "last_error"))


def affected(session: Any, stmt: Any, params: Any = None) -> int:
    """Execute a DML statement and return how many rows it matched."""
    result: Any = session.execute(stmt, params)
    return int(result.rowcount)


def columns(t: Table, names: tuple[str, ...] = ROW_COLUMNS) -> list[Any]:
    """Columns for a select list or ``RETURNING``; the payload is read leniently (see
    :class:`~sqla_delayedq._codec.LenientJSON`), so corrupt JSON text is a decode error of that
    message, not an exception of the whole result."""
    return [
        type_coerce(t.c.payload, LenientJSON()).label("payload") if name == "payload" else t.c[name]
        for name in names
    ]


class P:
    """Named bind parameters of the statements that strategies build once and cache."""

    queue = bindparam("c_queue", type_=String())
    now = bindparam("c_now", type_=DateTimeUTC())
    until = bindparam("c_until", type_=DateTimeUTC())
    #: Written into the statement's text at each execution (see :func:`const`).
    limit = bindparam("c_limit", type_=Integer(), literal_execute=True)
    prefix = bindparam("c_prefix", type_=String())
    ids = bindparam("c_ids", type_=postgresql.ARRAY(BigInteger()))
    tokens = bindparam("c_tokens", type_=postgresql.ARRAY(String()))

    @staticmethod
    def take(queue: str, now: datetime, until: datetime, limit: int, prefix: str) -> dict[str, Any]:
        return {
            "c_queue": queue,
            "c_now": now,
            "c_until": until,
            "c_limit": limit,
            "c_prefix": prefix,
        }


def const(n: int) -> ColumnElement[int]:
    """An integer in the statement's text, not a bound parameter: every ``LIMIT`` of a take.

    psycopg prepares a statement run five times, and PostgreSQL then plans it once for all
    parameter values (a generic plan) only if that plan's estimated cost is about that of a plan
    made for the values at hand; otherwise it plans again at every execution. A bound ``LIMIT``
    is estimated at a tenth of the rows it limits, so a take's generic plan looked a hundred
    times dearer than it is, and every take was planned afresh: about half a millisecond of the
    server's time, as much as running it. With the numbers written in, PostgreSQL keeps the
    generic plan (``test_explain.py`` checks that it does, and what it reads). The take's own
    ``limit`` is :attr:`P.limit`, rendered the same way at each execution, so each distinct
    limit is a statement of its own, prepared once.
    """
    return literal_column(str(int(n)), Integer())


def limit_of(limit: Any, more: int = 0) -> Any:
    """``limit`` (+ ``more``) as a take's ``LIMIT``: a number in the text (see :func:`const`),
    from an ``int`` or :attr:`P.limit`."""
    if isinstance(limit, int):
        return const(limit + more)
    return limit + const(more) if more else limit


def with_lock(stmt: Select[Any], lock: Lock) -> Select[Any]:
    if lock == "update":
        return stmt.with_for_update()
    if lock == "share":
        return stmt.with_for_update(read=True)
    if lock == "update_skip_locked":
        return stmt.with_for_update(skip_locked=True)
    return stmt


def select_by_key(t: Table, queue: str, key: str, lock: Lock = None) -> Select[Any]:
    stmt = select(*columns(t)).where(t.c.queue == queue, t.c.key == key)
    return with_lock(stmt, lock)


def select_by_keys(t: Table, queue: str, keys: Sequence[str], lock: Lock = None) -> Select[Any]:
    stmt = select(*columns(t)).where(t.c.queue == queue, t.c.key.in_(keys)).order_by(t.c.key)
    return with_lock(stmt, lock)


def due_filter(shape: Shape, queue: Any, now: Any) -> ColumnElement[bool]:
    """Due rows (including those whose lease ran out); of one queue on a message table."""
    if shape.queue is None:
        return shape.due <= now  # type: ignore[no-any-return]
    return and_(shape.queue == queue, shape.due <= now)


def oldest_due(shape: Shape, queue: Any, now: Any) -> Select[Any]:
    """The due time of the oldest due row (its lag is ``now`` minus it): one probe of the due
    index."""
    return select(func.min(shape.due)).where(due_filter(shape, queue, now))


#: How a queue orders messages that share a group key (``DelayedQueue(groups=...)``): None for
#: a queue without groups; ``"dead_skips"``: a dead message no longer holds its group back;
#: ``"dead_blocks"``: it does, until it is requeued or dropped.
Grouping = Literal["dead_skips", "dead_blocks"] | None


#: How many of the table's leases a grouped take reads to step over their groups' waiting
#: messages (see :func:`group_head`).
SKIMMED = 128


#: A transaction-scoped lock on one group (queue, group key), true when taken, never waiting
#: (PostgreSQL's ``pg_try_advisory_xact_lock``): held by a transactional take until the handler's
#: transaction ends, so no other take starts a message of that group meanwhile.
GroupLock = Callable[[ColumnElement[Any], ColumnElement[Any]], ColumnElement[bool]]


def group_head(
    t: Table,
    grouping: Grouping,
    now: Any,
    hold: GroupLock | None = None,
    ordered: bool = True,
) -> ColumnElement[bool]:
    """A row that may be taken under its group's order: no group, or (1) no message of its
    group before it (by first schedule, then id) that is still pending (in flight, due,
    scheduled or waiting for a retry) or, with ``dead_blocks``, dead, and (2) no message of its
    group in flight: held under a lease that has not run out, or (with ``hold``) taken by a
    transaction still open. A probe of the ``group`` index each, the second only for a head.

    With ``ordered`` (PostgreSQL, SQLite) the statement first reads up to :data:`SKIMMED` of the
    table's leases that have not run out, once (in the lock-token index's order, so through it
    whatever the statistics say), and steps over every row of their groups with a look-up: in
    a burst, each head in flight has its group's other messages due behind it, which would cost
    a probe each. That read is bounded so that leases of other queues in the table (a batch
    consumer's thousands) cost at most its length; a group it missed costs the probes, which
    stay exact. MariaDB caches each probe's answer per group already (its subquery cache).

    Why (1) is exact under racing consumers: a message stays pending from its offer until it
    is acknowledged, so the message after it is not a head while it is taken, whatever its lock.
    The probe is a plain read in every backend (not a locking one, which ``SKIP LOCKED`` would
    let skip the taken head), and it sees every commit made before the statement began.

    (2) covers a message offered (or rescheduled) with an earlier time than its group's message
    in flight: it goes first in the group's order, so (1) alone would let it start beside the
    other. A lease is a column, read like (1); a transactional take leaves no mark a plain read
    sees until it commits, so takes hold the group (``hold``) until their transaction ends.
    Here ``hold`` is tried in the condition, only for a head that passed the rest (a ``CASE``:
    SQL does not otherwise promise the order a condition's parts are evaluated in): for InnoDB,
    whose locking read locks a row before the condition runs. PostgreSQL evaluates the
    condition first, so its takes try ``hold`` on the rows they locked (:func:`holding`): a row
    skipped as locked, or already deleted by a commit the statement's snapshot predates, would
    otherwise hold its group for the rest of the taker's transaction.
    """
    if grouping is None:
        return true()
    earlier = t.alias("earlier")
    blocking = earlier.c.status == "pending"
    if grouping == "dead_blocks":
        blocking = or_(blocking, earlier.c.status == "dead")
    # The group's first message that holds it (the row itself is pending, so there is one): in
    # the group index's own order, so the plan reads that index whatever the statistics say (any
    # other index would need a sort), and stops at the first row that holds the group.
    first = (
        select(earlier.c.id)
        .where(
            earlier.c.queue == t.c.queue,
            earlier.c.group_key == t.c.group_key,
            earlier.c.group_key.is_not(None),  # the partial group index applies
            blocking,
        )
        .order_by(
            earlier.c.queue,
            earlier.c.group_key,
            earlier.c.scheduled_at_initially,
            earlier.c.id,
        )
        .limit(const(1))
        .scalar_subquery()
    )
    # A lease of the group that has not run out (the row itself is due, so never counts), by
    # the group index or the lock-token index (the rows under a lease), per head: an EXISTS
    # would let PostgreSQL hash one read of every lease in the table, a scan of the whole table
    # when the statistics are stale. With ``ordered`` (PostgreSQL, SQLite) in the group index's
    # order, for the reason above: unordered, statistics that say the queue is nearly empty
    # sent the probe through the due index, every row of the queue per head. Without (MariaDB),
    # whose optimizer answers that order by walking the whole group index.
    leased = t.alias("leased")
    leases = select(leased.c.id).where(
        leased.c.queue == t.c.queue,
        leased.c.group_key == t.c.group_key,
        leased.c.group_key.is_not(None),
        # The same leases the read below counts: its shortcut is exact only if they agree.
        *unexpired_leases(leased, now),
    )
    if ordered:
        leases = leases.order_by(
            leased.c.queue,
            leased.c.group_key,
            leased.c.scheduled_at_initially,
            leased.c.id,
        )
    busy = leases.limit(const(1)).scalar_subquery().is_not(None)
    free: ColumnElement[bool] = ~busy
    if hold is not None:
        free = case((busy, false()), else_=hold(t.c.queue, t.c.group_key))
    head: list[tuple[ColumnElement[bool], ColumnElement[bool]]] = [(first == t.c.id, free)]
    if ordered:
        # Not correlated with the row: PostgreSQL hashes it, SQLite builds a transient table.
        # No condition on the queue, which would let stale statistics pick the due index.
        skim, tally = t.alias("skim"), t.alias("tally")
        skimmed = (
            select(skim.c.queue, skim.c.group_key)
            .where(*unexpired_leases(skim, now))
            .order_by(skim.c.lock_token)
            .limit(const(SKIMMED))
            .subquery("skimmed")
        )
        seen = select(skimmed.c.queue, skimmed.c.group_key)
        # Fewer than SKIMMED leases in the table: the read above holds them all, so a head
        # whose group it missed has none, and needs no probe of its own. Counted once, by a
        # read that stops at SKIMMED in any order (an order would let a plan sort them all).
        counted = select(tally.c.id).where(*unexpired_leases(tally, now)).limit(const(SKIMMED))
        every = select(func.count()).select_from(counted.subquery()).scalar_subquery() < SKIMMED
        head = [
            (tuple_(t.c.queue, t.c.group_key).in_(seen), false()),
            (first == t.c.id, case((every, true()), else_=free)),
        ]
    return or_(t.c.group_key.is_(None), case(*head, else_=false()))


def look_ahead(grouping: Grouping) -> int:
    """How many rows a take picks beyond its limit, to say whether more is due now: one for a
    queue without groups, none for a queue with groups, whose consumer takes again at once after
    a message of a group anyway (its acknowledgement may have made the next of the group due):
    in a burst, the row after a group's head is that group's next message, and reaching the
    next free head walked past all of them, a probe each."""
    return 1 if grouping is None else 0


def unexpired_leases(alias: Any, now: Any) -> tuple[ColumnElement[bool], ...]:
    """Rows of ``alias`` under a lease that has not run out, as :func:`group_head` reads them
    (its per-head probe and its one read of the table's leases alike)."""
    return (
        alias.c.status == "pending",
        alias.c.lock_token.is_not(None),
        # Not a range of the due index, which would walk every scheduled row of the queue.
        func.coalesce(alias.c.scheduled_at, now) > now,
    )


def take_filter(
    t: Table,
    queue: Any,
    now: Any,
    grouping: Grouping,
    boosted: bool,
    hold: GroupLock | None = None,
    ordered: bool = True,
) -> ColumnElement[bool]:
    """What a take may pick: due, the head of its group (a queue with groups; see
    :func:`group_head` for ``hold`` and ``ordered``), and with ``boosted`` a priority above 0."""
    head = group_head(t, grouping, now, hold, ordered)
    cond = and_(due_filter(message_shape(t), queue, now), head)
    return and_(cond, t.c.priority > 0) if boosted else cond


def take_order(t: Table, boosted: bool) -> tuple[Any, ...]:
    """The order of a take: schedule, then id; highest priority first for ``boosted`` (the
    ``priority`` index, a range scan of boosted rows)."""
    if boosted:
        return (t.c.priority.desc(), t.c.scheduled_at, t.c.id)
    return (t.c.scheduled_at, t.c.id)


def select_due(
    t: Table,
    queue: Any,
    now: Any,
    limit: Any,
    lock: Lock,
    grouping: Grouping = None,
    boosted: bool = False,
    hold: GroupLock | None = None,
    ordered: bool = True,
) -> Select[Any]:
    """Due messages of one queue in schedule order: a range scan of the ``due`` index (heads
    of their groups only, when the queue has groups; see :func:`take_filter`)."""
    stmt = (
        select(*columns(t, TAKE_COLUMNS))
        .where(take_filter(t, queue, now, grouping, boosted, hold, ordered))
        .order_by(*take_order(t, boosted))
        .limit(limit_of(limit))
    )
    return with_lock(stmt, lock)


def in_flight(shape: Shape, queue: str, now: datetime, share_lock: bool) -> Select[Any]:
    """How many rows of a queue are taken under a lease that has not run out (the lock-token
    index: settled rows have no token)."""
    stmt = select(func.count()).select_from(shape.table).where(shape.token.is_not(None))
    stmt = stmt.where(shape.due > now)
    if shape.queue is not None:
        stmt = stmt.where(shape.queue == queue)
    return stmt.with_for_update(read=True) if share_lock else stmt


def next_due(shape: Shape, queue: Any, now: Any) -> Select[Any]:
    """When the next row becomes due, strictly after ``now`` (rows due at ``now`` that a poll
    skipped are locked by another consumer)."""
    stmt = select(func.min(shape.due)).where(shape.due > now)
    return stmt if shape.queue is None else stmt.where(shape.queue == queue)


class ArrayOf(ColumnElement[Any]):
    """PostgreSQL's ``ARRAY(subquery)``: the subquery's rows as one array value.

    ``ctid = ANY(ARRAY(SELECT ctid FROM picked))`` is evaluated once, before the scan, and a
    condition on ``ctid`` can only be a TID scan (or, on a table of a page or two, a sequential
    scan): the look-up of the picked rows never depends on statistics or walks an index.
    """

    inherit_cache = True

    def __init__(self, subquery: Select[Any]) -> None:
        self.subquery = subquery
        self.type = postgresql.ARRAY(String())

    _traverse_internals = [("subquery", InternalTraversal.dp_clauseelement)]


def row_tid(t: Table) -> ColumnClause[Any]:
    """PostgreSQL's ``ctid``: where the row version is. The picked rows are locked by the same
    statement, so it cannot move between the pick and the update that uses it; a row whose
    newer version the statement's snapshot cannot see is left alone (taken by a later poll).
    """
    return column("ctid", _selectable=t)


@compiles(ArrayOf, "postgresql")
def _compile_array_of(element: ArrayOf, compiler: Any, **kw: Any) -> str:
    return f"ARRAY({compiler.process(element.subquery, **kw)})"


def take_values(shape: Shape, lease_until: Any, prefix: Any) -> list[tuple[Any, Any]]:
    """SET clauses of a take, in order: MySQL evaluates them left to right on updated values.

    A take that follows an expired lease (the lock token is still set) counts the lost attempt
    (see :func:`~sqla_delayedq._rules.attempts_used_up`), so a row that keeps killing or hanging
    its consumers ends up dead. Where a status records the last attempt's outcome (entities),
    it records that one's, failed: a row of a fresh run (see ``Shape.fresh_when_done``) given
    back uncounted afterwards then keeps what it counted, where it started afresh again.
    """
    lost = lost_attempt(shape.token)
    attempts: Any = shape.attempts + lost
    values: list[tuple[Any, Any]] = []
    if shape.fresh_when_done:
        fresh = and_(shape.status == shape.done, shape.token.is_(None))
        attempts = case((fresh, 0), else_=attempts)
        if shape.retrying is not None:  # after attempts, which reads the status (MySQL)
            values.append((shape.status, case((lost == 1, shape.retrying), else_=shape.status)))
    return [
        (shape.attempts, attempts),
        *values,
        (shape.due, lease_until),
        (shape.token, token_expr(shape, prefix)),
        *keeping(shape).items(),
    ]


def lost_attempt(token: ColumnElement[Any]) -> ColumnElement[int]:
    """1 for a row whose lock token is still set (its lease ran out without an ack: an attempt
    was lost), else 0: what a take counts, and any statement that clears an expired lease
    (:func:`~sqla_delayedq._rules.lost_token` is its Python side). Read it before the token
    changes (MySQL evaluates SET clauses left to right on updated values)."""
    # A held token (an update while in flight, see _rules.hold) started a fresh run: no loss.
    return case((or_(token.is_(None), is_held(token)), 0), else_=1)


def is_held(token: ColumnElement[Any]) -> ColumnElement[bool]:
    """Whether a lock token is a held one (see :func:`~sqla_delayedq._rules.hold`)."""
    return func.substr(token, 1, 1) == HELD


def token_expr(shape: Shape, prefix: Any) -> ColumnElement[str]:
    """The lock token of a take: a random per-take prefix, joined to the row id (per-row)."""
    if isinstance(prefix, str):
        prefix = literal(prefix, String)
    if not shape.row_tokens:
        return prefix  # type: ignore[no-any-return]
    return prefix + cast(shape.id, String)  # type: ignore[no-any-return]


def claim_returning(
    t: Table,
    queue: Any,
    now: Any,
    lease_until: Any,
    limit: Any,
    prefix: Any,
    grouping: Grouping = None,
    boosted: bool = False,
    relaxed: bool = False,
    hold: GroupLock | None = None,
    exclude: Any = None,
    look_ahead_row: bool = True,
) -> Update:
    """PostgreSQL: pick with ``SKIP LOCKED`` and take in one statement.

    ``RETURNING`` carries the picked row's previous lock token and due time, so delivery
    (first or redelivery) is decided from the row as it was before the take. The pick locks one
    row more than it takes (released at the take's commit) and ``RETURNING`` says how many it
    found (``picked``): more than ``limit`` means more is due now, so the consumer knows whether
    to take again without an empty take to find out.

    With ``relaxed`` the statement also turns ``synchronous_commit`` off for the rest of its
    transaction (``set_config(..., true)``, no extra round trip): the take's commit does not
    wait for the WAL flush. Only for a transaction that holds nothing but the take (see
    ``_dialects.TAKE_ONLY``): a take lost to a server crash leaves the row as it was, to be taken
    again, like an expired lease.

    ``hold`` (see :func:`group_head`): the lease marks the group busy once the take commits;
    until then the lock keeps a transactional take of the group out, and the other way round.

    :func:`claim_ahead` adds when the queue's next row is due.

    ``exclude``: a row id never picked (the row :func:`ack_and_claim` acknowledges in the same
    statement; one statement must not change a row twice).

    Without ``look_ahead_row`` the pick locks no row beyond the limit: for a take whose
    transaction goes on to run the handler, which would hold that row from other consumers.
    """
    shape = message_shape(t)
    held = hold is not None and grouping is not None
    due = take_filter(t, queue, now, grouping, boosted)
    if exclude is not None:
        due = and_(due, t.c.id != exclude)
    picked = (
        select(
            row_tid(t).label("row_tid"),
            t.c.id.label("id"),
            t.c.lock_token.label("prev_token"),
            t.c.scheduled_at.label("prev_scheduled_at"),
            t.c.priority.label("prio"),
            *([t.c.queue.label("q"), t.c.group_key.label("g")] if held else []),
        )
        .where(due)
        .order_by(*take_order(t, boosted))
        .limit(limit_of(limit, look_ahead(grouping) if look_ahead_row else 0))
        .with_for_update(skip_locked=True)
        .cte("picked")
    )
    order = (picked.c.prev_scheduled_at, picked.c.id)
    chosen_rows = select(picked.c.row_tid, picked.c.prev_token, picked.c.prev_scheduled_at)
    if held and hold is not None:
        chosen_rows = chosen_rows.where(holding(picked, hold))
    chosen = (
        chosen_rows.order_by(*((picked.c.prio.desc(), *order) if boosted else order))
        .limit(limit_of(limit))
        .cte("chosen")
    )
    found = select(func.count()).select_from(picked).scalar_subquery().label("picked")
    return (
        update(t)
        .where(
            row_tid(t) == chosen.c.row_tid,
            row_tid(t) == any_(ArrayOf(select(chosen.c.row_tid))),
        )
        .ordered_values(*take_values(shape, lease_until, prefix))
        .returning(
            *columns(t, TAKE_COLUMNS),
            chosen.c.prev_token,
            chosen.c.prev_scheduled_at,
            found,
            *(
                [func.set_config("synchronous_commit", "off", true()).label("relaxed")]
                if relaxed
                else []
            ),
        )
    )


def claim_ahead(take: Update, t: Table, queue: Any, now: Any) -> Select[Any]:
    """PostgreSQL: ``take`` (a :func:`claim_returning`) that also reads when the queue's next
    row is due, ``next_at``: :func:`next_due` in the statement's snapshot, so not seeing the rows
    it takes (one uncorrelated subquery, evaluated once). An idle consumer then knows how long to
    sleep without a statement to ask.

    One row per taken message, or one row of NULLs and ``next_at`` when none was: a consumer
    woken for a message that another took first (one chained to its acknowledgement, say) asks
    nothing more before it sleeps again.
    """
    taken = take.cte("taken")
    one = select(const(1).label("one")).subquery("one")
    next_at = next_due(message_shape(t), queue, now).scalar_subquery().label("next_at")
    return select(next_at, *taken.c).select_from(one.outerjoin(taken, true()))


def ack_and_claim(
    t: Table, done: bool, limit: Any, grouping: Grouping = None, hold: GroupLock | None = None
) -> Select[Any]:
    """PostgreSQL: acknowledge one taken message (by id and lock token, as :func:`settle`
    ``ack``, or ``done`` for a queue with retention) and take the next due ones (as
    :func:`claim_returning`, with ``limit``, ``grouping`` and ``hold``), in one statement: a
    consumer in lease mode that runs it in autocommit pays one round trip and one commit per
    message instead of ``BEGIN``, ack, take, ``COMMIT``.

    One row per taken message, or one row of NULLs when none was; each carries ``acked``, the
    number of rows the acknowledgement matched (0 or 1), and, for a queue without groups,
    ``next_at``, when the queue's next row is due (as ``ahead`` reads it, taken rows and the
    acknowledged one left out; with groups, a due row need not be one a take may pick). The
    take never picks the acknowledged row: one statement must not change a row twice
    (whichever change won would be unknown). Both changes commit together, durably, as the
    acknowledgement must.

    With groups the take reads the statement's snapshot, in which the acknowledged message is
    still pending under its lease: its group's next message is not taken by this statement
    (it is by the next take, as by any take that began before the acknowledgement committed).
    """
    shape = message_shape(t)
    acked = settle(shape, "done" if done else "ack").returning(shape.id).cte("acked")
    s_id = bindparam("s_id", type_=shape.id.type)
    taken = claim_returning(
        t, P.queue, P.now, P.until, limit, P.prefix, grouping, hold=hold, exclude=s_id
    ).cte("taken")
    count = select(func.count().label("acked")).select_from(acked).subquery("ack_count")
    next_at = next_due(shape, P.queue, P.now).where(shape.id != s_id).scalar_subquery()
    ahead = [next_at.label("next_at")] if grouping is None else []
    return select(count.c.acked, *ahead, *taken.c).select_from(count.outerjoin(taken, true()))


def holding(picked: Any, hold: GroupLock) -> ColumnElement[bool]:
    """Of rows a take locked (``picked``, with ``q`` and ``g``), those it may keep: no group, or
    a group it could hold (see :func:`group_head`). Tried after the row locks, so a row skipped
    as locked (or gone since the statement's snapshot) never holds its group."""
    return or_(picked.c.g.is_(None), hold(picked.c.q, picked.c.g))


def consume_returning(
    t: Table,
    queue: Any,
    now: Any,
    limit: Any,
    skip_locked: bool,
    grouping: Grouping = None,
    boosted: bool = False,
    ahead: bool = False,
    hold: GroupLock | None = None,
) -> Any:
    """Take due rows by deleting them inside the caller's transaction (seed 002).

    The rows come back as they were; a rollback restores them, due at once. With ``ahead``
    each row also carries ``next_at`` (see :func:`next_pending`); ``hold``: see
    :func:`group_head`.
    """
    due = take_filter(t, queue, now, grouping, boosted)
    order = take_order(t, boosted)
    if skip_locked and hold is not None and grouping is not None:
        locked = (
            select(row_tid(t).label("row_tid"), t.c.queue.label("q"), t.c.group_key.label("g"))
            .where(due)
            .order_by(*order)
            .limit(limit_of(limit))
            .with_for_update(skip_locked=True)
            .subquery("picked")
        )
        picked = select(locked.c.row_tid).where(holding(locked, hold))
        cond = row_tid(t) == any_(ArrayOf(picked))
    elif skip_locked:
        picked = select(row_tid(t)).where(due).order_by(*order).limit(limit_of(limit))
        cond = row_tid(t) == any_(ArrayOf(picked.with_for_update(skip_locked=True)))
    else:
        top = select(t.c.id).where(due).order_by(*order).limit(limit_of(limit))
        cond = t.c.id.in_(top.scalar_subquery())
    returned = columns(t, TAKE_COLUMNS)
    if ahead:
        returned.append(next_pending(t, queue))
    return delete(t).where(cond).returning(*returned)


def next_pending(t: Table, queue: Any) -> ColumnElement[Any]:
    """``next_at``: the due time of the queue's first pending row other than the returned one
    (a take of one), read in the take's own statement, so a transactional consumer knows
    whether to take again without an empty take to find out.

    A plain read of the ``due`` index that starts just past the taken row, in the take's own
    order, so it never walks again what the take walked (under a pinned vacuum horizon, the
    dead entries of every message handled since: a second walk doubled the take's cost). Rows
    before the taken one are held by other consumers (the take skipped them as locked): they
    are not this consumer's to take, and do not count. Rows offered after the statement began
    do not count either (their offers wake the consumer).
    """
    other = t.alias("ahead")
    return (
        select(other.c.scheduled_at)
        .where(
            other.c.queue == queue,
            tuple_(other.c.scheduled_at, other.c.id) > tuple_(t.c.scheduled_at, t.c.id),
        )
        .order_by(other.c.scheduled_at, other.c.id)
        .limit(const(1))
        .correlate(t)
        .scalar_subquery()
        .label("next_at")
    )


#: The columns of a chunk as :func:`recordset_insert` receives them: one JSON array each, the
#: bind parameter ``u_<name>``; ``p`` holds JSON values, the others text (or NULL) elements.
RECORDSET_COLUMNS = ("k", "p", "b", "a", "a0", "h", "g", "r")


def recordset_insert(
    t: Table, notify: tuple[str, str] | None = None, *, by_key: bool = True
) -> Any:
    """PostgreSQL: insert a whole chunk from one JSON array per column, skipping existing keys.

    ``ROWS FROM`` expands the arrays side by side into rows: one statement and a parameter per
    column whatever the chunk size. The client builds each array with one ``join`` or one
    encoder call (the payloads are spliced in as the serializer wrote them), and the server
    parses flat arrays instead of an object per row (measured: less client and server time per
    row than ``jsonb_to_recordset`` over one document of objects, itself faster than arrays
    that psycopg adapts element by element). A column no row sets is sent as NULL, which
    ``ROWS FROM`` pads with NULLs; a missing due time means ``u_now``. Rows go in in key
    order, so concurrent batches take their unique-index locks in the same order; with
    ``by_key`` False in the arrays' order (a group's order: see ``_offers``). The
    statement returns one row: the keys written, as one array (a row per key costs the client
    more than the server).

    ``notify``: ``(channel, tail)``; when any row is written the statement also sends
    ``NOTIFY channel, '<rows written><tail>'``, so the wake-up costs no round trip of its own.
    """
    values = ", ".join(
        f"jsonb_array_elements{'' if name == 'p' else '_text'}(CAST(:u_{name} AS jsonb))"
        for name in RECORDSET_COLUMNS
    )
    aliases = ", ".join((*RECORDSET_COLUMNS, *(() if by_key else ("n",))))
    ordinality = "" if by_key else " WITH ORDINALITY"
    source = text(f"ROWS FROM ({values}){ordinality} AS r({aliases})").bindparams(
        *(bindparam(f"u_{name}", type_=Text()) for name in RECORDSET_COLUMNS)
    )

    def r(name: str, type_: Any = None) -> Any:
        col: Any = literal_column(f"r.{name}")
        return col if type_ is None else cast(col, type_)

    now = bindparam("u_now", type_=DateTime(timezone=True))
    at = r("a", DateTime(timezone=True))
    rows = (
        select(
            bindparam("u_queue", type_=String()),
            r("k"),
            bindparam("u_type", type_=String()),
            r("p"),
            func.decode(r("b"), literal("hex")),
            literal("pending"),
            func.coalesce(at, now),
            func.coalesce(r("a0", DateTime(timezone=True)), at, now),
            now,
            literal(0),
            r("h"),
            r("g"),
            func.coalesce(r("r", Integer()), literal(0)),
        )
        .select_from(source)
        .order_by(r("k" if by_key else "n"))
    )
    names = list(INSERT_COLUMNS)
    ins = (
        postgresql.insert(t)
        .from_select(names, rows)
        .on_conflict_do_nothing(index_elements=["queue", "key"])
        .returning(t.c.key)
        .cte("ins")
    )
    written = func.array_agg(ins.c.key, type_=postgresql.ARRAY(String()))
    if notify is None:
        return select(written)
    channel, tail = notify
    count = func.count()
    note = func.pg_notify(literal(channel), func.concat(count, literal(tail)))
    return select(written, case((count > 0, note)))


def take_ids(shape: Shape, ids: Sequence[Any], now: Any, lease_until: Any, prefix: Any) -> Update:
    """Take already-picked rows; the ``due <= now`` guard makes it a compare-and-swap where the
    backend has no row locks (SQLite)."""
    return (
        update(shape.table)
        .where(shape.id.in_(ids), shape.due <= now)
        .ordered_values(*take_values(shape, lease_until, prefix))
    )


def guarded_update(
    t: Table, row_id: int, seen_scheduled_at: datetime | None, seen_token: str | None
) -> Update:
    """Update one row only if it is still as it was read (compare-and-swap)."""
    return update(t).where(
        t.c.id == row_id,
        t.c.scheduled_at.is_not_distinct_from(seen_scheduled_at),
        t.c.lock_token.is_not_distinct_from(seen_token),
    )


#: The statements behind ack, nack, release, extend and a burial, by name.
SettleName = Literal["ack", "done", "nack", "bury", "release", "extend"]


class Param(str):
    """A named bind parameter in a :func:`settle_plan` (a plain value is a constant)."""


def settle_plan(shape: Shape, name: SettleName) -> dict[Any, Any]:
    """What a settle writes: column -> :class:`Param` or constant. ``ack`` deletes (empty).

    Parameters: ``s_at`` (the new due time) for nack, release and extend; ``s_now`` for done,
    nack and bury; ``s_attempts`` for done (when the shape counts it), nack and bury;
    ``s_error`` for nack and bury.
    """
    at, now, attempts = Param("s_at"), Param("s_now"), Param("s_attempts")
    failure = {shape.attempts: attempts, shape.error: Param("s_error"), shape.attempted_at: now}
    plan: dict[Any, Any]
    if name == "ack":
        plan = {}
    elif name == "done":
        plan = {shape.status: shape.done, shape.due: None, shape.token: None}
        plan[shape.attempted_at] = now
        if shape.done_counts_attempt:
            plan[shape.attempts] = attempts
    elif name == "nack":
        plan = {shape.due: at, shape.token: None, **failure}
        if shape.retrying is not None:
            plan[shape.status] = shape.retrying
    elif name == "bury":
        plan = {shape.status: shape.dead, shape.due: None, shape.token: None, **failure}
    elif name == "release":
        plan = {shape.due: at, shape.token: None}
    elif name == "extend":
        plan = {shape.due: at}
    else:
        raise ValueError(f"unknown settle statement {name!r}")
    return plan


def settle(shape: Shape, name: SettleName) -> Delete | Update:
    """A settle statement guarded by (id, lock token), built once per table, with named
    parameters ``s_id`` and ``s_token`` plus those of :func:`settle_plan`. Building it once
    spares each call the construction and cache-key walk."""
    guard = and_(
        shape.id == bindparam("s_id", type_=shape.id.type),
        shape.token == bindparam("s_token", type_=shape.token.type),
    )
    if name == "ack":
        return delete(shape.table).where(guard)
    values = {
        column: bindparam(str(v), type_=column.type) if isinstance(v, Param) else v
        for column, v in settle_plan(shape, name).items()
    }
    return update(shape.table).where(guard).values({**values, **keeping(shape)})


def restart_values(
    shape: Shape, now: datetime, when: datetime, held: str, old_token: ColumnElement[str]
) -> list[tuple[Any, Any]]:
    """SET clauses, in order (MySQL evaluates them left to right on updated values), that start
    a fresh run due at ``when``: attempts back to 0, no lease.

    A row in flight (a lease that has not run out) is held for the old delivery instead, as an
    offer holds a message it updates (:func:`~sqla_delayedq._rules.hold`): it stays in flight
    until the old lease's end, under the token ``held`` (the held prefix for ``when``) followed
    by the old token (``old_token``: the old token inside an already-held one).
    """
    in_flight = and_(shape.token.is_not(None), shape.due > literal(now, DateTimeUTC()))
    old = case((is_held(shape.token), old_token), else_=shape.token)
    return [
        (shape.token, case((in_flight, literal(held, String) + old), else_=None)),
        # On MySQL the token is already the new one here: held (not NULL) exactly when the row
        # was in flight, and its lease end is still the due time.
        (shape.due, case((in_flight, shape.due), else_=literal(when, DateTimeUTC()))),
        (shape.attempts, 0),
    ]


def select_held(shape: Shape, row_id: Any, token: str) -> Select[Any]:
    """The (token, due) of the row ``row_id`` when an offer holds it for the delivery of
    ``token`` (see :func:`~sqla_delayedq._rules.hold`), locked."""
    held = shape.token.endswith(HELD + token, autoescape=True)
    return select(shape.token, shape.due).where(shape.id == row_id, held).with_for_update()


def tokens_of(shape: Shape, ids: Sequence[Any]) -> Select[Any]:
    """The (id, lock token) of the rows ``ids``, unlocked (a primary-key read)."""
    return select(shape.id, shape.token).where(shape.id.in_(ids))


def set_held(
    shape: Shape, row_id: Any, held_token: str, token: str | None, due: datetime
) -> Update:
    """Lengthen a hold (a new held token and due time) or end it (``token`` None)."""
    guard = and_(shape.id == row_id, shape.token == held_token)
    values = {shape.token: token, shape.due: due, **keeping(shape)}
    return update(shape.table).where(guard).values(values)


def settled_values(shape: Shape, name: SettleName, params: dict[str, Any]) -> dict[Any, Any]:
    """The values a settle wrote, by column (for objects that mirror the row)."""
    return {
        column: params[str(v)] if isinstance(v, Param) else v
        for column, v in settle_plan(shape, name).items()
    }


def select_due_entities(model: Any, shape: Shape, now: Any, limit: int, lock: Lock) -> Select[Any]:
    """Due entities in order of next attempt, then primary key: a range scan of the index.

    With ``lock="update_skip_locked"`` the rows come back locked and rows other consumers hold
    are skipped, so the entities are loaded in the same statement that picks them.
    """
    stmt = select(model).where(due_filter(shape, None, now)).order_by(shape.due, shape.id)
    return with_lock(stmt.limit(limit), lock).execution_options(populate_existing=True)
