"""Database servers for the test suite, as a pytest plugin.

Where each backend comes from, in order:

1. an environment variable with a server URL whose user may create databases:
   ``DELAYEDQ_TEST_POSTGRESQL_URL`` (e.g. ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``)
   and ``DELAYEDQ_TEST_MARIADB_URL`` (e.g. ``mysql+pymysql://root@127.0.0.1:3306/``);
2. the local servers on 127.0.0.1:5432 and 127.0.0.1:3306;
3. a testcontainers container, when a Docker engine answers;
4. otherwise the backend's tests are skipped with the reason, except with ``CI=true``, where a
   missing PostgreSQL or MariaDB fails the run.

Each test session creates its own database on each server (``dq_<random>``) and drops it at the
end. SQLite uses a file in a temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from sqla_delayedq import controls, create_engine
from sqla_delayedq.models import metadata

BACKENDS = ("sqlite", "postgresql", "mariadb")
SERVER_BACKENDS = ("postgresql", "mariadb")

ENV_VARS = {
    "postgresql": "DELAYEDQ_TEST_POSTGRESQL_URL",
    "mariadb": "DELAYEDQ_TEST_MARIADB_URL",
}
LOCAL_URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/",
}
CONNECT_ARGS = {
    "postgresql": {"connect_timeout": 3},
    "mariadb": {"connect_timeout": 3},
}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _reachable(url: str, backend: str) -> str | None:
    """None when the server answers, else the reason it does not."""
    engine = sa.create_engine(url, connect_args=CONNECT_ARGS[backend], poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        engine.dispose()


def _container(backend: str) -> tuple[Any, str] | None:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env().ping()
    except Exception:
        return None
    if backend == "postgresql":
        from testcontainers.postgres import PostgresContainer

        pg = PostgresContainer("postgres:16", driver="psycopg").start()
        return pg, pg.get_connection_url()
    from testcontainers.mysql import MySqlContainer

    my = MySqlContainer("mariadb:11", username="root", password="test").start()
    return my, my.get_connection_url().replace("mysql://", "mysql+pymysql://")


@dataclass
class Server:
    """A database server the suite may create databases on."""

    backend: str
    admin_url: URL
    container: Any = None
    created: list[str] = field(default_factory=list)

    def _admin(self) -> Engine:
        return sa.create_engine(self.admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)

    def create_database(self) -> URL:
        name = f"dq_{secrets.token_hex(6)}"
        engine = self._admin()
        try:
            with engine.connect() as conn:
                if self.backend == "postgresql":
                    conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
                else:
                    conn.exec_driver_sql(
                        f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
                    )
        finally:
            engine.dispose()
        self.created.append(name)
        return self.admin_url.set(database=name)

    def drop_database(self, url: URL) -> None:
        name = url.database
        assert name is not None
        engine = self._admin()
        try:
            with engine.connect() as conn:
                if self.backend == "postgresql":
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                else:
                    conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
        finally:
            engine.dispose()
        if name in self.created:
            self.created.remove(name)


_servers: dict[str, Server | str] = {}


def server_for(backend: str) -> Server:
    """The server for ``backend``, or skip (fail under CI) with the reason it is missing."""
    if backend not in _servers:
        _servers[backend] = _find_server(backend)
    found = _servers[backend]
    if isinstance(found, str):
        if in_ci():
            pytest.fail(f"{backend} is required with CI=true but unavailable: {found}")
        pytest.skip(f"{backend} unavailable: {found}")
    return found


def _find_server(backend: str) -> Server | str:
    env_url = os.environ.get(ENV_VARS[backend])
    if env_url:
        why = _reachable(env_url, backend)
        return Server(backend, make_url(env_url)) if why is None else f"${ENV_VARS[backend]}: {why}"
    why = _reachable(LOCAL_URLS[backend], backend)
    if why is None:
        return Server(backend, make_url(LOCAL_URLS[backend]))
    started = _container(backend)
    if started is None:
        return (
            f"no ${ENV_VARS[backend]}, local server unreachable ({why}), "
            "and no Docker engine for testcontainers"
        )
    container, url = started
    return Server(backend, make_url(url), container=container)


@dataclass
class Backend:
    """One database of one backend, with the default queue table created."""

    name: str
    url: URL
    engine: Engine
    Session: sessionmaker[Session]

    def new_engine(self, **kwargs: Any) -> Engine:
        return create_engine(self.url, **kwargs)


def make_database(backend: str, tmp_dir: Path) -> URL:
    if backend == "sqlite":
        return make_url(f"sqlite:///{tmp_dir / f'dq_{uuid.uuid4().hex[:8]}.sqlite'}")
    return server_for(backend).create_database()


def drop_database(backend: str, url: URL) -> None:
    if backend == "sqlite":
        if url.database:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    Path(url.database + suffix).unlink()
        return
    server = _servers.get(backend)
    if isinstance(server, Server):
        server.drop_database(url)


@pytest.fixture(scope="session")
def _backend_databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Backend]]:
    made: dict[str, Backend] = {}
    yield made
    for backend in made.values():
        backend.engine.dispose()
        drop_database(backend.name, backend.url)
    for server in _servers.values():
        if isinstance(server, Server) and server.container is not None:
            server.container.stop()


def _session_backend(
    name: str, made: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Backend:
    if name not in made:
        url = make_database(name, tmp_path_factory.mktemp(name))
        pool = {} if name == "sqlite" else {"pool_size": 20, "max_overflow": 20}
        engine = create_engine(url, **pool)
        metadata.create_all(engine)
        made[name] = Backend(name, url, engine, sessionmaker(engine))
    return made[name]


def _clean(backend: Backend) -> None:
    with backend.engine.begin() as conn:
        for table in reversed(metadata.sorted_tables):
            conn.execute(table.delete())
    controls.invalidate()  # what this process last read of the queues' controls


def _emptied(
    name: str, made: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backend]:
    """The session's database of ``name``, with empty tables before and after the test."""
    b = _session_backend(name, made, tmp_path_factory)
    _clean(b)
    yield b
    _clean(b)


@pytest.fixture(params=BACKENDS)
def backend(
    request: pytest.FixtureRequest,
    _backend_databases: dict[str, Backend],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Backend]:
    """Each backend in turn, with an empty default queue table."""
    yield from _emptied(request.param, _backend_databases, tmp_path_factory)


@pytest.fixture(params=SERVER_BACKENDS)
def server_backend(
    request: pytest.FixtureRequest,
    _backend_databases: dict[str, Backend],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Backend]:
    """PostgreSQL and MariaDB only: for races that need real concurrent servers."""
    yield from _emptied(request.param, _backend_databases, tmp_path_factory)


@pytest.fixture
def pg(
    _backend_databases: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backend]:
    """PostgreSQL only."""
    yield from _emptied("postgresql", _backend_databases, tmp_path_factory)


@pytest.fixture
def mariadb(
    _backend_databases: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backend]:
    """MariaDB only."""
    yield from _emptied("mariadb", _backend_databases, tmp_path_factory)


@pytest.fixture(params=BACKENDS)
def fresh_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, URL]]:
    """An empty database (no tables) on each backend, dropped after the test."""
    url = make_database(request.param, tmp_path)
    try:
        yield request.param, url
    finally:
        drop_database(request.param, url)


#: The conformance suites also run on PostgreSQL through psycopg's async driver.
ASYNC_PG = "postgresql-async"


@pytest.fixture(params=(*BACKENDS, ASYNC_PG))
def conformance_backend(
    request: pytest.FixtureRequest,
    _backend_databases: dict[str, Backend],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Backend]:
    """Each backend, plus PostgreSQL behind an async engine (``postgresql-async``).

    For the async variant the test body runs inside a greenlet on an event loop (see
    :func:`pytest_pyfunc_call`), which is how ``AsyncSession.run_sync`` runs the queue's
    operations: every statement travels through psycopg's ``AsyncConnection``.
    """
    if request.param != ASYNC_PG:
        yield from _emptied(request.param, _backend_databases, tmp_path_factory)
        return
    from sqlalchemy.ext.asyncio import create_async_engine

    sync = _session_backend("postgresql", _backend_databases, tmp_path_factory)
    _clean(sync)
    # No pool: each test's event loop must not inherit connections from another loop.
    async_engine = create_async_engine(
        sync.url.set(drivername="postgresql+psycopg"), poolclass=sa.NullPool
    )
    engine = async_engine.sync_engine
    try:
        yield Backend(ASYNC_PG, sync.url, engine, sessionmaker(engine))
    finally:
        _clean(sync)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run ``postgresql-async`` conformance tests in a greenlet on an asyncio event loop."""
    callspec = getattr(pyfuncitem, "callspec", None)
    if callspec is None or callspec.params.get("conformance_backend") != ASYNC_PG:
        return None
    from sqlalchemy.util import greenlet_spawn

    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}

    async def main() -> None:
        await greenlet_spawn(functools.partial(pyfuncitem.obj, **kwargs))

    asyncio.run(main())
    return True


ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "mariadb": "mysql+aiomysql",
}


@dataclass
class AsyncBackend:
    """One backend's database through its asyncio driver, beside the sync ``Backend``."""

    name: str
    sync: Backend
    engine: Any
    sessions: Any


def _async_backend(
    name: str, made: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AsyncBackend]:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_delayedq.aio import create_async_engine

    for sync in _emptied(name, made, tmp_path_factory):
        url = sync.url.set(drivername=ASYNC_DRIVERS[name])
        engine = create_async_engine(url, poolclass=sa.NullPool)
        try:
            yield AsyncBackend(
                name, sync, engine, async_sessionmaker(engine, expire_on_commit=False)
            )
        finally:
            asyncio.run(engine.dispose())


@pytest.fixture(params=BACKENDS)
def async_backend(
    request: pytest.FixtureRequest,
    _backend_databases: dict[str, Backend],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[AsyncBackend]:
    """Each backend through its asyncio driver (aiosqlite, psycopg async, aiomysql), with an
    empty default queue table; connections are not pooled across event loops."""
    yield from _async_backend(request.param, _backend_databases, tmp_path_factory)


@pytest.fixture(params=SERVER_BACKENDS)
def async_server_backend(
    request: pytest.FixtureRequest,
    _backend_databases: dict[str, Backend],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[AsyncBackend]:
    """PostgreSQL and MariaDB through their asyncio drivers."""
    yield from _async_backend(request.param, _backend_databases, tmp_path_factory)
