"""A producer process: ``python produce.py FIRST COUNT`` offers invoices FIRST.. with a customer
row each, in one transaction, and prints how many it offered."""

from __future__ import annotations

import sys

from hostapp.jobs import Invoice, Session, invoices
from hostapp.models import Customer

first, count = int(sys.argv[1]), int(sys.argv[2])
with Session() as session, session.begin():
    for n in range(first, first + count):
        session.add(Customer(name=f"customer {n}"))
        invoice = Invoice(f"2030-{n:04}", 1000 * n + 99)
        invoices.offer(session, f"invoice/{n}", invoice, headers={"request-id": f"req-{n}"})
print(f"offered {count}")
