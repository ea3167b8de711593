"""Acceptance: the package as a user gets it, a wheel installed in a virtualenv of its own.

The module builds the sdist and, from it, the wheel (``python -m build``), creates a fresh
virtualenv outside the repository and installs the wheel there with the ``postgresql``,
``mysql`` and ``cli`` extras (pip may use the network or its cache). Every command then runs with
that virtualenv's interpreter and scripts, from a directory outside the repository, with no
``PYTHONPATH``: the checkout is never importable. It checks that

- ``delayedq db upgrade`` and ``db current`` create and report the default table;
- an Alembic host project (``alembic init``, its own models with ``QueueMessageMixin`` and a
  domain table, a stock ``env.py`` with ``target_metadata`` and no ``render_item`` hook)
  autogenerates a revision and upgrades with it;
- ``delayedq worker hostapp.jobs:worker`` serves that project's queue with the project's own
  lease and serializer while a producer process offers messages, and exits 0 on SIGTERM.

Nothing here is skipped: a missing server, a failed build or install fails the test. The
virtualenv is built once for the module; its set-up time is printed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from tests.fix_db import drop_database, make_database

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "wheel_app"
EXTRAS = "postgresql,mysql,cli"
#: Settings of the developer's shell that must not leak into the user's virtualenv.
SCRUBBED = (
    "PYTHONPATH",
    "PYTHONHOME",
    "VIRTUAL_ENV",
    "DELAYEDQ_DATABASE_URL",
    "DELAYEDQ_TABLE",
    "DELAYEDQ_APP",
    "DELAYEDQ_DEBUG",
)


@dataclass
class Venv:
    """A virtualenv with the wheel installed, outside the repository."""

    root: Path
    env: dict[str, str]

    def bin(self, name: str) -> str:
        return str(self.root / "bin" / name)

    def run(
        self, *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Run a command of the virtualenv; any failure fails the test with its output."""
        done = subprocess.run(
            [self.bin(args[0]), *args[1:]],
            cwd=cwd,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            pytest.fail(
                f"{' '.join(args)} exited {done.returncode}\n"
                f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
            )
        return done


def outside_repo(path: Path) -> Path:
    path = path.resolve()
    assert path != REPO and REPO not in path.parents, f"{path} is inside the repository"
    return path


def step(what: str, cmd: list[str], **kwargs: Any) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        pytest.fail(f"{what} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    started = time.monotonic()
    dist = outside_repo(tmp_path_factory.mktemp("dist"))
    # sdist first, then the wheel from the unpacked sdist: what a package index serves, built
    # without stale files of a build/ folder in the checkout.
    step("python -m build", [sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)])
    (wheel,) = dist.glob("*.whl")
    built = time.monotonic()
    root = outside_repo(tmp_path_factory.mktemp("venv"))
    step("python -m venv", [sys.executable, "-m", "venv", str(root)])
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONNOUSERSITE"] = "1"
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    step("pip install the wheel", [*pip, f"{wheel}[{EXTRAS}]"], env=env, cwd=root)
    print(
        f"\n[test_wheel] build {built - started:.1f} s, "
        f"virtualenv and install {time.monotonic() - built:.1f} s",
        file=sys.stderr,
    )
    return Venv(root, env)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return outside_repo(tmp_path)


@pytest.fixture
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, URL]]:
    """A fresh, empty database of the backend named by the parameter; never a skip."""
    backend: str = request.param
    try:
        url = make_database(backend, tmp_path)
    except pytest.skip.Exception as exc:
        pytest.fail(f"the wheel test needs {backend}: {exc}")
    try:
        yield backend, url
    finally:
        drop_database(backend, url)


def url_of(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def tables(url: URL) -> set[str]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_the_wheel_is_what_runs(venv: Venv, workdir: Path) -> None:
    code = "import sys, sqla_delayedq; print(sqla_delayedq.__file__); print(json.dumps(sys.path))"
    done = venv.run("python", "-c", f"import json; {code}", cwd=workdir)
    module_file, path = done.stdout.splitlines()
    assert Path(module_file).is_relative_to(venv.root), module_file
    assert not any(p and Path(p).resolve().is_relative_to(REPO) for p in json.loads(path)), path
    version = venv.run("delayedq", "--version", cwd=workdir).stdout
    assert version.strip() == "delayedq, version 0.1.0"


@pytest.mark.parametrize("database", ["sqlite", "postgresql"], indirect=True)
def test_db_upgrade_and_current_from_the_wheel(
    venv: Venv, workdir: Path, database: tuple[str, URL]
) -> None:
    _, url = database
    u = url_of(url)
    done = venv.run("delayedq", "db", "upgrade", "--url", u, cwd=workdir)
    assert done.stdout.startswith("upgraded base -> delayedq_"), done.stdout
    head = done.stdout.split("->")[1].strip()
    assert venv.run("delayedq", "db", "current", "--url", u, cwd=workdir).stdout.strip() == (
        f"{head} (head)"
    )
    doc = json.loads(
        venv.run("delayedq", "db", "current", "--url", u, "--json", cwd=workdir).stdout
    )
    assert doc == {"current": [head], "heads": [head], "up_to_date": True}
    assert {"delayed_queue", "delayedq_queue_controls"} <= tables(url)
    assert "no messages" in venv.run("delayedq", "stats", "--url", u, cwd=workdir).stdout
    paused = venv.run("delayedq", "pause", "-q", "jobs", "--url", u, cwd=workdir).stdout
    assert paused == "jobs: paused\n"
    listed = venv.run("delayedq", "controls", "--url", u, "--json", cwd=workdir).stdout
    assert json.loads(listed) == {"jobs": {"paused": True, "max_in_flight": None, "rate": None}}


def alembic_project(venv: Venv, project: Path, url: str) -> Path:
    """``alembic init`` with the host's models; returns the autogenerated revision."""
    shutil.copytree(FIXTURE / "hostapp", project / "hostapp")
    shutil.copy(FIXTURE / "produce.py", project / "produce.py")
    venv.run("alembic", "init", "migrations", cwd=project)
    ini = project / "alembic.ini"
    lines = ini.read_text().splitlines()
    (i,) = [n for n, line in enumerate(lines) if line.startswith("sqlalchemy.url")]
    lines[i] = "sqlalchemy.url = " + url.replace("%", "%%")
    ini.write_text("\n".join(lines) + "\n")
    env_py = project / "migrations" / "env.py"
    text = env_py.read_text()
    assert "target_metadata = None" in text and "render_item" not in text
    env_py.write_text(
        text.replace(
            "target_metadata = None",
            "from hostapp.models import Base\ntarget_metadata = Base.metadata",
        )
    )
    venv.run("alembic", "revision", "--autogenerate", "-m", "host tables", cwd=project)
    (revision,) = (project / "migrations" / "versions").glob("*.py")
    return revision


def handled_lines(events: Path) -> list[list[str]]:
    if not events.exists():
        return []
    return [line.split() for line in events.read_text().splitlines()]


@pytest.mark.parametrize("database", ["sqlite", "postgresql", "mariadb"], indirect=True)
def test_host_project_migrates_and_its_worker_runs_from_the_wheel(
    venv: Venv, workdir: Path, database: tuple[str, URL]
) -> None:
    _, url = database
    project = workdir / "project"
    project.mkdir()
    events = workdir / "events.txt"
    env = {"HOSTAPP_DATABASE_URL": url_of(url), "HOSTAPP_EVENTS": str(events)}

    revision = alembic_project(venv, project, url_of(url))
    generated = revision.read_text()
    assert "create_table('hostapp_outbox'" in generated, generated
    assert "create_table('customers'" in generated, generated
    assert "sqla_delayedq" not in generated  # plain SQLAlchemy types: runs with no hook
    venv.run("alembic", "upgrade", "head", cwd=project)
    assert {"customers", "hostapp_outbox", "alembic_version"} <= tables(url)

    # A producer process offers two invoices before the worker starts, then one while it runs.
    assert venv.run("python", "produce.py", "1", "2", cwd=project, env=env).stdout.strip() == (
        "offered 2"
    )
    app = ("--app", "hostapp.jobs:worker")
    doc = json.loads(venv.run("delayedq", "stats", *app, "--json", cwd=project, env=env).stdout)
    assert doc["table"] == "hostapp_outbox"
    assert [(q["queue"], q["due"]) for q in doc["queues"]] == [("invoices", 2)]
    (shown,) = json.loads(
        venv.run("delayedq", "show", "invoice/1", *app, "--json", cwd=project, env=env).stdout
    )["messages"]
    assert (shown["payload_type"], shown["payload_encoding"]) == ("invoice/v1", "base64")

    worker = subprocess.Popen(
        [venv.bin("delayedq"), "worker", "hostapp.jobs:worker"],
        cwd=project,
        env={**venv.env, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        venv.run("python", "produce.py", "3", "1", cwd=project, env=env)
        # ... and one with the Engine form: no transaction of its own, committed on its own.
        venv.run("python", "produce.py", "4", "1", "engine", cwd=project, env=env)
        deadline = time.monotonic() + 60
        while len(handled_lines(events)) < 4:
            if worker.poll() is not None:
                pytest.fail(f"the worker exited {worker.returncode}: {worker.communicate()[1]}")
            if time.monotonic() > deadline:
                pytest.fail(f"handled {handled_lines(events)} in 60 s")
            time.sleep(0.1)
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 0, stderr
    assert "stopped cleanly" in stderr, stderr

    by_key = {fields[1]: fields[2:] for fields in handled_lines(events)}
    assert sorted(by_key) == ["invoice/1", "invoice/2", "invoice/3", "invoice/4"]
    for n in (1, 2, 3, 4):
        type_name, number, cents, lease_left, request_id = by_key[f"invoice/{n}"]
        assert request_id == f"req-{n}"  # the producer process's headers reached the worker
        # The host's serializer decoded b"INV|2030-000n|n099" into its Invoice class ...
        assert (type_name, number, int(cents)) == ("Invoice", f"2030-{n:04}", 1000 * n + 99)
        # ... and the host's 42-minute lease (not the default 5 minutes) was in force.
        assert 2400 < float(lease_left) <= 42 * 60
    doc = json.loads(venv.run("delayedq", "stats", *app, "--json", cwd=project, env=env).stdout)
    assert doc["queues"] == []  # every message acknowledged
