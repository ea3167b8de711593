"""Offers, single and in batches: insert-if-absent, then a compare-and-swap by the offer-mode rule.

A single offer inserts the row as if new; only when the key exists does it read the row and
apply :func:`~sqla_delayedq._rules.offer_changes` with an update guarded by the row as read. A
batch does the same a chunk at a time, with a constant number of statements per chunk, never
one per message:

- Repeated keys inside the batch are folded in Python first, in input order, exactly as
  successive single offers would have acted. Chunks of distinct keys are sorted, so concurrent
  batches lock rows in the same order; except where messages have a group: new rows are then
  inserted in input order, their ids being the group's order among messages due at one time
  (concurrent batches of the same new keys of a group in other orders may then deadlock).
- One insert-if-absent of every key as if new (on PostgreSQL a single ``INSERT ... SELECT FROM
  ROWS FROM (jsonb_array_elements(...), ...)``, one JSON array per column) reports the keys
  it wrote; only the keys it did not write are then read (locked) and updated, with one
  executemany of guarded updates. On MariaDB/MySQL the
  insert already holds those rows exclusively (see ``MySQLStrategy``), so racing batches queue
  for them instead of deadlocking.
- A key deleted between the insert and the read is inserted again; one inserted by a concurrent
  transaction after that goes through the single-offer path, one key at a time.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from itertools import islice
from types import SimpleNamespace
from typing import Any, NamedTuple, Protocol

from sqlalchemy import Connection, Engine, Table, bindparam, update
from sqlalchemy.orm import Session

from . import _statements as st
from ._codec import Codec, check_name, check_names
from ._dialects import NewRow, Strategy, is_transient, strategy_for, strategy_for_bind
from ._rules import new_row, offer_changes
from ._time import require_aware
from ._types import OfferMode, OfferResult, Outcome
from ._wakeup import announce, committed, notify_pending, payload
from .errors import ConcurrentUpdate, InvalidArgument
from .models import KEY_MAX, table_key

log = logging.getLogger("sqla_delayedq")

__all__ = ["OfferInput", "Target", "message_key", "offer_batch", "offer_one"]

#: One message of a batch: ``(key, payload)``, ``(key, payload, at)`` or ``(key, payload, at,
#: group)``; ``key``, ``at`` and ``group`` may be None.
OfferInput = (
    tuple[str | None, Any]
    | tuple[str | None, Any, datetime | None]
    | tuple[str | None, Any, datetime | None, str | None]
)

#: How many times a compare-and-swap is retried before giving up; each lost round means another
#: transaction changed the row in between, which row locks make rare outside SQLite.
CAS_ROUNDS = 32
#: Bound parameters per inserted row, with headroom.
PARAMS_PER_ROW = 12
MAX_CHUNK = 1000


class Target(Protocol):
    """What an offer needs of a queue."""

    @property
    def name(self) -> str: ...
    @property
    def table(self) -> Table: ...
    @property
    def codec(self) -> Codec[Any]: ...
    @property
    def notify(self) -> bool: ...
    def now(self) -> datetime: ...
    def _check_group(self, group: str | None) -> str | None: ...


def message_key(key: str | None) -> str:
    """The caller's key, checked; a fresh random one when None."""
    return uuid.uuid4().hex if key is None else check_name(key, "key", KEY_MAX)


def wake(q: Target, session: Session, strategy: Strategy, count: int) -> None:
    """Wake ``count`` idle consumers when the transaction commits (see :mod:`._wakeup`)."""
    if q.notify and count:
        announce(session, strategy, table_key(q.table), q.name, count)


# -- one message -------------------------------------------------------------------------------


def offer_one(
    q: Target,
    session: Session,
    strategy: Strategy,
    key: str,
    payload: dict[str, Any],
    at: datetime | None,
    now: datetime,
    mode: OfferMode,
    group: str | None = None,
) -> Outcome:
    """Insert-if-absent, else compare-and-swap by the offer-mode rule (no wake-up); ``group``
    is the new row's."""
    t = q.table
    row = new_row(q.name, key, payload, at or now, now, group)
    for _ in range(CAS_ROUNDS):
        if _insert_new(q, session, strategy, row):
            return Outcome.CREATED
        if mode is OfferMode.SKIP:
            return Outcome.IGNORED
        found = session.execute(st.select_by_key(t, q.name, key, strategy.offer_lock)).first()
        if found is None:
            continue  # acknowledged and deleted in between: insert again
        same = q.codec.same(found, payload)
        changes = offer_changes(found, payload, same, at, now, mode)
        if changes is None:
            return Outcome.IGNORED
        stmt = st.guarded_update(t, found.id, found.scheduled_at, found.lock_token).values(changes)
        if st.affected(session, stmt) == 1:
            return Outcome.UPDATED
    raise ConcurrentUpdate(
        f"offer of key {key!r} lost {CAS_ROUNDS} races in a row; retry the transaction"
    )


def _insert_new(q: Target, session: Session, strategy: Strategy, row: dict[str, Any]) -> bool:
    """Insert-if-absent; True when the row is new (its ``NOTIFY`` rides along where it can)."""
    notify = _notify_on_insert(q, session, strategy)
    if not strategy.insert_one(session, q.table, row, notify=notify):
        return False
    if notify is not None:
        announce(session, strategy, table_key(q.table), q.name, sent=1, carried=notify)
    return True


#: Tries of an offer on an Engine (see :func:`offer_on_engine`).
ENGINE_ATTEMPTS = 5


def offer_on_engine(
    q: Target,
    engine: Engine,
    key: str,
    payload: dict[str, Any],
    at: datetime | None,
    now: datetime,
    mode: OfferMode,
    group: str | None = None,
) -> Outcome:
    """:func:`offer_alone` on a connection of ``engine``, made again (at once, up to
    ``ENGINE_ATTEMPTS`` tries) when the database refuses it for now. The offer owns its whole
    transaction, so nothing of a refused try remains; a deadlock with a consumer on the same
    key (MariaDB/MySQL: the take holds the row and waits for the key, the upsert the reverse)
    is this backend's ordinary answer, not the caller's to handle. A try whose commit's reply
    was lost is found made by the next: a key that is there already (``IGNORED``, or
    ``UPDATED`` when another offer changed it meanwhile)."""
    for attempt in range(1, ENGINE_ATTEMPTS + 1):
        try:
            with engine.connect() as conn:
                return offer_alone(q, conn, key, payload, at, now, mode, group)
        except Exception as exc:
            if attempt == ENGINE_ATTEMPTS or not is_transient(exc):
                raise
            log.info("offer of %r refused for now (try %d), made again: %s", key, attempt, exc)
    raise AssertionError("unreachable")


def offer_alone(
    q: Target,
    conn: Connection,
    key: str,
    payload: dict[str, Any],
    at: datetime | None,
    now: datetime,
    mode: OfferMode,
    group: str | None = None,
) -> Outcome:
    """An offer with no transaction of the caller's, on ``conn``: a connection the caller
    checked out for it alone and closes after (which resets what this sets on it).

    Where the backend gains by it (:attr:`Strategy.autocommit_offer`), a new message is one
    autocommit statement: written, committed and announced in one round trip. An existing key
    (or another backend) takes a short transaction of its own that does what the Session form
    does. Consumers of this process are woken after either commits.
    """
    strategy = strategy_for_bind(conn)
    if strategy.autocommit_offer:
        # On the connection itself, without a Session (a Session and its commit cost more than
        # the statement): the insert carries its own NOTIFY (see _insert_new).
        row = new_row(q.name, key, payload, at or now, now, group)
        conn.execution_options(isolation_level="AUTOCOMMIT")
        notify = _notify_on_insert(q, None, strategy)
        created = strategy.insert_one(conn, q.table, row, notify=notify)
        conn.commit()  # ends SQLAlchemy's transaction object; the statement committed itself
        if created:
            if q.notify:
                committed(table_key(q.table), q.name, 1)
            return Outcome.CREATED
        if mode is OfferMode.SKIP:
            return Outcome.IGNORED
        conn.execution_options(isolation_level=conn.default_isolation_level)
    with Session(conn) as s, s.begin():
        outcome = offer_one(q, s, strategy, key, payload, at, now, mode, group)
        if outcome is not Outcome.IGNORED:
            wake(q, s, strategy, 1)
    return outcome


def _notify_on_insert(q: Target, session: Session | None, strategy: Strategy) -> str | None:
    """The queue to wake from the insert itself (PostgreSQL piggybacks ``NOTIFY`` on it);
    ``session`` None: a statement that commits on its own, with nothing announced before it."""
    if not (q.notify and strategy.has_notify):
        return None
    if session is not None and not notify_pending(session, table_key(q.table), q.name):
        return None
    return q.name


# -- a batch -----------------------------------------------------------------------------------


class _Item:
    """One message of a batch. For a key offered once in the batch, the item is also the row its
    insert writes (a :class:`~._dialects.NewRow`). Its payload is serialized by the batch (see
    :func:`_serialize`): stored on it, or, where a chunk's payloads were encoded as one array,
    again from the payload when the text itself is needed (an existing key to compare). Its row
    values (payload decoded) are built only when an existing row must be compared with it."""

    __slots__ = (
        "_codec",
        "_text",
        "_values",
        "at",
        "group",
        "headers",
        "key",
        "outcome",
        "payload",
        "priority",
        "raw",
    )
    #: A new message's first due time is its due time.
    at0 = None

    def __init__(
        self,
        codec: Codec[Any],
        key: str,
        payload: Any,
        at: datetime | None,
        group: str | None,
        headers: str | None,
        priority: int,
    ) -> None:
        self._codec, self.key, self.payload, self.at = codec, key, payload, at
        self.outcome = Outcome.IGNORED  # until an insert or an update says otherwise
        self.headers, self.group, self.priority = headers, group, priority
        self._text: str | None = None
        self.raw: bytes | None = None
        self._values: dict[str, Any] | None = None

    def stored_size(self) -> int:
        """The length of the text its row carries: the payload as serialized (characters, or
        bytes) and the headers."""
        stored = self.raw if self._text is None else self._text
        return (0 if stored is None else len(stored)) + len(self.headers or "")

    def store(self, stored: str | bytes) -> None:
        """Keep the payload as serialized."""
        if type(stored) is str:
            self._text = stored
        else:
            self.raw = stored  # type: ignore[assignment]  # bytes

    @property
    def text(self) -> str | None:
        """The payload as stored JSON text; None for bytes."""
        if self._text is None and self.raw is None:
            self.store(self._codec.serialize(self.payload))  # checked with its chunk already
        return self._text

    @property
    def values(self) -> dict[str, Any]:
        """The columns an offer of this message writes: the payload's and the headers."""
        if self._values is None:
            text = self.text
            stored = text if text is not None else self.raw
            self._values = self._codec.columns(stored)  # type: ignore[arg-type]  # one is set
            self._values["headers"] = self.headers
            self._values["priority"] = self.priority
        return self._values


class _Folded(NamedTuple):
    """The row of a key offered more than once in a batch, its offers applied in order."""

    key: str
    text: str | None
    raw: bytes | None
    at: datetime | None
    at0: datetime | None
    headers: str | None
    group: str | None
    priority: int


def _batched(items: Sequence[str], size: int) -> Iterable[list[str]]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def chunk_size(strategy: Strategy) -> int:
    return max(1, min(MAX_CHUNK, strategy.max_params // PARAMS_PER_ROW))


def _by_size(chunks: list[list[str]], by_key: _ByKey, most: int) -> list[list[str]]:
    """``chunks`` split where the text their rows carry (serialized payloads and headers) may
    pass ``most`` characters; a row larger than that goes alone. A key offered more than once
    counts every offer: its row carries one of them, folded (the last, under ``replace``)."""
    out: list[list[str]] = []
    for keys in chunks:
        part: list[str] = []
        size = 0
        for key in keys:
            n = sum(item.stored_size() for item in by_key[key])
            if part and size + n > most:
                out.append(part)
                part, size = [], 0
            part.append(key)
            size += n
        out.append(part)
    return out


_SHAPE = "a (key, payload[, at[, group]]) tuple"


def _validate(
    q: Target,
    messages: Iterable[OfferInput],
    headers: str | None,
    group: str | None,
    priority: int,
) -> list[_Item]:
    """Every message checked and serialized, before any SQL runs. A hot loop: each message is
    unpacked once, then the keys and the payloads are checked a whole batch at a time."""
    keys: list[Any] = []
    payloads: list[Any] = []
    own: dict[int, tuple[datetime | None, str | None]] = {}  # messages with a time or group
    add_key, add_payload, new_key = keys.append, payloads.append, uuid.uuid4
    for i, message in enumerate(messages):
        if not isinstance(message, tuple) or not 2 <= len(message) <= 4:
            raise InvalidArgument(f"messages[{i}] must be {_SHAPE}")
        if len(message) == 2:
            key, payload = message
        else:
            key, payload, at, *rest = message
            if at is not None:
                at = require_aware(at, f"messages[{i}] at")
            own[i] = (at, q._check_group(rest[0]) if rest and rest[0] is not None else group)
        add_key(new_key().hex if key is None else key)
        add_payload(payload)
    check_names(keys, "key", KEY_MAX)
    codec = q.codec
    if not own:
        return [
            _Item(codec, k, p, None, group, headers, priority)
            for k, p in zip(keys, payloads, strict=True)
        ]
    return [
        _Item(codec, k, p, *own.get(i, (None, group)), headers, priority)
        for i, (k, p) in enumerate(zip(keys, payloads, strict=True))
    ]


def _serialize(
    codec: Codec[Any], items: list[_Item], by_key: _ByKey, chunks: list[list[str]], arrays: bool
) -> list[str | None]:
    """Every payload serialized and checked, before any SQL runs; for each chunk, its payloads
    as one JSON array in its rows' order, or None.

    With ``arrays`` (the strategy takes a chunk's payloads as one array) and every key offered
    once, each chunk's payloads are encoded by one encoder call
    (:meth:`~._codec.Codec.serialize_array`), which costs less than a call per payload;
    otherwise, or for a serializer other than the plain JSON one, each message's payload is
    serialized and kept on it.
    """
    if arrays and not by_key.repeated:
        first = by_key.first
        encoded = [codec.serialize_array([first[key].payload for key in keys]) for keys in chunks]
        if None not in encoded:
            return encoded
    for item, stored in zip(items, codec.serialize_many([i.payload for i in items]), strict=True):
        item.store(stored)
    return [None] * len(chunks)


def offer_batch(
    q: Target,
    session: Session,
    messages: Iterable[OfferInput],
    mode: OfferMode,
    headers: str | None = None,
    group: str | None = None,
    priority: int = 0,
) -> list[OfferResult]:
    """Offer many messages: one outcome per message, in input order (see the module);
    ``headers`` (stored form) and ``priority`` go with each, and ``group`` with each that is
    created."""
    now = q.now()
    items = _validate(q, messages, headers, group, priority)
    if not items:
        return []
    by_key = _ByKey(items)
    strategy = strategy_for(session)
    keys = list(by_key.first)
    in_order = group is not None or any(i.group is not None for i in by_key.first.values())
    if not in_order:
        keys.sort()  # concurrent batches lock in one order
    chunks = list(_batched(keys, chunk_size(strategy)))
    arrays = _serialize(q.codec, items, by_key, chunks, strategy.payload_arrays)
    if strategy.max_chunk_chars is not None and None in arrays:
        chunks = _by_size(chunks, by_key, strategy.max_chunk_chars)
        arrays = [None] * len(chunks)
    for keys, array in zip(chunks, arrays, strict=True):
        _offer_chunk(q, session, strategy, keys, by_key, mode, now, array, in_order)
    outcomes = [item.outcome for item in items]
    wake(q, session, strategy, len(outcomes) - outcomes.count(Outcome.IGNORED))
    # tuple.__new__ is what the named tuple's own __new__ calls, less a Python call per result.
    new = tuple.__new__
    return [new(OfferResult, (item.key, item.outcome)) for item in items]


class _ByKey:
    """A batch's offers by key. Most batches offer each key once: those keep one item per key
    and build the lists of repeated keys' offers only when there are any (a list per message
    costs the batch's hot loop more than its insert statement's parameters do)."""

    __slots__ = ("first", "repeated")

    def __init__(self, items: list[_Item]) -> None:
        self.first: dict[str, _Item] = {}
        for item in items:
            self.first.setdefault(item.key, item)
        self.repeated: dict[str, list[_Item]] = {}
        if len(self.first) != len(items):
            for item in items:
                self.repeated.setdefault(item.key, []).append(item)

    def __getitem__(self, key: str) -> list[_Item]:
        """The offers of ``key``, in input order."""
        return self.repeated.get(key) or [self.first[key]]

    def single(self, key: str) -> _Item | None:
        """The one offer of ``key``, or None when the batch offers it more than once."""
        offers = self.repeated.get(key)
        return self.first[key] if offers is None or len(offers) == 1 else None


def _fold(
    q: Target, key: str, items: list[_Item], row: Any, mode: OfferMode, now: datetime
) -> tuple[Any, dict[str, Any], list[tuple[_Item, Outcome]]]:
    """Apply a key's offers in input order to ``row`` (None: absent), as single offers would.

    Returns the final state, the accumulated changes to an existing row, and the outcomes.
    """
    state: Any = row
    changes: dict[str, Any] = {}
    outcomes: list[tuple[_Item, Outcome]] = []
    for item in items:
        if state is None:
            fresh = new_row(q.name, key, item.values, item.at or now, now, item.group)
            state = SimpleNamespace(**fresh, lock_token=None)
            outcomes.append((item, Outcome.CREATED))
            continue
        step = None
        if mode is not OfferMode.SKIP:
            same = q.codec.same(state, item.values)
            step = offer_changes(state, item.values, same, item.at, now, mode)
        if step is None:
            outcomes.append((item, Outcome.IGNORED))
            continue
        outcomes.append((item, Outcome.UPDATED))
        changes.update(step)
        state = SimpleNamespace(**{**_as_dict(state), **step})
    return state, changes, outcomes


def _folded_row(key: str, state: Any) -> _Folded:
    """The row to insert for a key whose offers were folded into ``state``."""
    text = None if state.payload is None else json.dumps(state.payload)
    return _Folded(
        key,
        text,
        state.payload_bytes,
        state.scheduled_at,
        state.scheduled_at_initially,
        state.headers,
        state.group_key,
        state.priority,
    )


def _offer_chunk(
    q: Target,
    session: Session,
    strategy: Strategy,
    keys: list[str],
    by_key: _ByKey,
    mode: OfferMode,
    now: datetime,
    payloads: str | None = None,
    in_order: bool = False,
) -> None:
    """Offer one chunk of distinct keys; ``payloads``: their payloads as one JSON array, in the
    chunk's order (see :func:`_serialize`), or None; ``in_order``: the chunk is in input order
    (a group's), not sorted."""
    t = q.table
    # Optimistic: most batches are new keys. Insert every key as if absent; read back only the
    # keys that were not written (they exist, or a concurrent transaction got there first). A
    # key offered once is inserted as its item; a repeated one as its offers folded.
    rows: list[NewRow] = []
    folded: dict[str, list[tuple[_Item, Outcome]]] = {}
    if not by_key.repeated:
        rows = [by_key.first[key] for key in keys]
    else:
        for key in keys:
            single = by_key.single(key)
            if single is not None:
                rows.append(single)
            else:
                state, _, folded[key] = _fold(q, key, by_key[key], None, mode, now)
                rows.append(_folded_row(key, state))
    notify = _notify_on_insert(q, session, strategy)
    written = strategy.insert_rows(
        session,
        t,
        q.name,
        q.codec.type_name,
        now,
        rows,
        notify=notify,
        payloads=payloads,
        in_order=in_order,
    )
    if notify is not None and written:
        sent = len(written)
        announce(session, strategy, table_key(t), q.name, sent=sent, carried=payload(q.name, sent))
    if len(written) == len(rows) and not folded:  # the common case: every key was new
        for item in rows:
            item.outcome = Outcome.CREATED  # type: ignore[attr-defined]  # all items here
        return
    for row in rows:
        if row.key not in written:
            continue
        if isinstance(row, _Item):
            row.outcome = Outcome.CREATED
        else:
            for item, outcome in folded[row.key]:
                item.outcome = outcome
    keys = [k for k in keys if k not in written]
    if not keys or mode is OfferMode.SKIP:
        return  # the rest stay IGNORED

    existing = {
        r.key: r for r in session.execute(st.select_by_keys(t, q.name, keys, strategy.batch_lock))
    }
    inserts: list[NewRow] = []
    updates: list[tuple[Any, dict[str, Any]]] = []
    for key in keys:
        found = existing.get(key)
        state, changes, applied = _fold(q, key, by_key[key], found, mode, now)
        for item, outcome in applied:
            item.outcome = outcome
        if found is None:
            inserts.append(_folded_row(key, state))
        elif changes:
            updates.append((found, changes))
    written = (
        strategy.insert_rows(session, t, q.name, q.codec.type_name, now, inserts)
        if inserts
        else set()
    )
    if updates:
        _update_chunk(session, t, updates)
    for key in (row.key for row in inserts):
        if key in written:
            continue
        # Inserted by a concurrent transaction after our SELECT: replay its offers singly.
        for item in by_key[key]:
            item.outcome = offer_one(
                q, session, strategy, key, item.values, item.at, now, mode, item.group
            )


def _as_dict(state: Any) -> dict[str, Any]:
    if isinstance(state, SimpleNamespace):
        return dict(vars(state))
    return dict(state._mapping)


def _update_chunk(session: Session, t: Table, updates: list[tuple[Any, dict[str, Any]]]) -> None:
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
