"""The main job end to end: a domain write and its message commit together; a worker delivers.

Run by ``make demo`` after ``alembic upgrade head`` created the queue table::

    python examples/demo.py sqlite:///demo.sqlite
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sqla_delayedq import DelayedQueue, Envelope, create_engine
from sqla_delayedq.worker import Worker


class Base(DeclarativeBase):
    pass


class Order(Base):
    """The application's own table."""

    __tablename__ = "demo_orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(100))


def main(url: str) -> int:
    engine = create_engine(url)
    Base.metadata.create_all(engine)  # the application's own schema
    sessions = sessionmaker(engine)
    emails = DelayedQueue("emails")

    # 1. Enqueue inside the application's transaction: the order and its e-mail commit together.
    now = datetime.now(UTC)
    with sessions.begin() as session:
        for i, customer in enumerate(["ada", "grace", "linus"]):
            order = Order(customer=customer)
            session.add(order)
            session.flush()  # the order's id, for the message key
            emails.offer(
                session,
                f"order-confirmation/{order.id}",
                {"order_id": order.id, "to": f"{customer}@example.com"},
                at=now + timedelta(milliseconds=300 * i),
            )
    print("committed 3 orders and 3 messages in one transaction")

    # 2. A block that fails rolls back its message with its order: nothing is enqueued.
    try:
        with sessions.begin() as session:
            session.add(Order(customer="mallory"))
            emails.offer(session, "order-confirmation/never", {"to": "mallory@example.com"})
            raise RuntimeError("payment declined")
    except RuntimeError as exc:
        print(f"rolled back a block ({exc}): its message was never enqueued")
    with sessions() as session:
        orders = session.scalar(select(func.count()).select_from(Order))
        pending = emails.counts(session).pending
    print(f"orders in the database: {orders}, messages pending: {pending}")

    # 3. A worker delivers the messages as they fall due.
    delivered: list[tuple[str, str, str]] = []
    done = threading.Event()

    def send_email(envelope: Envelope[dict[str, object]]) -> None:
        late_ms = (datetime.now(UTC) - envelope.scheduled_at).total_seconds() * 1000
        delivered.append((envelope.key, str(envelope.payload["to"]), f"{late_ms:.0f} ms"))
        if len(delivered) == 3:
            done.set()

    worker = Worker(sessions, concurrency=2, poll_interval=1.0)
    worker.register(emails, send_email)
    worker.start()
    finished = done.wait(timeout=30)
    worker.stop(drain_timeout=5)

    print()
    print(f"{'key':<26} {'to':<22} {'late by'}")
    for key, to, late in delivered:
        print(f"{key:<26} {to:<22} {late}")
    with sessions() as session:
        left = emails.counts(session)
    print(f"\ndelivered {len(delivered)} messages; left in the queue: {left.pending}")
    return 0 if finished and left.pending == 0 else 1


if __name__ == "__main__":
    started = time.monotonic()
    code = main(sys.argv[1] if len(sys.argv) > 1 else "sqlite:///demo.sqlite")
    print(f"demo finished in {time.monotonic() - started:.1f} s")
    sys.exit(code)
