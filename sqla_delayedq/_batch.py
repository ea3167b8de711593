"""Batch offer and batch ack: a constant number of statements per chunk, never one per message.

Repeated keys inside the batch are folded in Python first, in input order, exactly as successive
single offers would have acted. Chunks of distinct keys are sorted, so concurrent batches lock
rows in the same order. Per chunk:

- PostgreSQL and SQLite insert first: one insert-if-absent of every key as if new (on PostgreSQL a
  single ``INSERT ... SELECT FROM unnest(...)``) that reports the keys it wrote; only the keys
  it did not write are then read (locked) and updated.
- MariaDB/MySQL read first, ``FOR UPDATE``: their insert-if-absent leaves shared locks on
  existing rows, and upgrading those for the update would deadlock racing offers.

The update is one executemany of guarded updates. A key that a concurrent transaction inserted
between the read and the insert goes through the single-offer path, one key at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from itertools import islice
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import bindparam, delete, update
from sqlalchemy.orm import Session

from . import _statements as st
from ._dialects import Strategy, strategy_for
from ._time import require_aware
from ._types import Envelope, OfferMode, OfferResult, Outcome
from .errors import ConcurrentUpdate, InvalidArgument

if TYPE_CHECKING:
    from ._queue import DelayedQueue, OfferInput

#: Bound parameters per inserted row, with headroom.
PARAMS_PER_ROW = 12
MAX_CHUNK = 1000


class NewRow(NamedTuple):
    """A row a batch inserts: the payload as JSON text or bytes; ``at`` None means now."""

    key: str
    text: str | None
    raw: bytes | None
    at: datetime | None
    at0: datetime | None


class _Item:
    """One message of a batch, serialized once; its row values are decoded only if needed."""

    __slots__ = ("_q", "_values", "at", "index", "key", "stored")

    def __init__(
        self, q: DelayedQueue[Any], index: int, key: str, stored: str | bytes, at: datetime | None
    ) -> None:
        self._q, self.index, self.key, self.stored, self.at = q, index, key, stored, at
        self._values: dict[str, Any] | None = None

    @property
    def values(self) -> dict[str, Any]:
        if self._values is None:
            self._values = self._q._stored(self.stored)
        return self._values

    def new_row(self) -> NewRow:
        if isinstance(self.stored, str):
            return NewRow(self.key, self.stored, None, self.at, None)
        return NewRow(self.key, None, self.stored, self.at, None)


def _batched(items: Sequence[str], size: int) -> Iterable[list[str]]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def chunk_size(strategy: Strategy) -> int:
    return max(1, min(MAX_CHUNK, strategy.max_params // PARAMS_PER_ROW))


def _validate(q: DelayedQueue[Any], messages: Iterable[OfferInput], now: datetime) -> list[_Item]:
    items: list[_Item] = []
    append, key_of, serialize = items.append, q._key, q._serialize  # looked up once: hot loop
    for i, message in enumerate(messages):
        if not isinstance(message, tuple):
            raise InvalidArgument(f"messages[{i}] must be a (key, payload[, at]) tuple")
        size = len(message)
        if size == 2:
            at = None
        elif size == 3:
            at_arg = message[2]  # type: ignore[misc]  # the size was just checked
            at = None if at_arg is None else require_aware(at_arg, f"messages[{i}] at")
        else:
            raise InvalidArgument(f"messages[{i}] must be a (key, payload[, at]) tuple")
        append(_Item(q, i, key_of(message[0]), serialize(message[1]), at))
    return items


def offer_batch(
    q: DelayedQueue[Any], session: Session, messages: Iterable[OfferInput], mode: OfferMode
) -> list[OfferResult]:
    now = q.now()
    items = _validate(q, messages, now)
    if not items:
        return []
    by_key: dict[str, list[_Item]] = {}
    for item in items:
        by_key.setdefault(item.key, []).append(item)
    strategy = strategy_for(session)
    outcomes: list[Outcome | None] = [None] * len(items)
    for keys in _batched(sorted(by_key), chunk_size(strategy)):
        _offer_chunk(q, session, strategy, keys, by_key, mode, now, outcomes)
    if any(o is not Outcome.IGNORED for o in outcomes):
        q._wake(session, strategy)
    return [OfferResult(item.key, o) for item, o in zip(items, outcomes, strict=True)]  # type: ignore[arg-type]


def _fold(
    q: DelayedQueue[Any], key: str, items: list[_Item], row: Any, mode: OfferMode, now: datetime
) -> tuple[Any, dict[str, Any], list[tuple[int, Outcome]]]:
    """Apply a key's offers in input order to ``row`` (None: absent), as single offers would.

    Returns the final state, the accumulated changes to an existing row, and the outcomes.
    """
    state: Any = row
    changes: dict[str, Any] = {}
    outcomes: list[tuple[int, Outcome]] = []
    for item in items:
        if state is None:
            state = SimpleNamespace(
                **q._new_row(key, item.values, item.at or now, now), lock_token=None
            )
            outcomes.append((item.index, Outcome.CREATED))
            continue
        step = (
            None if mode is OfferMode.SKIP else q._changes(state, item.values, item.at, now, mode)
        )
        if step is None:
            outcomes.append((item.index, Outcome.IGNORED))
            continue
        outcomes.append((item.index, Outcome.UPDATED))
        changes.update(step)
        state = SimpleNamespace(**{**_as_dict(state), **step})
    return state, changes, outcomes


def _insert_row(key: str, state: Any) -> NewRow:
    """The row to insert for a key whose offers were folded into ``state``."""
    text = None if state.payload is None else json.dumps(state.payload)
    return NewRow(key, text, state.payload_bytes, state.scheduled_at, state.scheduled_at_initially)


def _plan_new(
    q: DelayedQueue[Any], key: str, items: list[_Item], mode: OfferMode, now: datetime
) -> tuple[NewRow, list[tuple[int, Outcome]]]:
    """The row and outcomes of a key that does not exist yet."""
    if len(items) == 1:  # the common case: no folding, the payload stays as serialized
        return items[0].new_row(), [(items[0].index, Outcome.CREATED)]
    state, _, outcomes = _fold(q, key, items, None, mode, now)
    return _insert_row(key, state), outcomes


def _offer_chunk(
    q: DelayedQueue[Any],
    session: Session,
    strategy: Strategy,
    keys: list[str],
    by_key: dict[str, list[_Item]],
    mode: OfferMode,
    now: datetime,
    outcomes: list[Outcome | None],
) -> None:
    t = q.table
    if strategy.batch_insert_first:
        # Optimistic: most batches are new keys. Insert every key as if absent; read back only
        # the keys that were not written (they exist, or a concurrent transaction got there).
        plans = {key: _plan_new(q, key, by_key[key], mode, now) for key in keys}
        written = _insert_chunk(
            q, session, strategy, now, {k: plan[0] for k, plan in plans.items()}
        )
        for key in written:
            for index, outcome in plans[key][1]:
                outcomes[index] = outcome
        keys = [k for k in keys if k not in written]
        if not keys:
            return
        if mode is OfferMode.SKIP:
            for key in keys:
                for item in by_key[key]:
                    outcomes[item.index] = Outcome.IGNORED
            return

    lock = None if mode is OfferMode.SKIP else strategy.batch_lock
    existing = {r.key: r for r in session.execute(st.select_by_keys(t, q.name, keys, lock))}
    inserts: dict[str, NewRow] = {}
    updates: list[tuple[Any, dict[str, Any]]] = []
    for key in keys:
        row = existing.get(key)
        state, changes, folded = _fold(q, key, by_key[key], row, mode, now)
        for index, outcome in folded:
            outcomes[index] = outcome
        if row is None:
            inserts[key] = _insert_row(key, state)
        elif changes:
            updates.append((row, changes))
    written = _insert_chunk(q, session, strategy, now, inserts) if inserts else set()
    if updates:
        _update_chunk(session, t, updates)
    for key in inserts:
        if key in written:
            continue
        # Inserted by a concurrent transaction after our SELECT: replay its offers singly.
        for item in by_key[key]:
            outcomes[item.index] = q._offer_one(
                session, strategy, key, item.values, item.at, now, mode
            )


def _as_dict(state: Any) -> dict[str, Any]:
    if isinstance(state, SimpleNamespace):
        return dict(vars(state))
    return dict(state._mapping)


def _insert_chunk(
    q: DelayedQueue[Any],
    session: Session,
    strategy: Strategy,
    now: datetime,
    inserts: dict[str, NewRow],
) -> set[str]:
    """Insert rows for absent keys, in key order; return the keys actually written."""
    rows = [inserts[k] for k in sorted(inserts)]
    t, queue, type_name = q.table, q.name, q.serializer.type_name
    if strategy.insert_returning:
        return strategy.insert_rows(session, t, queue, type_name, now, rows) or set()
    # No RETURNING (MySQL): all-or-nothing per chunk inside a savepoint.
    savepoint = session.begin_nested()
    written = strategy.insert_rows(session, t, queue, type_name, now, rows)
    if written is None:
        savepoint.rollback()  # cannot tell which rows were ours: the caller redoes them singly
        return set()
    savepoint.commit()
    return written


def _update_chunk(session: Session, t: Any, updates: list[tuple[Any, dict[str, Any]]]) -> None:
    groups: dict[frozenset[str], list[dict[str, Any]]] = {}
    for row, changes in updates:
        params = {f"new_{k}": v for k, v in changes.items()}
        params |= {"row_id": row.id, "seen_at": row.scheduled_at, "seen_token": row.lock_token}
        groups.setdefault(frozenset(changes), []).append(params)
    for columns, rows in groups.items():
        stmt = (
            update(t)
            .where(
                t.c.id == bindparam("row_id"),
                t.c.scheduled_at.is_not_distinct_from(
                    bindparam("seen_at", type_=t.c.scheduled_at.type)
                ),
                t.c.lock_token.is_not_distinct_from(
                    bindparam("seen_token", type_=t.c.lock_token.type)
                ),
            )
            .values({c: bindparam(f"new_{c}", type_=t.c[c].type) for c in sorted(columns)})
        )
        result: Any = session.execute(stmt, rows)
        if result.context.dialect.supports_sane_multi_rowcount and result.rowcount != len(rows):
            raise ConcurrentUpdate(
                f"{len(rows) - result.rowcount} rows of a batch changed under their lock; "
                "roll back and retry the transaction"
            )


def ack_many(q: DelayedQueue[Any], session: Session, envelopes: Sequence[Envelope[Any]]) -> int:
    """One statement for the whole batch: tokens embed the row id, so they identify the take."""
    t = q.table
    cond = strategy_for(session).ack_by_tokens(
        t, [e.id for e in envelopes], [e.lock_token for e in envelopes]
    )
    if q.retention is None:
        stmt: Any = delete(t).where(*cond)
    else:
        stmt = (
            update(t)
            .where(*cond)
            .values(status="done", scheduled_at=None, lock_token=None, last_attempt_at=q.now())
        )
    return st.affected(session, stmt)
