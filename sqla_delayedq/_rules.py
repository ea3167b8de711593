"""The row rules, each in one place: what a new message row holds, what an offer does to a row
that exists, and what a failed or abandoned attempt does.

Single offers, batch offers and cron write rows through :func:`new_row` and
:func:`offer_changes`; message and entity queues decide failures through
:func:`after_failure` and :func:`attempts_used_up`. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from ._types import OfferMode
from .errors import InvalidArgument
from .retry import RetryPolicy

__all__ = [
    "FRESH",
    "HELD",
    "INSERT_COLUMNS",
    "OFFER_RULES",
    "PRIORITY_MAX",
    "Failure",
    "OfferRule",
    "after_failure",
    "attempts_used_up",
    "carries",
    "check_priority",
    "held_due",
    "held_parts",
    "held_prefix",
    "hold",
    "lost_lease_error",
    "lost_token",
    "new_row",
    "offer_changes",
]

#: Columns an offer writes when it creates a row (in this order).
INSERT_COLUMNS = (
    "queue",
    "key",
    "payload_type",
    "payload",
    "payload_bytes",
    "status",
    "scheduled_at",
    "scheduled_at_initially",
    "created_at",
    "attempts",
    "headers",
    "group_key",
    "priority",
)

#: The state an update by an offer gives a row back: pending, no lease, a fresh run.
FRESH = {"lock_token": None, "status": "pending", "attempts": 0, "last_error": None}


@dataclass(frozen=True, slots=True)
class OfferRule:
    """What an offer of one mode does to a row that exists (see :func:`offer_changes`).

    Both the offers' Python path and the Spark pipeline's SQL upsert are written from these.
    """

    #: Whether the offer may change an existing row at all.
    updates: bool
    #: True: an identical payload is ignored only when the offered time is the stored initial
    #: time (or no time was offered); False: an identical payload is always ignored.
    compares_schedule: bool
    #: True: the offered time (else now) becomes the schedule; False: the schedule is kept
    #: (a done or dead row has none left: the offered time, else now; one in flight: now).
    reschedules: bool


OFFER_RULES: dict[OfferMode, OfferRule] = {
    OfferMode.REPLACE: OfferRule(updates=True, compares_schedule=True, reschedules=True),
    OfferMode.KEEP_SCHEDULE: OfferRule(updates=True, compares_schedule=False, reschedules=False),
    OfferMode.SKIP: OfferRule(updates=False, compares_schedule=False, reschedules=False),
}


def new_row(
    queue: str,
    key: str,
    payload: dict[str, Any],
    at: datetime,
    now: datetime,
    group: str | None = None,
) -> dict[str, Any]:
    """The columns of a new message row (``payload``: the codec's payload columns, and the
    offer's ``headers`` when it has any). The group is set here only: an offer that updates a
    message never moves it to another group."""
    return {
        "queue": queue,
        "key": key,
        "headers": None,
        "priority": 0,
        "group_key": group,
        **payload,
        "status": "pending",
        "scheduled_at": at,
        "scheduled_at_initially": at,
        "created_at": now,
        "attempts": 0,
    }


def offer_changes(
    row: Any,
    payload: dict[str, Any],
    same_payload: bool,
    at: datetime | None,
    now: datetime,
    mode: OfferMode,
) -> dict[str, Any] | None:
    """The update an offer makes to an existing row, or None when it is ``IGNORED``.

    ``at`` is None when the caller gave no time ("as soon as possible"): then an identical
    payload is ``IGNORED`` whatever the stored schedule, since the message is already there.

    - ``REPLACE``: payload and schedule; identical payload and schedule is ``IGNORED``.
    - ``KEEP_SCHEDULE``: payload only; an identical payload is ``IGNORED``. A row that is done or
      dead has no schedule left (due at ``at``, else now); one in flight gets the new payload as
      soon as possible (now), never under the old consumer's lease.
    - ``SKIP``: never updates.

    Every update starts a fresh run (no lease, no attempts, no error), so a consumer still
    holding the old version cannot acknowledge it. An update of a message in flight is
    :func:`hold`-ed until the old delivery ends: never taken beside its handler.
    """
    rule = OFFER_RULES[mode]
    if not rule.updates:
        return None
    if same_payload and (
        not rule.compares_schedule or at is None or row.scheduled_at_initially == at
    ):
        return None
    if rule.reschedules:
        when = now if at is None else at
        changes = {**payload, **FRESH, "scheduled_at": when, "scheduled_at_initially": when}
    elif row.status != "pending":
        changes = {**payload, **FRESH, "scheduled_at": at or now}
    elif (held := held_parts(row.lock_token)) is not None:
        # Held for an old delivery: the schedule to keep is the held version's own time.
        kept = held[0] if held[0] is not None else row.scheduled_at
        changes = {**payload, **FRESH, "scheduled_at": kept}
    elif row.lock_token is not None:
        changes = {**payload, **FRESH, "scheduled_at": now}
    else:
        changes = {**payload, **FRESH, "scheduled_at": row.scheduled_at}
    if row.status == "pending" and row.lock_token is not None and row.scheduled_at > now:
        changes["lock_token"], changes["scheduled_at"] = hold(
            row.lock_token, row.scheduled_at, changes["scheduled_at"]
        )
    return changes


# -- a message updated while in flight ---------------------------------------------------------

#: The mark of a held lock token: ``~<due in µs since the epoch, or nothing>~<old token>``.
HELD = "~"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO = timedelta(microseconds=1)


def hold(token: str, lease_end: datetime, due: datetime) -> tuple[str, datetime]:
    """The lock token and due time of a message updated while in flight: held until the old
    delivery ends.

    The old handler is still running: the new version must not start beside it (its group
    would have two messages in flight, an in-flight limit one too many), nor may the old
    delivery settle it. So the row stays in flight until the old lease's end, under a token
    nobody holds that carries the new version's own time (µs since the epoch; a time before
    it counts as the epoch: at once either way) and the old token. The old consumer's ack,
    failure or release ends the hold (the new version is due at ``due``, or at once if that
    passed); its heartbeat lengthens it; if it dies the hold ends with its lease, and a take
    that finds the row before ``due`` gives it back to that time, undelivered. Its next take is
    a first delivery, no lost attempt. An update of a message already held keeps the old token.
    """
    parts = held_parts(token)
    old = token if parts is None else parts[1]
    return held_prefix(due) + old, lease_end


def held_prefix(due: datetime) -> str:
    """The start of a held token, before the old token: ``~<due in µs since the epoch>~``."""
    return f"{HELD}{(max(due, _EPOCH) - _EPOCH) // _MICRO}{HELD}"


def held_parts(token: str | None) -> tuple[datetime | None, str] | None:
    """A held token's (due time it keeps, old token); None for any other token."""
    if token is None or not token.startswith(HELD):
        return None
    stamp, sep, old = token[1:].partition(HELD)
    if not sep or not (stamp == "" or stamp.lstrip("-").isdigit()):
        return None
    return (_EPOCH + int(stamp) * _MICRO if stamp else None), old


def held_due(token: str | None) -> datetime | None:
    """The due time a held token keeps (None: not held, or it keeps none)."""
    parts = held_parts(token)
    return None if parts is None else parts[0]


def carries(token: str | None, delivery: str) -> bool:
    """Whether a row's lock token is the one a delivery took it under, or holds the row for
    that delivery (an offer updated it meanwhile, see :func:`hold`): the row is still the
    delivery's to settle."""
    parts = held_parts(token)
    return token == delivery if parts is None else parts[1] == delivery


def lost_token(token: str | None) -> str | None:
    """A take's previous lock token, as far as lost attempts go: a held one is no lost lease
    (the update started a fresh run), so its take is a first delivery."""
    return None if token is None or token.startswith(HELD) else token


#: The highest priority a message may have (0 is the default and the lowest).
PRIORITY_MAX = 32767


def check_priority(priority: Any) -> int:
    """A priority: an int from 0 (the default, lowest) to :data:`PRIORITY_MAX`."""
    if type(priority) is not int:
        raise InvalidArgument(f"priority must be an int, got {type(priority).__name__}")
    if not 0 <= priority <= PRIORITY_MAX:
        raise InvalidArgument(f"priority must be between 0 and {PRIORITY_MAX}, got {priority}")
    return priority


@dataclass(frozen=True, slots=True)
class Failure:
    """What a failed attempt does: the attempts it records, and when it runs next (None: dead)."""

    attempts: int
    next_at: datetime | None

    @property
    def dead(self) -> bool:
        return self.next_at is None


def after_failure(
    policy: RetryPolicy, attempt: int, now: datetime, at: datetime | None = None
) -> Failure:
    """Attempt number ``attempt`` failed: retry at ``at`` (else after the policy's delay), or
    dead once ``max_attempts`` attempts have failed. A delay past the last time a datetime
    holds (year 9999) is due then: never before it, and never an error that strands it."""
    if attempt >= policy.max_attempts:
        return Failure(attempt, None)
    if at is None:
        delay = policy.delay(attempt)
        if not isinstance(delay, timedelta):
            raise InvalidArgument(
                f"{type(policy).__name__}.delay({attempt}) returned {delay!r}: a retry policy's "
                "delay must be a timedelta"
            )
        try:
            at = now + delay
        except OverflowError:
            at = LATEST if delay > timedelta(0) else now
    return Failure(attempt, at)


#: The latest time a datetime holds, and a retry can be due at.
LATEST = datetime.max.replace(tzinfo=UTC)


def attempts_used_up(prev_token: str | None, attempts: int, policy: RetryPolicy) -> str | None:
    """What a take does with a row it took: None to deliver it, else the error it is buried
    with, since its ``attempts`` (a lost one the take counted included) left none to deliver.

    A take never hands out an attempt past ``max_attempts``. A take that follows an expired
    lease (``prev_token``: the lock token was still set) counts the lost attempt (see the take
    statement), so a message or entity that keeps killing or hanging its consumer ends dead
    instead of being redelivered forever. A row taken without a lease whose attempts already
    reach ``max_attempts`` is buried as well, not run once more: a reschedule to a later time
    counted the attempt its lease lost, or its attempts failed under a higher
    ``max_attempts`` than the policy's now.
    """
    if attempts < policy.max_attempts:
        return None
    if prev_token is not None:
        return lost_lease_error(attempts)
    return (
        f"no attempt left: {attempts} attempts were counted before this take and max_attempts "
        f"is {policy.max_attempts} (a lease that ran out, counted when the message was "
        "rescheduled, or a lower max_attempts than when its attempts failed)"
    )


def lost_lease_error(attempts: int) -> str:
    return (
        f"lease ran out without an ack on {attempts} attempts (the consumer crashed, hung or "
        "outlived its lease); dead after max_attempts"
    )
