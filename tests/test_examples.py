"""The framework recipes under ``examples/`` run, on every backend, as a reader would run them.

- FastAPI: the real app in process (``TestClient`` runs its lifespan, so the ``AsyncWorker``
  starts and stops with it); a placed order is confirmed by the worker; a failed request leaves
  neither the order nor its message.
- Flask with Flask-SQLAlchemy: the real app's test client; a failed signup leaves nothing; the
  app's worker, drained by the testing helpers, and ``inline`` mode.
- A plain script: a worker process started as a subprocess, a producer process that commits
  and one that fails; SIGTERM stops the worker cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from sqla_delayedq.testing import assert_not_offered, assert_offered, drain, inline
from tests.fix_db import ASYNC_DRIVERS
from tests.test_worker import wait_for

ROOT = Path(__file__).resolve().parent.parent


def url_text(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def drop(backend: Any, metadata: sa.MetaData) -> None:
    metadata.drop_all(backend.engine)


# -- FastAPI -------------------------------------------------------------------------------------


@pytest.fixture
def fastapi_app(backend) -> Iterator[Any]:
    from examples import fastapi_app

    url = backend.url.set(drivername=ASYNC_DRIVERS[backend.name])
    yield fastapi_app.create_app(url_text(url))
    drop(backend, fastapi_app.Base.metadata)


def test_fastapi_offers_in_the_request_and_the_lifespan_worker_handles_it(backend, fastapi_app):
    from fastapi.testclient import TestClient

    from examples.fastapi_app import Order, confirmations

    with TestClient(fastapi_app) as client:  # runs the lifespan: the AsyncWorker starts
        assert fastapi_app.state.worker.stopping is False
        created = client.post("/orders", json={"item": "book", "quantity": 2})
        assert created.status_code == 201, created.text
        order_id = created.json()["id"]

        def confirmed() -> bool:
            return bool(client.get(f"/orders/{order_id}").json()["status"] == "confirmed")

        assert wait_for(confirmed, 10, 0.05)
    assert fastapi_app.state.worker.stopping  # the lifespan stopped it
    assert_not_offered(confirmations.queue, backend.engine)
    with backend.Session() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Order)) == 1


def test_a_failed_fastapi_request_enqueues_nothing(backend, fastapi_app):
    from fastapi.testclient import TestClient

    from examples.fastapi_app import Order, confirmations

    with TestClient(fastapi_app) as client:
        failed = client.post("/orders", json={"item": "piano", "quantity": 11})
        assert failed.status_code == 422 and failed.json()["detail"] == "not enough stock"
        assert client.get("/orders/1").status_code == 404
    assert_not_offered(confirmations.queue, backend.engine)
    with backend.Session() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Order)) == 0
        assert s.scalar(sa.select(sa.func.count()).select_from(confirmations.queue.table)) == 0


# -- Flask ---------------------------------------------------------------------------------------


@pytest.fixture
def flask_app(backend) -> Iterator[Any]:
    from examples import flask_app

    app = flask_app.create_app(url_text(backend.url))
    yield app
    with app.app_context():
        flask_app.db.drop_all()
        flask_app.db.engine.dispose()


def test_flask_offers_in_db_session_and_a_failed_request_enqueues_nothing(backend, flask_app):
    from examples.flask_app import User, make_worker, welcomes

    client = flask_app.test_client()
    ok = client.post("/signup", json={"email": "ada@example.com"})
    assert ok.status_code == 201, ok.text
    user_id = ok.json["id"]
    assert_offered(welcomes, backend.engine, key=f"welcome/{user_id}")
    bad = client.post("/signup", json={"email": "eve@elsewhere.org"})
    assert bad.status_code == 400
    with backend.Session() as s:
        assert s.scalars(sa.select(User.email)).all() == ["ada@example.com"]
    assert [m.key for m in _all(welcomes, backend)] == [f"welcome/{user_id}"]

    assert drain(make_worker(flask_app), raise_errors=True).handled == 1
    assert client.get(f"/users/{user_id}").json == {
        "id": user_id,
        "email": "ada@example.com",
        "welcomed": True,
    }
    assert_not_offered(welcomes, backend.engine)


def test_flask_inline_mode_runs_the_handler_when_the_request_commits(backend, flask_app):
    from examples.flask_app import make_worker

    client = flask_app.test_client()
    with inline(make_worker(flask_app), raise_errors=True) as run:
        user_id = client.post("/signup", json={"email": "bo@example.com"}).json["id"]
        assert client.get(f"/users/{user_id}").json["welcomed"] is True
        assert client.post("/signup", json={"email": "x@y.org"}).status_code == 400
    assert run.handled == 1


def _all(queue: Any, backend: Any) -> list[Any]:
    with backend.Session() as s:
        return list(queue.search(s))


# -- a plain script and a worker process ---------------------------------------------------------


def script(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "worker_script.py"), url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_a_script_offers_and_a_worker_process_handles_it(backend):
    from examples.worker_script import Base, Shipment, labels

    url = url_text(backend.url)
    assert script(url, "setup").returncode == 0
    worker = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "worker_script.py"), url, "worker"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        shipped = script(url, "ship", "book")
        assert shipped.returncode == 0, shipped.stderr
        failed = script(url, "ship", "piano", "--fail")
        assert failed.returncode == 1 and "nothing was written" in failed.stderr

        def labelled() -> bool:
            with backend.Session() as s:
                return s.scalars(sa.select(Shipment.labelled)).all() == [True]

        assert wait_for(labelled, 20, 0.1)
        assert_not_offered(labels, backend.engine)
    finally:
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=30)
        drop(backend, Base.metadata)
    assert worker.returncode == 0, err
    assert "label printed for shipment 1 (book)" in out
    assert "piano" not in out
    time.sleep(0)
