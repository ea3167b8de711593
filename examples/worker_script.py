"""A plain script and a worker process: no web framework.

    python examples/worker_script.py sqlite:///script-demo.sqlite setup
    python examples/worker_script.py sqlite:///script-demo.sqlite worker &   # SIGTERM stops it
    python examples/worker_script.py sqlite:///script-demo.sqlite ship book
    python examples/worker_script.py sqlite:///script-demo.sqlite ship book --fail

``ship`` records a shipment and offers its label job in one transaction; with ``--fail`` the
script fails after the offer, so neither is written (exit status 1). The worker process prints a
label for each shipment and marks it labelled, in the transaction that removes the message.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from sqla_delayedq import DelayedQueue, Envelope, QueueMessageMixin, create_engine
from sqla_delayedq.worker import Worker


class Base(DeclarativeBase):
    pass


class Shipment(Base):
    __tablename__ = "script_shipments"

    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(100))
    labelled: Mapped[bool] = mapped_column(default=False)


class Message(QueueMessageMixin, Base):
    __tablename__ = "script_messages"


labels: DelayedQueue[dict[str, int]] = DelayedQueue(
    "labels", model=Message, lease=timedelta(minutes=1)
)


def print_label(envelope: Envelope[dict[str, int]], session: Session) -> None:
    shipment = session.get(Shipment, envelope.payload["shipment_id"])
    if shipment is not None:
        shipment.labelled = True
        print(f"label printed for shipment {shipment.id} ({shipment.item})", flush=True)


def ship(sessions: sessionmaker[Session], item: str, fail: bool) -> int:
    with sessions.begin() as session:
        shipment = Shipment(item=item)
        session.add(shipment)
        session.flush()
        labels.offer(session, f"label/{shipment.id}", {"shipment_id": shipment.id})
        if fail:
            raise RuntimeError("the carrier refused the parcel")  # rolls back both
    print(f"shipment {shipment.id} recorded; its label job is queued", flush=True)
    return shipment.id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="SQLAlchemy database URL")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="create the tables (an application uses Alembic)")
    sub.add_parser("worker", help="run the worker until SIGTERM or Ctrl-C")
    ship_cmd = sub.add_parser("ship", help="record a shipment and queue its label")
    ship_cmd.add_argument("item")
    ship_cmd.add_argument("--fail", action="store_true", help="fail after the offer")
    args = parser.parse_args(argv)

    engine = create_engine(args.url)
    sessions = sessionmaker(engine, expire_on_commit=False)
    try:
        if args.command == "setup":
            Base.metadata.create_all(engine)
        elif args.command == "worker":
            worker = Worker(sessions, concurrency=2, poll_interval=0.5)
            worker.register(labels, print_label, mode="transactional")
            print("worker started", flush=True)
            return 0 if worker.run() else 1
        else:
            try:
                ship(sessions, args.item, args.fail)
            except RuntimeError as exc:
                print(f"failed, nothing was written: {exc}", file=sys.stderr)
                return 1
        return 0
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
