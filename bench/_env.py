"""Benchmark environment: fresh databases, CPU accounting of the client and the servers."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from sqla_delayedq.models import metadata

ADMIN_URLS = {
    "postgresql": os.environ.get(
        "DELAYEDQ_BENCH_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    ),
    "mariadb": os.environ.get("DELAYEDQ_BENCH_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/"),
}
SERVER_PROCESS = {"postgresql": ("postgres",), "mariadb": ("mariadbd", "mysqld")}
TICK = os.sysconf("SC_CLK_TCK")


def _admin(backend: str) -> sa.Engine:
    return sa.create_engine(
        ADMIN_URLS[backend], isolation_level="AUTOCOMMIT", poolclass=sa.NullPool
    )


@contextmanager
def fresh_database(backend: str, tmp: Path, *, sync_commit_off: bool = False) -> Iterator[URL]:
    """A new database with the default queue table; dropped afterwards."""
    name = f"dq_bench_{secrets.token_hex(4)}"
    if backend == "sqlite":
        url = make_url(f"sqlite:///{tmp / (name + '.sqlite')}")
    else:
        engine = _admin(backend)
        with engine.connect() as conn:
            if backend == "postgresql":
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
                if sync_commit_off:
                    conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
            else:
                conn.exec_driver_sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        engine.dispose()
        url = make_url(ADMIN_URLS[backend]).set(database=name)
    from sqla_delayedq import create_engine

    engine = create_engine(url)
    metadata.create_all(engine)
    engine.dispose()
    try:
        yield url
    finally:
        if backend == "sqlite":
            for suffix in ("", "-wal", "-shm"):
                Path(str(url.database) + suffix).unlink(missing_ok=True)
        else:
            engine = _admin(backend)
            with engine.connect() as conn:
                if backend == "postgresql":
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                else:
                    conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
            engine.dispose()


def truncate(url: URL) -> None:
    from sqla_delayedq import create_engine

    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(metadata.tables["delayed_queue"].delete())
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE delayed_queue")
    engine.dispose()


def server_cpu(backend: str) -> float:
    """CPU seconds used so far by every process of the database server on this machine."""
    names = SERVER_PROCESS.get(backend)
    if not names:
        return 0.0
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if comm.startswith(names):
            fields = stat[stat.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / TICK


@dataclass
class Measure:
    seconds: float
    messages: int
    client_cpu: float
    server_cpu: float
    extra: dict[str, float]

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0


class Meter:
    """Wall time and CPU of the client process and of the server processes over a block."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def __enter__(self) -> Meter:
        self.t0 = time.perf_counter()
        self.c0 = time.process_time()
        self.s0 = server_cpu(self.backend)
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.client = time.process_time() - self.c0
        self.server = server_cpu(self.backend) - self.s0

    def result(self, messages: int, **extra: float) -> Measure:
        return Measure(self.seconds, messages, self.client, self.server, extra)


def pg_settings(url: URL) -> dict[str, str]:
    names = (
        "server_version",
        "synchronous_commit",
        "fsync",
        "wal_sync_method",
        "shared_buffers",
        "max_wal_size",
        "commit_delay",
    )
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.connect() as conn:
        out = {n: conn.exec_driver_sql(f"SHOW {n}").scalar_one() for n in names}
    engine.dispose()
    return out
