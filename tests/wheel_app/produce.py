"""A producer process: ``python produce.py FIRST COUNT`` offers invoices FIRST.. with a customer
row each, in one transaction, and prints how many it offered. ``python produce.py FIRST COUNT
engine`` offers them alone, each committed on its own (``offer(engine, ...)``), as a web
request with nothing else to write would."""

from __future__ import annotations

import sys

from hostapp.jobs import Invoice, Session, engine, invoices
from hostapp.models import Customer

first, count = int(sys.argv[1]), int(sys.argv[2])
if sys.argv[3:] == ["engine"]:
    for n in range(first, first + count):
        invoice = Invoice(f"2030-{n:04}", 1000 * n + 99)
        result = invoices.offer(engine, f"invoice/{n}", invoice, headers={"request-id": f"req-{n}"})
        assert result.outcome.value == "created", result
    print(f"offered {count}")
    sys.exit(0)
with Session() as session, session.begin():
    for n in range(first, first + count):
        session.add(Customer(name=f"customer {n}"))
        invoice = Invoice(f"2030-{n:04}", 1000 * n + 99)
        invoices.offer(session, f"invoice/{n}", invoice, headers={"request-id": f"req-{n}"})
print(f"offered {count}")
