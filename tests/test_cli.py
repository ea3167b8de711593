"""The ``delayedq`` command line, driven through click's CliRunner on PostgreSQL and SQLite.

Every command is run as an operator would run it, against a real database, and checked through
its ``--json`` output (stable keys) or its exit code. Bad input must give a non-zero exit and
exactly one line on stderr, never a traceback. The worker runs as a real subprocess that gets
SIGTERM while a slow handler is in flight.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.engine import URL

from sqla_delayedq import DelayedQueue, ExponentialBackoff
from sqla_delayedq import _cli_admin as cli_admin
from sqla_delayedq.cli import cli
from tests.fix_db import Backend

UTC = timezone.utc
REPO = Path(__file__).resolve().parents[1]

on_pg_and_sqlite = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
on_all_backends = pytest.mark.parametrize(
    "backend", ["sqlite", "postgresql", "mariadb"], indirect=True
)

Run = Callable[..., Result]


def url_of(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def invoke(url: str | None, *args: str, input: str | None = None) -> Result:
    env: dict[str, str | None] = {"COLUMNS": "200", "DELAYEDQ_DEBUG": None}
    env["DELAYEDQ_DATABASE_URL"] = url
    return CliRunner().invoke(cli, list(args), input=input, env=env, catch_exceptions=False)


@pytest.fixture
def run(backend: Backend) -> Run:
    """Run ``delayedq ARGS`` against the backend's database (URL from the environment)."""

    def run_(*args: str, input: str | None = None) -> Result:
        return invoke(url_of(backend.url), *args, input=input)

    return run_


def run_json(run: Run, *args: str) -> Any:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_one_line_error(result: Result, exit_code: int, *fragments: str) -> None:
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def queue(name: str, **kwargs: Any) -> DelayedQueue[Any]:
    return DelayedQueue(name, retry=ExponentialBackoff(max_attempts=1), **kwargs)


def seed(backend: Backend) -> datetime:
    """emails: 1 dead, 1 in flight, 3 due (oldest 60 s late), 2 scheduled; sms: 1 due."""
    now = datetime.now(UTC)
    emails, sms = queue("emails"), queue("sms")
    with backend.Session() as s, s.begin():
        emails.offer(s, "e/dead", {"companyId": 7}, now - timedelta(seconds=300))
    with backend.Session() as s, s.begin():
        env = emails.try_poll(s)
        assert env is not None
        emails.nack(s, env, "ValueError: bad address")
    with backend.Session() as s, s.begin():
        emails.offer(s, "e/flight", {"companyId": 7}, now - timedelta(seconds=120))
    with backend.Session() as s, s.begin():
        assert emails.try_poll(s, lease=timedelta(hours=1)) is not None
    with backend.Session() as s, s.begin():
        emails.offer(s, "e/1", {"companyId": 3345, "name": "a"}, now - timedelta(seconds=60))
        emails.offer(s, "e/2", {"companyId": 1, "name": "b"}, now - timedelta(seconds=30))
        emails.offer(s, "e/3", {"companyId": 3345, "vip": True}, now - timedelta(seconds=10))
        emails.offer(s, "later/1", {"companyId": 3345}, now + timedelta(hours=1))
        emails.offer(s, "later/2", {"companyId": 2}, now + timedelta(hours=2))
        sms.offer(s, "s/1", {"companyId": 3345}, now - timedelta(seconds=5))
    return now


def rows(backend: Backend) -> dict[tuple[str, str], Any]:
    with backend.engine.connect() as conn:
        t = sa.table("delayed_queue", sa.column("queue"), sa.column("key"), sa.column("status"))
        result = conn.execute(sa.select(t.c.queue, t.c.key, t.c.status))
        return {(r.queue, r.key): r.status for r in result}


# -- packaging ---------------------------------------------------------------------------------


def test_importing_the_package_does_not_import_click_or_rich() -> None:
    code = (
        "import sys, sqla_delayedq, sqla_delayedq.cli, sqla_delayedq.metrics\n"
        "heavy = {'click', 'rich', 'prometheus_client', 'opentelemetry'} & set(sys.modules)\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_main_prints_an_install_hint_without_click() -> None:
    code = "import sys; sys.modules['click'] = None\nfrom sqla_delayedq.cli import main\nmain()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1
    assert done.stderr.strip() == "delayedq needs click: pip install 'sqla_delayedq[cli]'"


def test_help_lists_every_command() -> None:
    result = invoke(None, "--help")
    assert result.exit_code == 0
    for name in ("worker", "stats", "ls", "search", "show", "retry", "requeue", "drop"):
        assert name in result.stdout
    for name in ("reschedule", "cron", "db"):
        assert name in result.stdout


# -- database URL ------------------------------------------------------------------------------


def test_no_url_is_a_usage_error() -> None:
    assert_one_line_error(invoke(None, "stats"), 2, "DELAYEDQ_DATABASE_URL")


@pytest.mark.parametrize("url", ["not a url", "nosuchdialect://x/y"])
def test_bad_url_is_a_usage_error(url: str) -> None:
    assert_one_line_error(invoke(url, "stats"), 2, "bad database URL")


def test_unreachable_database_is_a_runtime_error() -> None:
    result = invoke("postgresql+psycopg://postgres@127.0.0.1:1/x?connect_timeout=2", "stats")
    assert_one_line_error(result, 1, "database error")


def test_url_flag_wins_over_the_environment(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        ["stats", "--url", f"sqlite:///{tmp_path / 'none.sqlite'}"],
        env={"DELAYEDQ_DATABASE_URL": "nosuchdialect://x"},
    )
    assert_one_line_error(result, 1, "table 'delayed_queue' does not exist", "db upgrade")


# -- stats -------------------------------------------------------------------------------------


@on_all_backends
def test_stats_counts_every_state_per_queue(backend: Backend, run: Run) -> None:
    seed(backend)
    doc = run_json(run, "stats")
    assert doc["table"] == "delayed_queue"
    datetime.fromisoformat(doc["now"])
    by_queue = {q["queue"]: q for q in doc["queues"]}
    assert list(by_queue) == ["emails", "sms"]
    emails = by_queue["emails"]
    assert {k: emails[k] for k in ("due", "scheduled", "in_flight", "dead", "done", "pending")} == {
        "due": 3,
        "scheduled": 2,
        "in_flight": 1,
        "dead": 1,
        "done": 0,
        "pending": 6,
    }
    assert 60 <= emails["lag_seconds"] < 600
    assert datetime.fromisoformat(emails["oldest_due"]).tzinfo is not None
    assert by_queue["sms"]["due"] == 1


@on_pg_and_sqlite
def test_stats_table_shows_queues_and_a_total(backend: Backend, run: Run) -> None:
    seed(backend)
    result = run("stats")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any(line.split()[:4] == ["emails", "3", "2", "1"] for line in lines if line.strip())
    assert any(line.startswith("total") for line in lines)


@on_pg_and_sqlite
def test_stats_of_one_queue_and_of_an_empty_table(backend: Backend, run: Run) -> None:
    result = run("stats")
    assert result.exit_code == 0
    assert "no messages" in result.stdout
    seed(backend)
    doc = run_json(run, "stats", "-q", "sms")
    assert [q["queue"] for q in doc["queues"]] == ["sms"]
    assert doc["queues"][0]["lag_seconds"] >= 5


@on_pg_and_sqlite
def test_stats_of_an_unknown_queue_fails_unless_missing_ok(backend: Backend, run: Run) -> None:
    seed(backend)
    assert_one_line_error(run("stats", "-q", "emials"), 1, "unknown queue 'emials'", "emails")
    doc = run_json(run, "stats", "-q", "emials", "--missing-ok")
    assert doc["queues"] == [
        {
            "queue": "emials",
            "due": 0,
            "scheduled": 0,
            "in_flight": 0,
            "dead": 0,
            "done": 0,
            "pending": 0,
            "oldest_due": None,
            "lag_seconds": 0.0,
        }
    ]


def test_an_invalid_queue_name_is_a_usage_error(tmp_path: Path) -> None:
    result = invoke(f"sqlite:///{tmp_path / 'x.sqlite'}", "stats", "-q", "x" * 101)
    assert_one_line_error(result, 2, "queue name", "limit is 100")


@on_pg_and_sqlite
def test_stats_counts_done_messages_kept_by_retention(backend: Backend, run: Run) -> None:
    q = queue("kept", retention=timedelta(days=1))
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"a": 1})
    with backend.Session() as s, s.begin():
        env = q.try_poll(s)
        assert env is not None
        q.ack(s, env)
    (only,) = run_json(run, "stats")["queues"]
    assert (only["done"], only["pending"], only["oldest_due"]) == (1, 0, None)


@on_pg_and_sqlite
def test_stats_watch_prints_json_lines_until_interrupted(backend: Backend) -> None:
    seed(backend)
    env = {**os.environ, "DELAYEDQ_DATABASE_URL": url_of(backend.url)}
    cmd = [sys.executable, "-m", "sqla_delayedq.cli", "stats", "--json", "--watch", "0.5"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first, second = proc.stdout.readline(), proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    for line in (first, second):
        assert [q["queue"] for q in json.loads(line)["queues"]] == ["emails", "sms"]


@on_pg_and_sqlite
def test_commands_work_on_a_table_of_ones_own(backend: Backend, run: Run) -> None:
    from sqla_delayedq._cli_base import model_for

    model = model_for("outbox_messages")
    table: sa.Table = model.__table__  # type: ignore[attr-defined]
    table.create(backend.engine)
    try:
        with backend.Session() as s, s.begin():
            DelayedQueue[Any]("mail", model=model).offer(s, "k", {"a": 1})
        (mail,) = run_json(run, "stats", "--table", "outbox_messages")["queues"]
        assert (mail["queue"], mail["due"]) == ("mail", 1)
        (m,) = run_json(run, "show", "k", "--table", "outbox_messages")["messages"]
        assert m["payload"] == {"a": 1}
        assert run_json(run, "stats")["queues"] == []  # the default table is another one
    finally:
        table.drop(backend.engine)


# -- ls / search / show ------------------------------------------------------------------------


@on_pg_and_sqlite
def test_ls_lists_messages_by_id_with_paging(backend: Backend, run: Run) -> None:
    seed(backend)
    first = run_json(run, "ls", "--limit", "3")
    assert [m["key"] for m in first["messages"]] == ["e/dead", "e/flight", "e/1"]
    rest = run_json(run, "ls", "--limit", "10", "--after-id", str(first["next_after_id"]))
    assert [m["key"] for m in rest["messages"]] == ["e/2", "e/3", "later/1", "later/2", "s/1"]
    assert rest["next_after_id"] is None
    m = first["messages"][0]
    assert list(m) == [
        "id",
        "queue",
        "key",
        "state",
        "status",
        "payload_type",
        "payload_encoding",
        "payload",
        "scheduled_at",
        "scheduled_at_initially",
        "created_at",
        "attempts",
        "last_attempt_at",
        "last_error",
        "lock_token",
    ]
    assert (m["state"], m["attempts"], m["scheduled_at"]) == ("dead", 1, None)
    assert m["last_error"].startswith("ValueError: bad address")
    assert m["created_at"].endswith("+00:00")


@on_pg_and_sqlite
def test_ls_filters_by_state_and_key_prefix(backend: Backend, run: Run) -> None:
    seed(backend)

    def keys(*args: str) -> list[str]:
        return [m["key"] for m in run_json(run, "ls", *args)["messages"]]

    assert keys("--state", "dead") == ["e/dead"]
    assert keys("--state", "in_flight") == ["e/flight"]
    assert keys("-q", "emails", "--state", "due") == ["e/1", "e/2", "e/3"]
    assert keys("--key-prefix", "later/") == ["later/1", "later/2"]
    result = run("ls", "-q", "emails", "--state", "scheduled")
    assert result.exit_code == 0
    assert "later/1" in result.stdout and "in 5" in result.stdout


@on_all_backends
def test_search_by_payload_field(backend: Backend, run: Run) -> None:
    seed(backend)
    doc = run_json(run, "search", "--where", "companyId=3345")
    assert doc["count"] == 4
    assert [(m["queue"], m["key"]) for m in doc["messages"]] == [
        ("emails", "e/1"),
        ("emails", "e/3"),
        ("emails", "later/1"),
        ("sms", "s/1"),
    ]
    doc = run_json(
        run, "search", "-q", "emails", "--where", "companyId=3345", "--where", "vip=true"
    )
    assert [m["key"] for m in doc["messages"]] == ["e/3"]
    doc = run_json(run, "search", "--where", "name=b", "--state", "due")
    assert [m["payload"] for m in doc["messages"]] == [{"companyId": 1, "name": "b"}]


@on_pg_and_sqlite
def test_search_table_shows_count_and_payloads(backend: Backend, run: Run) -> None:
    seed(backend)
    result = run("search", "-q", "emails", "--state", "due", "--where", "companyId=3345")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == "2 matching messages"
    assert '"name": "a"' in result.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--where", "companyId"], "is not FIELD=VALUE"),
        (["--where", "=3"], "is not FIELD=VALUE"),
        (["--where", "tags=[1,2]"], "only strings, numbers and booleans"),
        (["--where", "x=null"], "only strings, numbers and booleans"),
        (["--state", "sleeping"], "'sleeping' is not one of"),
        ([], "search needs a filter"),
        (["--limit", "0"], "--limit"),
    ],
)
@on_pg_and_sqlite
def test_malformed_filters_are_usage_errors(
    backend: Backend, run: Run, args: list[str], fragment: str
) -> None:
    assert_one_line_error(run("search", *args), 2, fragment)


@on_pg_and_sqlite
def test_ls_of_an_unknown_queue_fails(backend: Backend, run: Run) -> None:
    seed(backend)
    assert_one_line_error(run("ls", "-q", "nope"), 1, "unknown queue 'nope'")


@on_pg_and_sqlite
def test_show_a_message(backend: Backend, run: Run) -> None:
    seed(backend)
    (m,) = run_json(run, "show", "e/dead")["messages"]
    assert (m["queue"], m["state"], m["payload"]) == ("emails", "dead", {"companyId": 7})
    result = run("show", "-q", "emails", "e/dead")
    assert result.exit_code == 0
    assert "ValueError: bad address" in result.stdout
    assert '"companyId": 7' in result.stdout
    assert_one_line_error(run("show", "-q", "emails", "nope"), 1, "no message with key 'nope'")


@on_pg_and_sqlite
def test_show_payloads_of_any_serializer(backend: Backend, run: Run) -> None:
    from sqla_delayedq import BytesSerializer, JsonSerializer

    with backend.Session() as s, s.begin():
        DelayedQueue("raw", serializer=BytesSerializer()).offer(s, "b", b"\x00\x01hi")
        DelayedQueue[Any]("typed", serializer=JsonSerializer("invoice")).offer(s, "j", {"n": 1})
    (raw,) = run_json(run, "show", "b")["messages"]
    assert (raw["payload_encoding"], raw["payload"]) == ("base64", "AAFoaQ==")
    (typed,) = run_json(run, "show", "j")["messages"]
    assert (typed["payload_type"], typed["payload"]) == ("invoice", {"n": 1})


# -- retry / requeue ---------------------------------------------------------------------------


@on_pg_and_sqlite
def test_retry_a_dead_message(backend: Backend, run: Run) -> None:
    seed(backend)
    doc = run_json(run, "retry", "-q", "emails", "e/dead")
    assert doc == {"retried": ["e/dead"], "not_dead": [], "queues": {"emails": 1}}
    (m,) = run_json(run, "show", "e/dead")["messages"]
    assert (m["state"], m["attempts"]) == ("due", 0)
    assert m["last_error"].startswith("ValueError")  # kept for the record


@on_pg_and_sqlite
def test_retry_of_a_key_that_is_not_dead_exits_1(backend: Backend, run: Run) -> None:
    seed(backend)
    result = run("retry", "e/1", "nope")
    assert result.exit_code == 1
    assert result.stderr.strip() == "not dead or not found: e/1, nope"


def seed_dead(backend: Backend, n: int, name: str = "bulk") -> None:
    q = queue(name)
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"d/{i:05}", {"i": i, "companyId": i % 3}) for i in range(n)])
    with backend.Session() as s, s.begin():
        for env in q.try_poll_many(s, n):
            q.nack(s, env, "boom")


@on_pg_and_sqlite
def test_requeue_dead_messages_in_chunks(
    backend: Backend, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_dead(backend, 50)
    monkeypatch.setattr(cli_admin, "CHUNK", 7)
    doc = run_json(run, "requeue", "--dry-run")
    assert (doc["matched"], doc["changed"], doc["dry_run"]) == (50, 0, True)
    doc = run_json(run, "requeue", "-q", "bulk", "--where", "companyId=0")
    assert (doc["matched"], doc["changed"]) == (17, 17)
    result = run("requeue", "--in", "1h")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "requeue: 33 messages"
    (stats,) = run_json(run, "stats")["queues"]
    assert (stats["dead"], stats["due"], stats["scheduled"]) == (0, 17, 33)


# -- drop --------------------------------------------------------------------------------------


@on_pg_and_sqlite
def test_drop_asks_for_confirmation(backend: Backend, run: Run) -> None:
    seed(backend)
    result = run("drop", "-q", "emails", "--key-prefix", "later/", input="n\n")
    assert result.exit_code == 1
    assert "Drop 2 messages (queue emails; keys starting 'later/')?" in result.stderr
    assert ("emails", "later/1") in rows(backend)
    result = run("drop", "-q", "emails", "--key-prefix", "later/", input="y\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "drop: 2 messages"
    assert not any(key.startswith("later/") for _, key in rows(backend))


@on_pg_and_sqlite
def test_drop_with_yes_by_state_keys_and_all(
    backend: Backend, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(backend)
    seed_dead(backend, 30)
    monkeypatch.setattr(cli_admin, "CHUNK", 4)
    doc = run_json(run, "drop", "--state", "dead", "--yes")
    assert (doc["matched"], doc["changed"], doc["queues"]) == (
        31,
        31,
        {"bulk": 30, "emails": 1, "sms": 0},
    )
    assert run_json(run, "drop", "e/1", "s/1", "nope", "--yes")["changed"] == 2
    doc = run_json(run, "drop", "-q", "emails", "--all", "--dry-run")
    assert (doc["matched"], doc["changed"]) == (5, 0)
    assert run_json(run, "drop", "-q", "emails", "--all", "-y")["changed"] == 5
    assert set(rows(backend)) == set()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "say what to drop"),
        (["--all"], "--all needs the queue(s) named with -q"),
        (["-q", "emails", "--all", "--state", "dead"], "without keys or filters"),
        (["--where", "a"], "is not FIELD=VALUE"),
    ],
)
def test_drop_refuses_unclear_requests(args: list[str], fragment: str, tmp_path: Path) -> None:
    result = invoke(f"sqlite:///{tmp_path / 'x.sqlite'}", "drop", *args, "--yes")
    assert_one_line_error(result, 2, fragment)


@on_pg_and_sqlite
def test_drop_of_nothing_asks_nothing(backend: Backend, run: Run) -> None:
    seed(backend)
    result = run("drop", "--key-prefix", "zzz")
    assert result.exit_code == 0
    assert result.stdout.strip() == "would drop 0 messages"


# -- reschedule --------------------------------------------------------------------------------


@on_pg_and_sqlite
def test_reschedule_to_now_and_later(backend: Backend, run: Run) -> None:
    seed(backend)
    doc = run_json(run, "reschedule", "-q", "emails", "later/2")
    assert doc["changed"] == 1
    assert run_json(run, "show", "later/2")["messages"][0]["state"] == "due"
    doc = run_json(run, "reschedule", "-q", "emails", "--state", "due", "--in", "2h")
    assert doc["changed"] == 4  # e/1, e/2, e/3 and later/2; the message in flight keeps its lease
    (emails,) = run_json(run, "stats", "-q", "emails")["queues"]
    assert (emails["due"], emails["scheduled"], emails["in_flight"]) == (0, 5, 1)
    at = "2031-01-02T03:04:05+01:00"
    assert run_json(run, "reschedule", "later/1", "--at", at)["changed"] == 1
    scheduled = run_json(run, "show", "later/1")["messages"][0]["scheduled_at"]
    assert scheduled == "2031-01-02T02:04:05+00:00"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["k", "--at", "2031-01-02T03:04:05"], "has no UTC offset"),
        (["k", "--at", "tomorrow"], "is not an ISO 8601 datetime"),
        (["k", "--in", "soon"], "is not a duration"),
        (["k", "--in", "5m", "--at", "now"], "give --at or --in, not both"),
        ([], "say what to reschedule"),
    ],
)
def test_reschedule_bad_input(args: list[str], fragment: str, tmp_path: Path) -> None:
    result = invoke(f"sqlite:///{tmp_path / 'x.sqlite'}", "reschedule", *args)
    assert_one_line_error(result, 2, fragment)


# -- cron --------------------------------------------------------------------------------------


@on_pg_and_sqlite
def test_cron_ls(backend: Backend, run: Run) -> None:
    from sqla_delayedq.cron import CronConfig, PeriodicTick, install_tick

    config = CronConfig("reports", PeriodicTick(timedelta(minutes=10)))
    with backend.Session() as s, s.begin():
        install_tick(s, DelayedQueue[Any]("cron"), config, lookahead=timedelta(hours=1))
    (entry,) = run_json(run, "cron", "ls")["cron"]
    assert (entry["queue"], entry["prefix"], entry["current"]) == ("cron", "reports", True)
    assert entry["config_hash"] == config.config_hash
    assert entry["schedule"] == {"kind": "periodic", "period_seconds": 600}
    assert entry["counts"]["scheduled"] >= 5
    next_tick = datetime.fromisoformat(entry["next_tick"])
    assert next_tick.minute % 10 == 0 and next_tick.second == 0
    result = run("cron", "ls", "-q", "cron")
    assert result.exit_code == 0
    assert "reports" in result.stdout and config.config_hash in result.stdout
    assert run_json(run, "cron", "ls", "--prefix", "other")["cron"] == []


# -- db ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fresh_database", ["sqlite", "postgresql"], indirect=True)
def test_db_upgrade_and_current(fresh_database: tuple[str, URL]) -> None:
    _, url = fresh_database
    u = url_of(url)
    result = invoke(u, "db", "current")
    assert result.exit_code == 0, result.output
    assert "not initialised" in result.stdout
    assert json.loads(invoke(u, "db", "current", "--json").stdout)["up_to_date"] is False
    result = invoke(u, "db", "upgrade")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "upgraded base -> 0001"
    assert invoke(u, "db", "upgrade").stdout.strip() == "already at 0001"
    doc = json.loads(invoke(u, "db", "current", "--json").stdout)
    assert doc == {"current": ["0001"], "heads": ["0001"], "up_to_date": True}
    assert "0001 (head)" in invoke(u, "db", "current").stdout
    assert "no messages" in invoke(u, "stats").stdout


def test_db_upgrade_sql_prints_the_ddl(tmp_path: Path) -> None:
    result = invoke(f"sqlite:///{tmp_path / 'x.sqlite'}", "db", "upgrade", "--sql")
    assert result.exit_code == 0, result.output
    assert "CREATE TABLE delayed_queue" in result.stdout
    assert not (tmp_path / "x.sqlite").exists() or (tmp_path / "x.sqlite").stat().st_size == 0


def test_db_commands_need_an_alembic_directory(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.sqlite'}"
    result = invoke(url, "db", "upgrade", "--script-location", str(tmp_path))
    assert_one_line_error(result, 1, "no Alembic environment")


# -- worker ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["tests.cli_handlers", "-q", "q"], "is not module:function"),
        (["tests.nope:handle", "-q", "q"], "cannot import handler module 'tests.nope'"),
        (["tests.cli_handlers:nope", "-q", "q"], "has no attribute 'nope'"),
        (["tests.cli_handlers:not_callable", "-q", "q"], "is not callable"),
        (["tests.cli_handlers:slow"], "Missing option '--queue'"),
        (["tests.cli_handlers:slow", "-q", "q", "--mode", "fast"], "'fast' is not one of"),
        (["tests.cli_handlers:slow", "-q", "q", "--lease", "0"], "must be greater than 0"),
        (["tests.cli_handlers:slow", "-q", "q", "--concurrency", "0"], "--concurrency"),
    ],
)
def test_worker_bad_input(args: list[str], fragment: str, tmp_path: Path) -> None:
    result = invoke(f"sqlite:///{tmp_path / 'x.sqlite'}", "worker", *args)
    assert_one_line_error(result, 2, fragment)


@pytest.fixture
def events(tmp_path: Path) -> Path:
    return tmp_path / "events.txt"


@pytest.fixture
def start_worker(backend: Backend, events: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        env = {
            **os.environ,
            "DELAYEDQ_DATABASE_URL": url_of(backend.url),
            "DELAYEDQ_TEST_OUT": str(events),
        }
        cmd = [sys.executable, "-m", "sqla_delayedq.cli", "worker", *args]
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def wait_for(events: Path, line: str, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if events.exists() and line in events.read_text().splitlines():
            return
        if proc.poll() is not None:
            pytest.fail(f"worker exited with {proc.returncode}: {proc.communicate()[1]}")
        time.sleep(0.05)
    pytest.fail(f"no {line!r} in {timeout} s")


@pytest.mark.parametrize("mode", ["lease", "transactional"])
@on_pg_and_sqlite
def test_worker_finishes_in_flight_work_on_sigterm_and_exits_0(
    backend: Backend, events: Path, start_worker: Callable[..., subprocess.Popen[str]], mode: str
) -> None:
    with backend.Session() as s, s.begin():
        DelayedQueue[Any]("jobs").offer(s, "job-1", {"sleep": 2.0})
    handler = (
        "tests.cli_handlers:slow" if mode == "lease" else "tests.cli_handlers:slow_transactional"
    )
    proc = start_worker(
        handler, "-q", "jobs", "--concurrency", "2", "--mode", mode, "--poll-interval", "0.2"
    )
    wait_for(events, "start job-1", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert events.read_text().splitlines() == ["start job-1", "done job-1"]
    assert rows(backend) == {}  # acknowledged before exiting
    assert "stopped cleanly" in stderr


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_worker_releases_what_outlives_the_drain_timeout_and_exits_1(
    backend: Backend, events: Path, start_worker: Callable[..., subprocess.Popen[str]]
) -> None:
    with backend.Session() as s, s.begin():
        DelayedQueue[Any]("jobs").offer(s, "job-1", {"sleep": 30.0})
    proc = start_worker(
        "tests.cli_handlers:slow", "-q", "jobs", "--poll-interval", "0.2", "--drain-timeout", "0.5"
    )
    wait_for(events, "start job-1", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "did not finish within the drain timeout" in stderr
    assert "done job-1" not in events.read_text()
    (m,) = json.loads(invoke(url_of(backend.url), "show", "job-1", "--json").stdout)["messages"]
    assert (m["state"], m["lock_token"]) == ("due", None)  # released: due again at once


@on_pg_and_sqlite
def test_worker_records_failures(
    backend: Backend, events: Path, start_worker: Callable[..., subprocess.Popen[str]]
) -> None:
    with backend.Session() as s, s.begin():
        DelayedQueue[Any]("jobs").offer(s, "job-1", {})
    proc = start_worker(
        "tests.cli_handlers:failing", "-q", "jobs", "--max-attempts", "1", "--poll-interval", "0.2"
    )
    wait_for(events, "fail job-1", proc)
    deadline = time.monotonic() + 30
    while rows(backend).get(("jobs", "job-1")) != "dead" and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    (m,) = json.loads(invoke(url_of(backend.url), "show", "job-1", "--json").stdout)["messages"]
    assert m["state"] == "dead"
    assert "RuntimeError: cannot handle job-1" in m["last_error"]
