"""The cron service: recurring ticks, stored ahead of time as ordinary messages of a queue.

A :class:`CronConfig` names a key prefix, a schedule (:class:`PeriodicTick`,
:class:`DailySchedule` or :class:`CronSchedule`) and an optional JSON payload template. Installing
it writes one message per tick for a look-ahead window, keyed::

    {prefix}/{config hash}/{UTC timestamp}        e.g.  reports/3f9a0c12b4e7/20300101T120000Z

and whatever consumes the queue handles the ticks like any other message (its payload is a
:class:`CronTick`). Install in the caller's transaction with :func:`install_tick`, or start a
background thread that re-installs on an interval with :func:`install` (or
:meth:`CronService.install`); remove a configuration with :func:`uninstall_tick`; list what is
installed with :func:`list_cron`.

How it stays correct with many installers and a changing configuration:

- **One state row per prefix** (key ``{prefix}/cron-state``, status ``done``, never polled) holds
  the configuration hash and the instant up to which ticks have been generated (in
  ``scheduled_at_initially``). Every pass locks it (``SELECT ... FOR UPDATE``; SQLite transactions
  are serialised anyway), so installers of one prefix, in any number of threads and processes,
  take turns, and a pass only creates ticks past that instant: a tick is created once, and never
  again after it was delivered and deleted, even by an installer whose clock lags.
- **The config hash** is a digest of the schedule and the payload template. When it differs from
  the stored one, the old configuration's *future* ticks (not yet due, not in flight) are deleted
  and generation restarts just after now. Ticks that are due (one at now included), leased by a
  consumer, being retried, dead or kept as done stay where they are: they belong to a time the
  old configuration was in force, so an instant never has a tick of both.
- **Catch-up**: ticks that fell between two passes further apart than the look-ahead (nothing
  was running) are skipped with :attr:`CatchUp.SKIP`; :attr:`CatchUp.LATEST` delivers the latest
  of them once, at once. Ticks already stored are ordinary messages: consumers that were down
  get them late, so keep the look-ahead short if stale ticks matter.
- **Prefixes are matched exactly**: every pattern escapes ``%``, ``_`` and the escape character,
  checks the key's shape (``/`` + 12 characters + ``/`` + 16 characters) and compares the prefix
  byte for byte, so ``a_b`` never touches ``axb``, ``reports`` never touches ``reports/daily``,
  and SQLite's case-insensitive ``LIKE`` never confuses ``A`` with ``a``.

Ticks are JSON documents, so the queue needs a JSON serializer (the default).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Table, and_, case, delete, func, literal_column, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement

from . import _filters as flt
from . import _statements as st
from ._cron_schedules import CronSchedule, DailySchedule, PeriodicTick, Schedule
from ._dialects import Strategy, is_transient, strategy_for
from ._queue import DelayedQueue
from ._time import LONGEST, require_aware, require_duration
from ._types import OfferMode, Outcome, QueueCounts
from .errors import DecodeError, DelayedQueueError, InvalidArgument
from .models import KEY_MAX

__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_LOOKAHEAD",
    "CatchUp",
    "CronConfig",
    "CronHandle",
    "CronInfo",
    "CronSchedule",
    "CronService",
    "CronTick",
    "DailySchedule",
    "InstallResult",
    "PeriodicTick",
    "Schedule",
    "install",
    "install_tick",
    "list_cron",
    "tick_key",
    "uninstall",
    "uninstall_tick",
]

logger = logging.getLogger("sqla_delayedq.cron")

HASH_LEN = 12
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
STAMP_LEN = 16
#: Longest prefix whose keys still fit the key column: ``/`` + hash + ``/`` + timestamp.
PREFIX_MAX = KEY_MAX - (HASH_LEN + STAMP_LEN + 2)
STATE_SUFFIX = "/cron-state"
DEFAULT_LOOKAHEAD = timedelta(hours=1)
DEFAULT_INTERVAL = timedelta(minutes=1)
DEFAULT_MAX_TICKS = 1000
#: Attempts of one configuration's transaction when the database reports a transient error.
TRANSIENT_ATTEMPTS = 3
_ESCAPE = "!"
_MICRO = timedelta(microseconds=1)
#: How long after the pass that installs it a new configuration of a prefix takes over: the old
#: one keeps its ticks up to then. No consumer can take one of those in the moment between the
#: pass reading its time and deleting the old configuration's future ticks, so an instant never
#: gets a tick of each (a change at a tick's instant, or a tick due during the pass).
CHANGE_DELAY = timedelta(seconds=1)
_HASH_RE = re.compile(r"[0-9a-f]{12}")

SessionFactory = Callable[[], Session]


class CatchUp(enum.Enum):
    """What to do with ticks that passed while no installer ran."""

    #: Never create them: the schedule resumes with the next tick.
    SKIP = "skip"
    #: Create the latest of them once, due at once; the others are skipped.
    LATEST = "latest"

    @classmethod
    def parse(cls, value: CatchUp | str) -> CatchUp:
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise InvalidArgument(
                f"unknown catch-up policy {value!r}; use skip or latest"
            ) from None


def check_prefix(prefix: Any) -> str:
    """Validate a key prefix: non-empty, at most :data:`PREFIX_MAX` characters, no final ``/``."""
    if not isinstance(prefix, str):
        raise InvalidArgument(f"prefix must be a string, got {type(prefix).__name__}")
    if not prefix:
        raise InvalidArgument("prefix must not be empty")
    if prefix.endswith("/"):
        raise InvalidArgument(f"prefix {prefix!r} must not end with '/'; it is added for you")
    if "\x00" in prefix:
        raise InvalidArgument("prefix must not contain NUL characters")
    if len(prefix) > PREFIX_MAX:
        raise InvalidArgument(
            f"prefix is {len(prefix)} characters; the limit is {PREFIX_MAX}, so that "
            f"'{{prefix}}/{{hash}}/{{timestamp}}' fits the {KEY_MAX}-character key"
        )
    return prefix


def _check_hash(config_hash: Any) -> str:
    if not isinstance(config_hash, str) or not _HASH_RE.fullmatch(config_hash):
        raise InvalidArgument(f"a config hash is {HASH_LEN} lowercase hex digits: {config_hash!r}")
    return config_hash


def _stamp(at: datetime) -> str:
    return at.astimezone(UTC).strftime(STAMP_FORMAT)


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def tick_key(prefix: str, config_hash: str, at: datetime) -> str:
    """The message key of the tick at ``at``: ``{prefix}/{config_hash}/{YYYYMMDDTHHMMSSZ}``."""
    return f"{check_prefix(prefix)}/{_check_hash(config_hash)}/{_stamp(require_aware(at, 'at'))}"


def state_key(prefix: str) -> str:
    """The key of a prefix's state row."""
    return check_prefix(prefix) + STATE_SUFFIX


@dataclass(frozen=True)
class CronConfig:
    """One recurring job: a key prefix, a schedule, a payload template and a catch-up policy.

    ``config_hash`` (12 hex digits) is the sha256 of a canonical JSON form of the schedule and
    the payload template: equal for equal configurations on every machine, different when
    either changes. The prefix names the job; the catch-up policy is how it is run, so neither
    is part of the hash.
    """

    prefix: str
    schedule: Schedule
    payload: Any = None
    catch_up: CatchUp = CatchUp.SKIP
    config_hash: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        check_prefix(self.prefix)
        if not isinstance(self.schedule, Schedule):
            raise InvalidArgument(
                "schedule must be a PeriodicTick, DailySchedule or CronSchedule, "
                f"got {type(self.schedule).__name__}"
            )
        object.__setattr__(self, "catch_up", CatchUp.parse(self.catch_up))
        canonical = {"v": 1, "schedule": self.schedule.canonical(), "payload": self.payload}
        try:
            text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"payload template is not JSON-serializable: {exc}") from exc
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:HASH_LEN]
        object.__setattr__(self, "config_hash", digest)

    def __hash__(self) -> int:  # the payload template may be a dict; equal configs hash alike
        return hash((self.prefix, self.config_hash, self.catch_up))


@dataclass(frozen=True)
class CronTick:
    """The payload of a tick message, as a handler sees it (see :meth:`from_payload`)."""

    prefix: str
    config_hash: str
    #: The tick's own time (its message may be delivered later).
    scheduled_for: datetime
    #: The configuration's payload template.
    data: Any = None
    #: Created by :attr:`CatchUp.LATEST` for a tick that passed while nothing ran.
    caught_up: bool = False

    @property
    def key(self) -> str:
        return tick_key(self.prefix, self.config_hash, self.scheduled_for)

    def to_payload(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "cron": self.prefix,
            "config": self.config_hash,
            "scheduled_for": _iso(self.scheduled_for),
        }
        if self.data is not None:
            doc["data"] = self.data
        if self.caught_up:
            doc["caught_up"] = True
        return doc

    @classmethod
    def from_payload(cls, payload: Any) -> CronTick:
        """Read a tick from a message payload; :class:`InvalidArgument` if it is not one."""
        try:
            when = datetime.strptime(payload["scheduled_for"], "%Y-%m-%dT%H:%M:%SZ")
            return cls(
                prefix=check_prefix(payload["cron"]),
                config_hash=_check_hash(payload["config"]),
                scheduled_for=when.replace(tzinfo=UTC),
                data=payload.get("data"),
                caught_up=bool(payload.get("caught_up", False)),
            )
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise InvalidArgument(f"not a cron tick payload: {payload!r}") from exc


@dataclass(frozen=True)
class InstallResult:
    """What one install pass did for one configuration."""

    prefix: str
    config_hash: str
    #: Tick messages written by this pass.
    created: int
    #: Future ticks of a previous configuration of the prefix deleted by this pass.
    removed: int
    #: Whether the prefix had another configuration, or none, when this pass began.
    replaced: bool
    #: The missed tick created by :attr:`CatchUp.LATEST`, if any.
    caught_up: datetime | None
    #: Ticks before this instant have been generated.
    installed_until: datetime


@dataclass(frozen=True)
class CronInfo:
    """One configuration of one prefix, as :func:`list_cron` reports it."""

    prefix: str
    config_hash: str
    #: Whether this is the prefix's installed configuration (others only have leftover ticks).
    current: bool
    #: The schedule's canonical form, for the current configuration.
    schedule: dict[str, Any] | None
    catch_up: str | None
    #: When an installer last ran a pass for the prefix.
    installed_at: datetime | None
    installed_until: datetime | None
    #: The earliest tick waiting for a consumer (due or scheduled, not in flight).
    next_tick: datetime | None
    #: The latest pending tick.
    last_tick: datetime | None
    counts: QueueCounts


# -- statements (pure) ---------------------------------------------------------------------


def _like_literal(text: str) -> str:
    return (
        text.replace(_ESCAPE, _ESCAPE * 2).replace("%", _ESCAPE + "%").replace("_", _ESCAPE + "_")
    )


def owned_clause(
    t: Table, queue: str, prefix: str, config_hash: str | None = None
) -> ColumnElement[bool]:
    """Tick messages of ``prefix`` (of one configuration when ``config_hash`` is given).

    The escaped ``LIKE`` pins the key's shape and lets an index serve the prefix; the
    ``substr`` equality compares the prefix exactly, where ``LIKE`` may ignore case (SQLite).
    """
    middle = "_" * HASH_LEN if config_hash is None else _like_literal(config_hash)
    pattern = f"{_like_literal(prefix)}/{middle}/{'_' * STAMP_LEN}"
    head = f"{prefix}/" if config_hash is None else f"{prefix}/{config_hash}/"
    return and_(
        t.c.queue == queue,
        t.c.key.like(pattern, escape=_ESCAPE),
        func.substr(t.c.key, 1, len(head)) == head,
    )


def _hash_expr(t: Table, prefix: str) -> ColumnElement[str]:
    # Literal positions, so that PostgreSQL sees one expression in SELECT and GROUP BY.
    return func.substr(t.c.key, literal_column(str(len(prefix) + 2)), literal_column(str(HASH_LEN)))


def _in_flight(t: Table, now: datetime) -> ColumnElement[bool]:
    return flt.state_clause(t, "in_flight", now)


# -- the state row -------------------------------------------------------------------------


@dataclass(frozen=True)
class _State:
    id: int
    config_hash: str | None
    until: datetime
    since: datetime
    doc: dict[str, Any]


def _check_queue(queue: Any) -> DelayedQueue[Any]:
    if not isinstance(queue, DelayedQueue):
        raise InvalidArgument(f"queue must be a DelayedQueue, got {type(queue).__name__}")
    if queue.serializer.storage != "json":
        raise InvalidArgument(
            f"cron ticks are JSON documents; queue {queue.name!r} stores "
            f"{queue.serializer.storage} payloads: use one with a JsonSerializer"
        )
    return queue


def _check_max_ticks(max_ticks: Any) -> int:
    if not isinstance(max_ticks, int) or isinstance(max_ticks, bool) or max_ticks < 1:
        raise InvalidArgument(f"max_ticks must be a positive integer, got {max_ticks!r}")
    return max_ticks


def _read_state(
    session: Session, strategy: Strategy, queue: DelayedQueue[Any], prefix: str
) -> _State | None:
    """The prefix's state row, locked until the transaction ends (None when absent)."""
    t = queue.table
    stmt = select(
        t.c.id,
        t.c.payload_type,
        t.c.payload,
        t.c.payload_bytes,
        t.c.scheduled_at_initially,
        t.c.created_at,
    ).where(t.c.queue == queue.name, t.c.key == state_key(prefix))
    row = session.execute(st.with_lock(stmt, strategy.row_lock)).first()
    if row is None:
        return None
    try:
        doc = queue.codec.decode(row)
    except DecodeError:
        doc = None
    doc = doc if isinstance(doc, dict) else {}
    config_hash = doc.get("config")
    return _State(
        row.id,
        config_hash if isinstance(config_hash, str) else None,
        row.scheduled_at_initially,
        row.created_at,
        doc,
    )


def _state_doc(
    config: CronConfig, now: datetime, until: datetime, owed: datetime | None = None
) -> dict[str, Any]:
    doc = {
        "cron_state": 1,
        "prefix": config.prefix,
        "config": config.config_hash,
        "schedule": config.schedule.canonical(),
        "payload": config.payload,
        "catch_up": config.catch_up.value,
        "installed_at": now.isoformat(),
        "installed_until": until.isoformat(),
    }
    if owed is not None:  # a pass stopped by max_ticks: its window went on to here
        doc["owed_until"] = owed.isoformat()
    return doc


def _owed_until(state: _State) -> datetime | None:
    owed = state.doc.get("owed_until")
    try:
        return datetime.fromisoformat(owed) if isinstance(owed, str) else None
    except ValueError:
        return None


def _create_state(
    session: Session,
    strategy: Strategy,
    queue: DelayedQueue[Any],
    config: CronConfig,
    now: datetime,
) -> None:
    t = queue.table
    row = {
        "queue": queue.name,
        "key": state_key(config.prefix),
        **queue.codec.values(_state_doc(config, now, now)),
        "status": "done",
        "scheduled_at": None,
        "scheduled_at_initially": now,
        "created_at": now,
        "attempts": 0,
    }
    session.execute(strategy.insert_or_lock(t).values(row))


def _lock_state(
    session: Session,
    strategy: Strategy,
    queue: DelayedQueue[Any],
    config: CronConfig,
) -> tuple[_State, bool]:
    """Lock the prefix's state row, creating it first if needed; also say if it was there."""
    state = _read_state(session, strategy, queue, config.prefix)
    if state is not None:
        return state, True
    _create_state(session, strategy, queue, config, queue.now())
    state = _read_state(session, strategy, queue, config.prefix)
    if state is None:
        raise DelayedQueueError(
            f"the cron state row of {config.prefix!r} was deleted while it was being installed; "
            "retry the transaction"
        )
    return state, False


# -- operations on the caller's Session ------------------------------------------------------


def install_tick(
    session: Session,
    queue: DelayedQueue[Any],
    config: CronConfig,
    *,
    lookahead: timedelta = DEFAULT_LOOKAHEAD,
    max_ticks: int = DEFAULT_MAX_TICKS,
) -> InstallResult:
    """One install pass for ``config`` in the caller's transaction (which it does not commit).

    Creates the ticks from now to ``now + lookahead`` that no earlier pass created (at most
    ``max_ticks``; the next pass continues), applies the catch-up policy to ticks that passed
    since the last pass, and, when the prefix had another configuration, deletes that one's
    future ticks. Holds the prefix's state-row lock until the transaction ends: commit soon.
    """
    queue = _check_queue(queue)
    if not isinstance(config, CronConfig):
        raise InvalidArgument(f"config must be a CronConfig, got {type(config).__name__}")
    lookahead = require_duration(lookahead, "lookahead", most=LONGEST)
    _check_max_ticks(max_ticks)
    strategy = strategy_for(session)
    state, found = _lock_state(session, strategy, queue, config)
    other = state.config_hash != config.config_hash
    # Without a state row, leftovers of any other configuration are stale too. A row another
    # installer created meanwhile holds its progress: only another configuration resets it.
    replaced = other or not found
    if replaced:
        _lock_future(session, queue, config, queue.now())
    # The time of the pass is read once the state row is locked, and the other configuration's
    # future ticks: a pass that waited for a lock (another installer, SQLite's writer lock, on
    # MariaDB/MySQL a transactional handler's tick in the prefix's range) must not start a new
    # configuration before the wait, when a tick that fell due meanwhile may have been
    # delivered already.
    now = queue.now()
    # A change (another configuration, or leftovers of one without a state row): the old one
    # keeps its ticks up to the cut, a tick at the cut included (see CHANGE_DELAY); the new one
    # starts just after it, so no instant gets a tick of each.
    change = other or (not found and _has_others(session, queue, config))
    cut = now + CHANGE_DELAY if change else now
    removed = _drop_future(session, queue, config, cut) if replaced else 0
    until = cut + _MICRO if change else state.until if found else max(state.until, now)
    since = now if other else state.since

    ticks: list[CronTick] = []
    caught_up = None
    owed = None if other else _owed_until(state)
    times: list[datetime] = []
    if owed is not None and until < now:
        # The last pass stopped at max_ticks short of its window: the ticks it left before now
        # are owed (an installer was running), not missed; they are created late, due at once.
        times = config.schedule.between(until, min(owed, now), limit=max_ticks)
        until = times[-1] + _MICRO if len(times) == max_ticks else min(owed, now)
        owed = owed if len(times) == max_ticks else None
    end = now + lookahead
    if len(times) < max_ticks:
        if until < now and config.catch_up is CatchUp.LATEST:
            caught_up = config.schedule.latest_before(now, not_before=until)
            if caught_up is not None:
                ticks.append(
                    CronTick(config.prefix, config.config_hash, caught_up, config.payload, True)
                )
        start = max(until, now)
        if start < end:
            times += config.schedule.between(start, end, limit=max_ticks - len(times))
        owed = end if len(times) == max_ticks else None
    ticks += [CronTick(config.prefix, config.config_hash, at, config.payload) for at in times]
    new_until = times[-1] + _MICRO if len(times) == max_ticks else max(until, end)

    created = 0
    if ticks:
        outcomes = queue.offer_batch(
            session,
            [(tick.key, tick.to_payload(), tick.scheduled_for) for tick in ticks],
            mode=OfferMode.SKIP,
        )
        created = sum(r.outcome is Outcome.CREATED for r in outcomes)
    t = queue.table
    session.execute(
        update(t)
        .where(t.c.id == state.id)
        .values(
            **queue.codec.values(_state_doc(config, now, new_until, owed)),
            scheduled_at_initially=new_until,
            created_at=since,
        )
    )
    return InstallResult(
        config.prefix, config.config_hash, created, removed, replaced, caught_up, new_until
    )


def _has_others(session: Session, queue: DelayedQueue[Any], config: CronConfig) -> bool:
    """Whether the prefix has pending ticks of another configuration (left without a state
    row: ``uninstall_tick`` keeps those in flight, ``delayedq drop`` may remove the row)."""
    t = queue.table
    stmt = select(t.c.id).where(
        owned_clause(t, queue.name, config.prefix),
        _hash_expr(t, config.prefix) != config.config_hash,
        t.c.status == "pending",
    )
    return session.execute(stmt.limit(1)).first() is not None


def _lock_future(
    session: Session, queue: DelayedQueue[Any], config: CronConfig, now: datetime
) -> None:
    """Lock the ticks of the prefix's other configurations due after ``now``: from here no
    consumer takes one of them before this pass ends. On MariaDB/MySQL the scan waits for every
    row of the prefix another transaction holds (a transactional handler's tick too), which the
    pass's delete would otherwise wait for after it read the time."""
    t = queue.table
    stmt = select(t.c.id).where(*_other_future(queue, config, now))
    session.execute(stmt.with_for_update()).all()


def _other_future(
    queue: DelayedQueue[Any], config: CronConfig, now: datetime
) -> tuple[ColumnElement[bool], ...]:
    """The pending ticks of the prefix's other configurations due after ``now``."""
    t = queue.table
    return (
        owned_clause(t, queue.name, config.prefix),
        _hash_expr(t, config.prefix) != config.config_hash,
        t.c.status == "pending",
        t.c.scheduled_at_initially > now,
    )


def _drop_future(
    session: Session, queue: DelayedQueue[Any], config: CronConfig, now: datetime
) -> int:
    """Delete the future ticks of the prefix's other configurations; keep those in flight."""
    t = queue.table
    stmt = delete(t).where(*_other_future(queue, config, now), ~_in_flight(t, now))
    removed = int(session.execute(stmt).rowcount)  # type: ignore[attr-defined]
    if removed:
        logger.info(
            "cron %r: configuration %s replaces the previous one; %d future ticks removed",
            config.prefix,
            config.config_hash,
            removed,
        )
    return removed


def uninstall_tick(
    session: Session, queue: DelayedQueue[Any], prefix: str, config_hash: str | None = None
) -> int:
    """Remove the ticks of one configuration of ``prefix`` (all of them, without ``config_hash``).

    Ticks in flight are kept, so their consumers can still acknowledge them; due, scheduled,
    dead and done ticks are deleted, and the prefix's state row too when it names this
    configuration. Nothing of any other prefix is touched. Returns how many ticks were deleted.
    """
    queue = _check_queue(queue)
    check_prefix(prefix)
    if config_hash is not None:
        _check_hash(config_hash)
    now = queue.now()
    strategy = strategy_for(session)
    state = _read_state(session, strategy, queue, prefix)
    t = queue.table
    stmt = delete(t).where(owned_clause(t, queue.name, prefix, config_hash), ~_in_flight(t, now))
    removed = int(session.execute(stmt).rowcount)  # type: ignore[attr-defined]
    if state is not None and config_hash in (None, state.config_hash):
        session.execute(delete(t).where(t.c.id == state.id))
    return removed


def uninstall(session: Session, queue: DelayedQueue[Any], config: CronConfig) -> int:
    """Remove exactly ``config``'s ticks (see :func:`uninstall_tick`)."""
    if not isinstance(config, CronConfig):
        raise InvalidArgument(f"config must be a CronConfig, got {type(config).__name__}")
    return uninstall_tick(session, queue, config.prefix, config.config_hash)


def list_cron(
    session: Session, queue: DelayedQueue[Any], prefix: str | None = None
) -> list[CronInfo]:
    """The installed cron configurations of ``queue`` (of one prefix), with their ticks.

    One entry per (prefix, config hash): the installed configuration of each prefix, and older
    configurations that still have ticks (in flight, due, dead or done). Sorted by prefix,
    current configuration first.
    """
    queue = _check_queue(queue)
    t = queue.table
    now = queue.now()
    stmt = select(*st.columns(t)).where(t.c.queue == queue.name)
    if prefix is not None:
        stmt = stmt.where(t.c.key == state_key(prefix))
    else:
        stmt = stmt.where(
            t.c.scheduled_at.is_(None),
            t.c.status == "done",
            t.c.key.like("%" + _like_literal(STATE_SUFFIX), escape=_ESCAPE),
        )
    states: dict[str, dict[str, Any]] = {}
    for row in session.execute(stmt):
        try:
            doc = queue.codec.decode(row)
        except DecodeError:
            continue
        if isinstance(doc, dict) and doc.get("cron_state") and row.key.endswith(STATE_SUFFIX):
            states[row.key[: -len(STATE_SUFFIX)]] = {**doc, "_until": row.scheduled_at_initially}
    infos: list[CronInfo] = []
    for name in sorted(states):
        infos.extend(_prefix_infos(session, queue, name, states[name], now))
    return infos


def _prefix_infos(
    session: Session, queue: DelayedQueue[Any], prefix: str, doc: dict[str, Any], now: datetime
) -> list[CronInfo]:
    t = queue.table
    config_hash = _hash_expr(t, prefix)
    waiting = and_(t.c.status == "pending", ~_in_flight(t, now))

    def n(state: str) -> Any:
        return func.coalesce(func.sum(case((flt.state_clause(t, state, now), 1), else_=0)), 0)

    stmt = (
        select(
            config_hash.label("config_hash"),
            n("due"),
            n("scheduled"),
            n("in_flight"),
            n("dead"),
            n("done"),
            func.min(case((waiting, t.c.scheduled_at))).label("next_tick"),
            func.max(case((t.c.status == "pending", t.c.scheduled_at_initially))).label("last"),
        )
        .where(owned_clause(t, queue.name, prefix))
        .group_by(config_hash)
    )
    rows = {r.config_hash: r for r in session.execute(stmt)}
    current = doc.get("config")
    installed_at = doc.get("installed_at")
    hashes = set(rows) | ({current} if isinstance(current, str) else set())
    infos = []
    for h in sorted(hashes, key=lambda h: (h != current, h)):
        r = rows.get(h)
        is_current = h == current
        infos.append(
            CronInfo(
                prefix=prefix,
                config_hash=str(h),
                current=is_current,
                schedule=doc.get("schedule") if is_current else None,
                catch_up=doc.get("catch_up") if is_current else None,
                installed_at=datetime.fromisoformat(installed_at) if installed_at else None,
                installed_until=doc["_until"] if is_current else None,
                next_tick=None if r is None else r.next_tick,
                last_tick=None if r is None else r.last,
                counts=QueueCounts(*(int(v) for v in r[1:6])) if r else QueueCounts(0, 0, 0, 0, 0),
            )
        )
    return infos


# -- the background installer ---------------------------------------------------------------


class CronService:
    """Cron configurations bound to one queue, installed together.

    Use :meth:`install_tick` inside your own transaction, :meth:`run_once` for one pass with
    a transaction per configuration, or :meth:`install` for a background thread.
    """

    def __init__(
        self,
        queue: DelayedQueue[Any],
        configs: CronConfig | Iterable[CronConfig],
        *,
        lookahead: timedelta = DEFAULT_LOOKAHEAD,
        max_ticks: int = DEFAULT_MAX_TICKS,
    ) -> None:
        self.queue = _check_queue(queue)
        self.configs: tuple[CronConfig, ...] = (
            (configs,) if isinstance(configs, CronConfig) else tuple(configs)
        )
        seen: set[str] = set()
        for config in self.configs:
            if not isinstance(config, CronConfig):
                raise InvalidArgument(f"configs must be CronConfigs, got {type(config).__name__}")
            if config.prefix in seen:
                raise InvalidArgument(
                    f"two configurations share the prefix {config.prefix!r}; each would delete "
                    "the other's ticks"
                )
            seen.add(config.prefix)
        self.lookahead = require_duration(lookahead, "lookahead", most=LONGEST)
        self.max_ticks = _check_max_ticks(max_ticks)
        self._last_errors: dict[str, str] = {}

    def __repr__(self) -> str:
        prefixes = ", ".join(c.prefix for c in self.configs)
        return f"CronService({self.queue.name!r}, [{prefixes}])"

    def install_tick(self, session: Session) -> list[InstallResult]:
        """One pass for every configuration, in the caller's transaction."""
        return [
            install_tick(session, self.queue, c, lookahead=self.lookahead, max_ticks=self.max_ticks)
            for c in self.configs
        ]

    def uninstall(self, session: Session) -> int:
        """Remove every configuration of this service, in the caller's transaction."""
        return sum(uninstall(session, self.queue, c) for c in self.configs)

    def installed(self, session: Session) -> list[CronInfo]:
        """:func:`list_cron` for this service's prefixes."""
        return [i for c in self.configs for i in list_cron(session, self.queue, c.prefix)]

    def run_once(self, sessionmaker: SessionFactory) -> list[InstallResult]:
        """One pass, one transaction per configuration, each retried on transient errors.

        A configuration that fails does not stop the others; the first error is raised after
        all were tried (and each is logged).
        """
        results: list[InstallResult] = []
        first: Exception | None = None
        for config in self.configs:
            try:
                results.append(self._install_one(sessionmaker, config))
            except Exception as exc:
                first = first or exc
                text = f"{type(exc).__name__}: {exc}"
                repeated = self._last_errors.get(config.prefix) == text
                self._last_errors[config.prefix] = text
                logger.warning(
                    "installing cron %r on queue %r failed: %s",
                    config.prefix,
                    self.queue.name,
                    text.splitlines()[0],
                    exc_info=not repeated,
                )
            else:
                if self._last_errors.pop(config.prefix, None) is not None:
                    logger.info("installing cron %r works again", config.prefix)
        if first is not None:
            raise first
        return results

    def _install_one(self, sessionmaker: SessionFactory, config: CronConfig) -> InstallResult:
        for attempt in range(1, TRANSIENT_ATTEMPTS + 1):
            try:
                with sessionmaker() as session, session.begin():
                    return install_tick(
                        session,
                        self.queue,
                        config,
                        lookahead=self.lookahead,
                        max_ticks=self.max_ticks,
                    )
            except Exception as exc:
                if attempt == TRANSIENT_ATTEMPTS or not is_transient(exc):
                    raise
                logger.debug("cron %r: transient error, retrying: %s", config.prefix, exc)
        raise AssertionError("unreachable")  # pragma: no cover

    def interval_seconds(self, interval: timedelta | float) -> float:
        """A valid pass interval in seconds: positive and shorter than the look-ahead."""
        seconds = interval.total_seconds() if isinstance(interval, timedelta) else interval
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
            raise InvalidArgument(f"interval must be a positive duration, got {interval!r}")
        if seconds >= self.lookahead.total_seconds():  # (a timedelta of it may overflow)
            shown = interval if isinstance(interval, timedelta) else f"{seconds} s"
            raise InvalidArgument(
                f"interval ({shown}) must be shorter than the look-ahead ({self.lookahead}), or "
                "ticks fall between two passes"
            )
        return float(seconds)

    def install(
        self, sessionmaker: SessionFactory, *, interval: timedelta | float = DEFAULT_INTERVAL
    ) -> CronHandle:
        """Start a daemon thread that runs :meth:`run_once` now and then every ``interval``.

        ``interval`` must be shorter than the look-ahead, so no tick falls between two passes.
        The thread logs and survives every error (a database outage included) and tries again
        on the next interval. Stop it with :meth:`CronHandle.stop`.
        """
        handle = CronHandle(self, sessionmaker, self.interval_seconds(interval))
        handle._thread.start()
        return handle


class CronHandle:
    """A running background installer. ``stop()`` ends it; usable as a context manager."""

    def __init__(self, service: CronService, sessionmaker: SessionFactory, interval: float) -> None:
        self.service = service
        self.interval = interval
        self._sessionmaker = sessionmaker
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._done = threading.Condition()
        #: Passes finished (successful or not), successful ones, and failed ones in a row.
        self.passes = 0
        self.successes = 0
        self.consecutive_failures = 0
        self.last_error: Exception | None = None
        self.last_results: list[InstallResult] = []
        self._thread = threading.Thread(
            target=self._run, name=f"sqla_delayedq-cron-{service.queue.name}", daemon=True
        )

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<CronHandle {self.service!r} {state} passes={self.passes}>"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                self.last_results = self.service.run_once(self._sessionmaker)
            except Exception as exc:  # already logged per configuration by run_once
                self.last_error = exc
                self.consecutive_failures += 1
            else:
                self.successes += 1
                self.consecutive_failures = 0
            with self._done:
                self.passes += 1
                self._done.notify_all()
            self._wake.wait(self.interval)

    def trigger(self) -> None:
        """Run the next pass now instead of at the end of the interval."""
        self._wake.set()

    def wait_for_passes(self, count: int, timeout: float | None = None) -> bool:
        """Block until at least ``count`` passes have finished; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self.passes >= count, timeout)

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the thread after its current pass; True once it has ended."""
        self._stopping.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> CronHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def install(
    sessionmaker: SessionFactory,
    queue: DelayedQueue[Any],
    configs: CronConfig | Iterable[CronConfig],
    *,
    interval: timedelta | float = DEFAULT_INTERVAL,
    lookahead: timedelta = DEFAULT_LOOKAHEAD,
    max_ticks: int = DEFAULT_MAX_TICKS,
) -> CronHandle:
    """Start the background installer for ``configs`` on ``queue``; returns its handle.

    Short for ``CronService(queue, configs, lookahead=...).install(sessionmaker, interval=...)``.
    """
    service = CronService(queue, configs, lookahead=lookahead, max_ticks=max_ticks)
    return service.install(sessionmaker, interval=interval)
