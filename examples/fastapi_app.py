"""FastAPI: offer in the request's session; the asyncio worker runs in the app's lifespan.

A request that places an order writes the order and offers its confirmation in one
transaction: when the request fails (here: an order of more than 10 items), neither exists. The
``AsyncWorker`` started by the lifespan confirms the order in transactional mode, so the
status change commits with the message's removal.

    pip install 'sqla_delayedq[examples]'
    export DATABASE_URL=sqlite+aiosqlite:///fastapi-demo.sqlite
    uvicorn --factory examples.fastapi_app:create_app
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"item": "book", "quantity": 1}'

The database URL needs an asyncio driver: ``sqlite+aiosqlite``, ``postgresql+psycopg``,
``mysql+aiomysql``. The lifespan creates the tables for the demo; an application migrates with
Alembic.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from sqlalchemy import String
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_delayedq import DelayedQueue, Envelope, PydanticSerializer, QueueMessageMixin
from sqla_delayedq.aio import AsyncQueue, AsyncWorker, create_async_engine


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "fastapi_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(100))
    quantity: Mapped[int]
    status: Mapped[str] = mapped_column(String(20), default="placed")


class Message(QueueMessageMixin, Base):
    """The queue's table, on the application's own ``Base`` (Alembic autogenerates it)."""

    __tablename__ = "fastapi_messages"


class OrderIn(BaseModel):
    item: str
    quantity: int


class ConfirmOrder(BaseModel):
    """The payload: typed, validated on offer and on poll."""

    order_id: int


confirmations = AsyncQueue(
    DelayedQueue(
        "confirmations", model=Message, serializer=PydanticSerializer(ConfirmOrder, "confirm")
    )
)


async def confirm(envelope: Envelope[ConfirmOrder], session: AsyncSession) -> None:
    """Transactional mode: this write commits together with the message's removal."""
    order = await session.get(Order, envelope.payload.order_id)
    if order is not None:
        order.status = "confirmed"


async def request_session(request: Request) -> AsyncIterator[AsyncSession]:
    """The request's session: closed (rolled back unless committed) when the request ends."""
    async with request.app.state.sessions() as session:
        yield session


DbSession = Annotated[AsyncSession, Depends(request_session)]
router = APIRouter()


@router.post("/orders", status_code=201)
async def place_order(order_in: OrderIn, session: DbSession) -> dict[str, int]:
    order = Order(item=order_in.item, quantity=order_in.quantity)
    session.add(order)
    await session.flush()  # the order's id, for the message key
    await confirmations.offer(session, f"confirm/{order.id}", ConfirmOrder(order_id=order.id))
    if order_in.quantity > 10:
        # Fails after the offer: the order and its message roll back together.
        raise HTTPException(status_code=422, detail="not enough stock")
    await session.commit()
    return {"id": order.id}


@router.get("/orders/{order_id}")
async def get_order(order_id: int, session: DbSession) -> dict[str, object]:
    order = await session.get(Order, order_id)
    if order is None:
        raise HTTPException(status_code=404, detail="no such order")
    return {"id": order.id, "item": order.item, "status": order.status}


def create_app(database_url: str | None = None) -> FastAPI:
    url = database_url or os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///fastapi-demo.sqlite")
    engine = create_async_engine(url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)  # the demo's schema; use Alembic
        worker = AsyncWorker(sessions, concurrency=4, poll_interval=1.0)
        worker.register(confirmations, confirm, mode="transactional")
        running = asyncio.create_task(worker.run(install_signal_handlers=False))
        app.state.worker = worker
        try:
            yield
        finally:
            worker.request_stop()  # finish what is in flight, take nothing new
            await running
            await engine.dispose()

    app = FastAPI(title="sqla_delayedq + FastAPI", lifespan=lifespan)
    app.state.sessions = sessions
    app.include_router(router)
    return app
