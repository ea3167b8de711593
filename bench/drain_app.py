"""The worker of the multi-process drains: ``delayedq worker bench.drain_app:make --processes N``.

Each child process builds it from the environment the bench sets (the database, the mode, the
consumers per process, a batch size for C2), then writes its process id to a file in
``DELAYEDQ_BENCH_READY`` so the bench knows it is up and whose CPU to read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy.orm import sessionmaker

from sqla_delayedq import DelayedQueue, create_engine
from sqla_delayedq.worker import Worker


def make() -> Worker:
    env = os.environ
    consumers = int(env["DELAYEDQ_BENCH_CONSUMERS"])
    batch = int(env.get("DELAYEDQ_BENCH_BATCH", "0"))
    engine = create_engine(env["DELAYEDQ_BENCH_URL"], pool_size=consumers + 2)
    worker = Worker(sessionmaker(engine), concurrency=consumers, poll_interval=0.05, listen=False)
    q: DelayedQueue[Any] = DelayedQueue(env.get("DELAYEDQ_BENCH_QUEUE", "bench"))
    if batch:
        worker.register_batch(q, lambda envelopes: None, batch_size=batch)
    elif env["DELAYEDQ_BENCH_MODE"] == "transactional":
        worker.register(q, lambda envelope, session: None, mode="transactional")
    else:
        worker.register(q, lambda envelope: None, mode="lease")
    Path(env["DELAYEDQ_BENCH_READY"], str(os.getpid())).touch()
    return worker
