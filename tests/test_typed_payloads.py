"""Typed payloads: dataclasses and pydantic models, checked on offer and rebuilt on poll.

On every backend, for both serializers: a payload round-trips as its class (nested objects,
times, enums) and stays queryable by field; a payload of the wrong type is refused before any
SQL runs, and so is one that would be stored in a form its class cannot read back; derived
fields (``field(init=False)``, ``computed_field``) are stored and computed again on read; a
stored payload that no longer fits the class after a deploy (a field removed, a
required field renamed, a value retyped) is buried as dead with an error that says so, and the
message behind it is delivered, by a poll and by both workers, which keep running.
"""

from __future__ import annotations

import enum
from dataclasses import InitVar, dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pydantic
import pytest

from sqla_delayedq import (
    DataclassSerializer,
    DelayedQueue,
    EncodeError,
    InvalidArgument,
    JsonSerializer,
    MessageFilter,
    PydanticSerializer,
    State,
)
from sqla_delayedq.testing import assert_offered
from tests.fix_queue import record_sql
from tests.fix_workers import running
from tests.test_worker import wait_for

KINDS = ("dataclass", "pydantic")
PLACED = datetime(2030, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)


class Status(enum.Enum):
    NEW = "new"
    PAID = "paid"


@dataclass(frozen=True)
class Line:
    sku: str
    qty: int
    price: Decimal


@dataclass(frozen=True)
class OrderPlaced:
    order_id: int
    placed_at: datetime
    lines: list[Line]
    status: Status = Status.NEW
    note: str | None = None
    tags: tuple[str, ...] = field(default=())


class PLine(pydantic.BaseModel):
    sku: str
    qty: int
    price: Decimal


class POrderPlaced(pydantic.BaseModel):
    order_id: int
    placed_at: datetime
    lines: list[PLine]
    status: Status = Status.NEW
    note: str | None = None
    tags: tuple[str, ...] = ()


def sample(kind: str, order_id: int = 7) -> Any:
    if kind == "dataclass":
        return OrderPlaced(
            order_id, PLACED, [Line("A-1", 2, Decimal("9.90"))], Status.PAID, "gift", ("x",)
        )
    return POrderPlaced(
        order_id=order_id,
        placed_at=PLACED,
        lines=[PLine(sku="A-1", qty=2, price=Decimal("9.90"))],
        status=Status.PAID,
        note="gift",
        tags=("x",),
    )


def serializer(kind: str, **kw: Any) -> Any:
    if kind == "dataclass":
        return DataclassSerializer(OrderPlaced, **kw)
    return PydanticSerializer(POrderPlaced, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_a_typed_payload_round_trips_as_its_class_and_is_queryable_by_field(
    backend, make_queue, kind
):
    q = make_queue("orders", serializer=serializer(kind))
    placed = sample(kind)
    with backend.Session.begin() as s:
        q.offer(s, "o/7", placed)
        assert q.offer(s, "o/7", sample(kind)).outcome.value == "ignored"  # identical re-offer
        assert_offered(q, s, key="o/7", payload=placed)
    with backend.Session() as s:
        (found,) = q.search(s, MessageFilter(payload={"order_id": 7}))
        assert found.payload == placed and found.payload_type == type(placed).__qualname__
    with backend.Session.begin() as s:
        env = q.try_poll(s)
    assert env is not None and env.payload == placed
    assert type(env.payload) is type(placed)
    assert env.payload.lines[0].price == Decimal("9.90")
    assert env.payload.placed_at == PLACED and env.payload.status is Status.PAID


@pytest.mark.parametrize("kind", KINDS)
def test_a_payload_of_the_wrong_type_is_refused_before_any_sql(backend, make_queue, kind):
    q = make_queue("orders", serializer=serializer(kind))
    with backend.Session.begin() as s:
        with pytest.raises(EncodeError, match=r"takes .*OrderPlaced payloads, got dict"):
            q.offer(s, "o/1", {"order_id": 1})
        wrong = sample("pydantic" if kind == "dataclass" else "dataclass")
        with pytest.raises(EncodeError, match=r"got .*OrderPlaced"):
            q.offer(s, "o/1", wrong)
        q.offer(s, "o/2", sample(kind, 2))  # the transaction is still usable
    with backend.Session() as s:
        assert [m.key for m in q.search(s)] == ["o/2"]


def test_serializers_refuse_what_is_not_their_kind() -> None:
    with pytest.raises(InvalidArgument, match="needs a dataclass"):
        DataclassSerializer(PLine)
    with pytest.raises(InvalidArgument, match="BaseModel"):
        PydanticSerializer(Line)  # type: ignore[type-var]
    with pytest.raises(InvalidArgument, match="unknown_fields"):
        DataclassSerializer(Line, unknown_fields="drop")


# -- a deploy changed the class: the stored payload no longer fits ------------------------------


@dataclass(frozen=True)
class V1:
    order_id: int
    note: str


@dataclass(frozen=True)
class NoteRemoved:
    order_id: int


@dataclass(frozen=True)
class NoteRenamed:
    order_id: int
    comment: str


@dataclass(frozen=True)
class IdIsText:
    order_id: str
    note: str


class PV1(pydantic.BaseModel):
    order_id: int
    note: str


class PNoteRemoved(pydantic.BaseModel):
    order_id: int


class PNoteRenamed(pydantic.BaseModel):
    order_id: int
    comment: str


class PIdIsText(pydantic.BaseModel, strict=True):
    order_id: str
    note: str


#: (old class, new class, what the burial error says), per serializer kind and change.
CHANGES: dict[str, dict[str, tuple[type, type, str]]] = {
    "dataclass": {
        "removed": (V1, NoteRemoved, "field(s) 'note' not defined by NoteRemoved"),
        "renamed": (V1, NoteRenamed, "required field(s) 'comment' of NoteRenamed missing"),
        "retyped": (V1, IdIsText, "payload.order_id: expected str, got int"),
    },
    "pydantic": {
        "removed": (PV1, PNoteRemoved, "field(s) 'note' not defined by PNoteRemoved"),
        "renamed": (PV1, PNoteRenamed, "payload.comment: Field required"),
        "retyped": (PV1, PIdIsText, "payload.order_id: Input should be a valid string"),
    },
}


def wrap(kind: str, cls: type) -> Any:
    if kind == "dataclass":
        return DataclassSerializer(cls, type_name="order")
    return PydanticSerializer(cls, type_name="order")


def old_payload(kind: str, order_id: int) -> Any:
    return V1(order_id, "n") if kind == "dataclass" else PV1(order_id=order_id, note="n")


def deployed(backend, make_queue, kind: str, change: str) -> DelayedQueue[Any]:
    """Offer a message with the old class, then return the queue as the new deploy builds it,
    with a message behind it offered in the new shape (plain JSON, as the new class writes)."""
    old, new, _ = CHANGES[kind][change]
    before = make_queue("orders", serializer=wrap(kind, old))
    with backend.Session.begin() as s:
        before.offer(s, "old", old_payload(kind, 1))
    as_json = make_queue("orders", serializer=JsonSerializer("order"))
    fits: dict[str, Any] = {"order_id": 2} if change == "removed" else {"order_id": 2, "note": "n"}
    if change == "renamed":
        fits = {"order_id": 2, "comment": "c"}
    if change == "retyped":
        fits = {"order_id": "2", "note": "n"}
    with backend.Session.begin() as s:
        as_json.offer(s, "new", fits)
    return make_queue("orders", serializer=wrap(kind, new))


def assert_buried(backend, q: DelayedQueue[Any], says: str) -> None:
    with backend.Session() as s:
        (dead,) = q.search(s, MessageFilter(state=State.DEAD))
    assert dead.key == "old" and dead.attempts == 1
    assert dead.last_error is not None and says in dead.last_error, dead.last_error
    assert dead.decode_error is not None and says in dead.decode_error


@pytest.mark.parametrize("change", ["removed", "renamed", "retyped"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_payload_that_no_longer_fits_is_buried_with_a_clear_error(
    backend, make_queue, kind, change
):
    q = deployed(backend, make_queue, kind, change)
    with backend.Session.begin() as s:
        env = q.try_poll(s)
        assert env is not None and env.key == "new"  # the same poll went on past the poison
        assert type(env.payload) is CHANGES[kind][change][1]
    assert_buried(backend, q, CHANGES[kind][change][2])


@pytest.mark.parametrize("mode", ["lease", "transactional"])
@pytest.mark.parametrize("kind", KINDS)
def test_workers_bury_a_removed_field_and_keep_running(
    backend, make_queue, make_worker, kind, mode
):
    q = deployed(backend, make_queue, kind, "removed")
    handled: list[Any] = []
    worker = make_worker(backend, concurrency=1, poll_interval=0.05, listen=False)
    worker.register(q, lambda env, session=None: handled.append(env.payload), mode=mode)
    with running(worker):
        assert wait_for(lambda: len(handled) == 1, 10)
        with backend.Session.begin() as s:  # still running: a later message is handled too
            q.offer(s, "later", CHANGES[kind]["removed"][1](order_id=3))
        assert wait_for(lambda: len(handled) == 2, 10)
    assert [p.order_id for p in handled] == [2, 3]
    assert all(type(p) is CHANGES[kind]["removed"][1] for p in handled)
    assert_buried(backend, q, CHANGES[kind]["removed"][2])


def test_unknown_fields_can_be_ignored(backend, make_queue) -> None:
    q = deployed(backend, make_queue, "dataclass", "removed")
    lenient = make_queue(
        "orders", serializer=DataclassSerializer(NoteRemoved, "order", unknown_fields="ignore")
    )
    with backend.Session.begin() as s:
        envs = lenient.try_poll_many(s, 2)
    assert [e.payload for e in envs] == [NoteRemoved(1), NoteRemoved(2)]
    assert q.name == lenient.name


@dataclass(frozen=True)
class Priced:
    net: int
    tax: int
    gross: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gross", self.net + self.tax)


class PPriced(pydantic.BaseModel):
    net: int
    tax: int

    @pydantic.computed_field  # type: ignore[prop-decorator]
    @property
    def gross(self) -> int:
        return self.net + self.tax


class PPricedStrict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    net: int
    tax: int

    @pydantic.computed_field(alias="grossAmount")  # type: ignore[prop-decorator]
    @property
    def gross(self) -> int:
        return self.net + self.tax


DERIVED = {
    "dataclass-init-false": (DataclassSerializer(Priced), Priced(5, 2), "gross"),
    "pydantic-computed": (PydanticSerializer(PPriced), PPriced(net=5, tax=2), "gross"),
    "pydantic-computed-forbid-extra": (
        PydanticSerializer(PPricedStrict),
        PPricedStrict(net=5, tax=2),
        "grossAmount",
    ),
}


@pytest.mark.parametrize(("ser", "payload", "stored_as"), DERIVED.values(), ids=DERIVED.keys())
def test_a_derived_field_is_stored_for_filters_and_computed_again_on_read(
    backend, make_queue, ser, payload, stored_as
):
    q = make_queue("priced", serializer=ser)
    with backend.Session.begin() as s:
        assert q.offer(s, "p/1", payload).outcome.value == "created"
        assert q.offer(s, "p/1", payload).outcome.value == "ignored"
    with backend.Session() as s:
        (found,) = q.search(s, MessageFilter(payload={stored_as: 7}))
        assert found.payload == payload and found.decode_error is None
    with backend.Session.begin() as s:
        env = q.try_poll(s)
        assert env is not None and env.payload == payload and env.payload.gross == 7
        assert q.ack(s, env)
    with backend.Session() as s:
        assert q.count(s) == 0  # handled, not buried


@dataclass
class Booking:
    day: date


@dataclass
class Counted:
    n: int


@dataclass
class Scaled:
    n: int
    scale: InitVar[int]

    def __post_init__(self, scale: int) -> None:
        self.n *= scale


class PSecret(pydantic.BaseModel):
    token: str = pydantic.Field(exclude=True)
    n: int


UNREADABLE = {
    "datetime-in-a-date-field": (
        DataclassSerializer(Booking),
        Booking(datetime(2030, 1, 1, 9, tzinfo=UTC)),
        r"^this Booking would be stored as JSON it cannot be read back from: payload\.day: "
        r"expected date text, got str '2030-01-01T09:00:00\+00:00'$",
    ),
    "text-in-an-int-field": (
        DataclassSerializer(Counted),
        Counted("7"),  # type: ignore[arg-type]
        r"^this Counted would be .*: payload\.n: expected int, got str '7'$",
    ),
    "an-init-var": (
        DataclassSerializer(Scaled),
        Scaled(1, 3),
        r"^this Scaled would be .*: payload: Scaled\(\.\.\.\) raised TypeError",
    ),
    "an-excluded-required-field": (
        PydanticSerializer(PSecret),
        PSecret(token="t", n=1),
        r"^this PSecret would be .*: payload does not fit PSecret: payload\.token: Field required$",
    ),
}


@pytest.mark.parametrize("how", ["offer", "batch"])
@pytest.mark.parametrize(("ser", "payload", "message"), UNREADABLE.values(), ids=UNREADABLE.keys())
def test_a_payload_that_would_not_read_back_is_refused_before_any_sql(
    backend, make_queue, ser, payload, message, how
):
    q = make_queue("unreadable", serializer=ser)
    with (
        record_sql(backend.engine) as sql,
        backend.Session.begin() as s,
        pytest.raises(EncodeError, match=message),
    ):
        if how == "batch":
            q.offer_batch(s, [("k", payload)])
        else:
            q.offer(s, "k", payload)
    assert sql == []
    with backend.Session() as s:
        assert q.count(s) == 0
