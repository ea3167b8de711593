"""``DelayedQueue[Model]`` is precisely typed end to end: mypy (``make lint``) checks this file.

``assert_type`` fails the type check when the inferred type differs; an unused
``# type: ignore[...]`` fails it too (``warn_unused_ignores``), so each ignore below proves
mypy refuses that line. The tests also run, on SQLite in memory, so the file stays honest.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, assert_type

import pydantic
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from sqla_delayedq import (
    DataclassSerializer,
    DelayedQueue,
    EncodeError,
    Envelope,
    MessageInfo,
    PydanticSerializer,
)
from sqla_delayedq.aio import AsyncQueue
from sqla_delayedq.models import metadata
from sqla_delayedq.testing import QueueDatabase


@dataclass(frozen=True)
class Shipment:
    order_id: int
    carrier: str


class Invoice(pydantic.BaseModel):
    order_id: int
    total_cents: int


def test_a_dataclass_queue_is_typed_by_its_serializer(delayedq_db: QueueDatabase) -> None:
    q = DelayedQueue("shipments", serializer=DataclassSerializer(Shipment), clock=delayedq_db.clock)
    assert_type(q, DelayedQueue[Shipment])
    with delayedq_db.sessions.begin() as s:
        q.offer(s, "s/1", Shipment(1, "ups"))
        with pytest.raises(EncodeError):  # refused at run time too
            q.offer(s, "s/2", {"order_id": 2})  # type: ignore[arg-type]
        s.rollback()
    with delayedq_db.sessions.begin() as s:
        q.offer(s, "s/1", Shipment(1, "ups"))
        q.offer_batch(s, [("s/3", Shipment(3, "dhl"))])
        env = q.try_poll(s)
        assert env is not None
        assert_type(env, Envelope[Shipment])
        assert_type(env.payload, Shipment)
        assert env.payload.carrier == "ups"
        envs = q.try_poll_many(s, 5)
        assert_type(envs, list[Envelope[Shipment]])
        q.ack(s, env)


def test_a_pydantic_queue_is_typed_by_its_model(delayedq_db: QueueDatabase) -> None:
    q = delayedq_db.queue("invoices", serializer=PydanticSerializer(Invoice))
    assert_type(q, DelayedQueue[Invoice])
    explicit: DelayedQueue[Invoice] = DelayedQueue(
        "invoices", serializer=PydanticSerializer(Invoice)
    )
    wrong: DelayedQueue[Shipment] = DelayedQueue(
        "invoices",
        serializer=PydanticSerializer(Invoice),  # type: ignore[arg-type]
    )
    assert explicit.name == wrong.name
    with delayedq_db.sessions.begin() as s:
        q.offer(s, "i/1", Invoice(order_id=1, total_cents=990))
        (consumed,) = q.consume(s)
        assert_type(consumed.payload, Invoice)
        assert consumed.payload.total_cents == 990
        info = q.get(s, "i/1")
        assert_type(info, MessageInfo | None)


def test_the_async_queue_keeps_the_type(tmp_path: Any) -> None:
    q = DelayedQueue("invoices", serializer=PydanticSerializer(Invoice))
    aq = AsyncQueue(q)
    assert_type(aq, AsyncQueue[Invoice])

    async def main() -> None:
        engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'typed.sqlite'}")
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
        sessions = async_sessionmaker(engine)
        async with sessions() as s, s.begin():
            assert_type(s, AsyncSession)
            await aq.offer(s, "i/1", Invoice(order_id=1, total_cents=5))
            env = await aq.try_poll(s)
            assert env is not None
            assert_type(env.payload, Invoice)
            assert env.payload.order_id == 1
        await engine.dispose()

    asyncio.run(main())
