"""The host's queue and worker: ``delayedq worker hostapp.jobs:worker`` runs ``worker`` as is.

Invoices travel as bytes (``INV|<number>|<cents>``) through a serializer of the host's own, with
a 42-minute lease and three attempts. The handler writes one line per message to
``$HOSTAPP_EVENTS``: ``handled KEY TYPE NUMBER CENTS LEASE_SECONDS_LEFT REQUEST_ID`` (the
``request-id`` header the producer sent).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.orm import sessionmaker

from hostapp.models import Outbox
from sqla_delayedq import DelayedQueue, Envelope, ExponentialBackoff, create_engine
from sqla_delayedq.worker import Worker


@dataclass(frozen=True)
class Invoice:
    number: str
    cents: int


class InvoiceSerializer:
    """Invoices as ``INV|<number>|<cents>`` in the binary column."""

    type_name = "invoice/v1"
    storage = "bytes"

    def encode(self, payload: Invoice) -> bytes:
        return f"INV|{payload.number}|{payload.cents}".encode()

    def decode(self, stored: bytes) -> Invoice:
        tag, number, cents = bytes(stored).decode().split("|")
        if tag != "INV":
            raise ValueError(f"not an invoice: {stored!r}")
        return Invoice(number, int(cents))


engine = create_engine(os.environ["HOSTAPP_DATABASE_URL"])
Session = sessionmaker(engine)

invoices: DelayedQueue[Invoice] = DelayedQueue(
    "invoices",
    model=Outbox,
    serializer=InvoiceSerializer(),
    lease=timedelta(minutes=42),
    retry=ExponentialBackoff(max_attempts=3),
)


def send_invoice(envelope: Envelope[Invoice]) -> None:
    invoice = envelope.payload
    left = (envelope.lease_until - datetime.now(UTC)).total_seconds()
    line = (
        f"handled {envelope.key} {type(invoice).__name__} {invoice.number} {invoice.cents} "
        f"{left:.0f} {envelope.headers.get('request-id', '-')}\n"
    )
    with Path(os.environ["HOSTAPP_EVENTS"]).open("a", encoding="utf-8") as f:
        f.write(line)


worker = Worker(Session, concurrency=2, poll_interval=0.5, drain_timeout=10)
worker.register(invoices, send_invoice)
