"""Value objects of the public API: outcomes, envelopes, filters, counts. All frozen."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, NamedTuple, TypeVar

from .errors import InvalidArgument

T = TypeVar("T")

__all__ = [
    "Buried",
    "Delivery",
    "Envelope",
    "MessageFilter",
    "MessageInfo",
    "NackOutcome",
    "OfferMode",
    "OfferResult",
    "Outcome",
    "QueueCounts",
    "QueueName",
    "State",
]


V = TypeVar("V")


def built(cls: type[V], /, **fields: Any) -> V:
    """An instance of the frozen dataclass ``cls`` from every one of its fields, without the
    generated ``__init__``, which sets each field through ``object.__setattr__``: most of what an
    envelope costs on a batch take. Equality, hashing, ``repr``, ``dataclasses.replace`` and
    pickling are those of an instance built the usual way; callers pass every field."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


class Outcome(enum.Enum):
    """What an offer did."""

    CREATED = "created"
    UPDATED = "updated"
    IGNORED = "ignored"


class OfferMode(enum.Enum):
    """How an offer treats a key that already exists in the queue."""

    #: Update payload and schedule; an identical message is ``IGNORED``.
    REPLACE = "replace"
    #: Update the payload only, keeping the schedule; an identical payload is ``IGNORED``.
    KEEP_SCHEDULE = "keep_schedule"
    #: Never update an existing key: ``IGNORED``.
    SKIP = "skip"

    @classmethod
    def parse(cls, mode: OfferMode | str) -> OfferMode:
        if isinstance(mode, cls):
            return mode
        try:
            return cls(mode)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise InvalidArgument(f"unknown offer mode {mode!r}; use one of: {names}") from None


class Delivery(enum.Enum):
    """Whether a take is the message's first, or follows a lease that ran out."""

    FIRST = "first"
    REDELIVERY = "redelivery"


class NackOutcome(enum.Enum):
    """What a nack did."""

    RETRY_SCHEDULED = "retry_scheduled"
    DEAD = "dead"
    #: The lock token no longer matched (lease lost, or the message was updated): no change.
    STALE = "stale"


class State(enum.Enum):
    """Where a message stands, as searched and counted."""

    DUE = "due"  # pending and due now (includes expired leases)
    SCHEDULED = "scheduled"  # pending, due later, not leased
    IN_FLIGHT = "in_flight"  # leased by a consumer and the lease has not run out
    PENDING = "pending"  # any of the three above
    DEAD = "dead"
    DONE = "done"  # acknowledged and kept by retention

    @classmethod
    def parse(cls, state: State | str) -> State:
        if isinstance(state, cls):
            return state
        try:
            return cls(state)
        except ValueError:
            names = ", ".join(s.value for s in cls)
            raise InvalidArgument(f"unknown state {state!r}; use one of: {names}") from None


class QueueName(str):
    """A queue's name as a worker gives it to its hooks: the name itself (it compares, hashes,
    formats and prints as the plain ``str``), which also says which table the queue lives in.

    Two tables may hold queues of the same name (one table per tenant, in two schemas);
    ``table`` tells them apart: the table's key, ``schema.name`` for a table in a schema, else
    its bare name (as queue controls and wake-ups key it). ``schema`` is the schema, or None.
    """

    table: str
    schema: str | None

    def __new__(cls, name: str, table: str = "", schema: str | None = None) -> QueueName:
        self = super().__new__(cls, name)
        self.table = table
        self.schema = schema
        return self


class Buried(NamedTuple):
    """A message a take buried instead of delivering it: its attempts were used up (leases
    that ran out count, so one that keeps killing or hanging its consumer ends here), or its
    payload cannot be decoded. It is dead, kept with ``error`` as its last error, and no
    handler ran. ``key`` is the message's key (an entity's primary key, as text)."""

    queue: str
    key: str
    error: str


class OfferResult(NamedTuple):
    """What one offer did: the message's ``key`` (the generated one when the offer gave None)
    and its ``outcome``. A named tuple (cheap to build a thousand at a time), so
    ``key, outcome = result`` works too."""

    key: str
    outcome: Outcome


@dataclass(frozen=True)
class Envelope(Generic[T]):
    """A taken message. Pass it back to ack, nack, release or extend."""

    id: int
    queue: str
    key: str
    payload: T
    #: When the message was due before this take.
    scheduled_at: datetime
    scheduled_at_initially: datetime
    created_at: datetime
    delivery: Delivery
    #: 1 for the first attempt; failures before this take plus one.
    attempt: int
    lock_token: str
    lease_until: datetime
    #: What the offer sent along (for example a trace context); empty when it sent none.
    headers: Mapping[str, str] = field(default_factory=dict)
    #: The message's group (a queue with ``groups=True``), or None.
    group: str | None = None
    #: The message's priority (a queue with ``priorities=True``; 0 otherwise).
    priority: int = 0

    @property
    def redelivered(self) -> bool:
        return self.delivery is Delivery.REDELIVERY


@dataclass(frozen=True)
class MessageInfo:
    """A stored message as the read side shows it."""

    id: int
    queue: str
    key: str
    payload_type: str
    #: The decoded payload, or ``None`` when it cannot be decoded (see ``decode_error``).
    payload: Any
    status: str
    state: State
    scheduled_at: datetime | None
    scheduled_at_initially: datetime
    created_at: datetime
    attempts: int
    last_attempt_at: datetime | None
    last_error: str | None
    lock_token: str | None
    decode_error: str | None = None
    #: What the offer sent along; empty when it sent none.
    headers: Mapping[str, str] = field(default_factory=dict)
    #: The message's group, or None.
    group: str | None = None
    #: The message's priority (0: the default, lowest).
    priority: int = 0


@dataclass(frozen=True)
class QueueCounts:
    """Messages of a queue by state (:meth:`~sqla_delayedq.DelayedQueue.counts`).

    Exact unless read with ``at_most``: then the count of a state in ``capped`` is a lower bound
    (at most ``at_most``): the read stopped before it had seen them all.
    """

    due: int
    scheduled: int
    in_flight: int
    dead: int
    done: int
    #: The states whose count stopped at the read's ``at_most``: there are at least that many.
    capped: frozenset[str] = field(default=frozenset(), kw_only=True)

    @property
    def pending(self) -> int:
        return self.due + self.scheduled + self.in_flight

    @property
    def exact(self) -> bool:
        """Whether every count is exact (none was capped)."""
        return not self.capped


@dataclass(frozen=True)
class MessageFilter:
    """Which messages a search or an admin operation applies to (all conditions combined).

    ``payload`` matches top-level fields of JSON payloads by equality, e.g.
    ``MessageFilter(payload={"companyId": 3345})``; ``where`` adds any SQLAlchemy condition on
    the model's columns.
    """

    state: State | str | None = None
    key_prefix: str | None = None
    keys: tuple[str, ...] | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)
    scheduled_before: datetime | None = None
    scheduled_after: datetime | None = None
    where: Any = None
