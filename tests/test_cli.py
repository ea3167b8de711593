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
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.engine import URL

from sqla_delayedq import DelayedMessage, DelayedQueue, ExponentialBackoff, MessageFilter
from sqla_delayedq import _cli_admin as cli_admin
from sqla_delayedq.cli import cli
from sqla_delayedq.entity import EntityQueue
from tests.fix_db import Backend

REPO = Path(__file__).resolve().parents[1]

on_pg_and_sqlite = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
on_all_backends = pytest.mark.parametrize(
    "backend", ["sqlite", "postgresql", "mariadb"], indirect=True
)

Run = Callable[..., Result]


def url_of(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def invoke(
    url: str | None, *args: str, input: str | None = None, env: dict[str, str] | None = None
) -> Result:
    environ: dict[str, str | None] = {"COLUMNS": "200", "DELAYEDQ_DEBUG": None}
    environ["DELAYEDQ_DATABASE_URL"] = url
    environ.update(env or {})
    return CliRunner().invoke(cli, list(args), input=input, env=environ, catch_exceptions=False)


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
    assert_one_line_error(result, 2, "no SQLite database at", "none.sqlite")  # the flag's URL


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
            "capped": [],
        }
    ]


@on_all_backends
def test_stats_at_most_caps_each_count_and_says_which(backend: Backend, run: Run) -> None:
    """emails: 3 due, 2 scheduled, 1 in flight, 1 dead; sms: 1 due."""
    seed(backend)
    exact = run_json(run, "stats")
    assert exact["at_most"] is None
    assert all(q["capped"] == [] for q in exact["queues"])
    doc = run_json(run, "stats", "--at-most", "2")
    assert doc["at_most"] == 2
    emails, sms = doc["queues"]
    assert {k: emails[k] for k in ("due", "scheduled", "in_flight", "dead", "done")} == {
        "due": 2,
        "scheduled": 2,
        "in_flight": 1,
        "dead": 1,
        "done": 0,
    }
    assert emails["capped"] == ["due"]
    assert emails["lag_seconds"] == pytest.approx(exact["queues"][0]["lag_seconds"], abs=5)
    assert (sms["due"], sms["capped"]) == (1, [])
    # At or above every count, the bounded read is the exact one (the lag moves with the clock).
    below = run_json(run, "stats", "--at-most", "3")
    assert below == {**exact, "now": ANY, "at_most": 3, "queues": ANY}
    assert [{**q, "lag_seconds": ANY} for q in below["queues"]] == exact["queues"]


@on_pg_and_sqlite
def test_stats_table_marks_capped_counts_with_a_plus(backend: Backend, run: Run) -> None:
    seed(backend)
    result = run("stats", "--at-most", "2")
    assert result.exit_code == 0, result.output
    lines = [line.split() for line in result.stdout.splitlines() if line.strip()]
    assert any(line[:6] == ["emails", "2+", "2", "1", "1", "0"] for line in lines), result.stdout
    assert any(line[:3] == ["total", "3+", "2"] for line in lines), result.stdout


def test_stats_at_most_must_be_positive(tmp_path: Path) -> None:
    result = invoke(f"sqlite:///{tmp_path / 'x.sqlite'}", "stats", "--at-most", "0")
    assert_one_line_error(result, 2, "--at-most", "0")


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
        "headers",
        "group",
        "priority",
    ]
    assert (m["state"], m["attempts"], m["scheduled_at"]) == ("dead", 1, None)
    assert m["headers"] == {}
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
def test_reschedule_with_a_priority(backend: Backend, run: Run) -> None:
    q: DelayedQueue[Any] = DelayedQueue("emails", priorities=True)
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [("p/1", {}), ("p/2", {})])
    result = run("reschedule", "-q", "emails", "p/2", "--priority", "7", "--json")
    assert result.exit_code == 0, result.output
    (m,) = run_json(run, "show", "p/2")["messages"]
    assert m["priority"] == 7
    assert "priority" in run("show", "-q", "emails", "p/2").stdout
    with backend.Session() as s, s.begin():
        assert [e.key for e in q.try_poll_many(s, 2)] == ["p/2", "p/1"]
    bad = run("reschedule", "-q", "emails", "p/1", "--priority", "-1")
    assert bad.exit_code == 2 and "Traceback" not in bad.output


@on_pg_and_sqlite
def test_show_a_messages_headers(backend: Backend, run: Run) -> None:
    with backend.Session() as s, s.begin():
        DelayedQueue[Any]("emails").offer(s, "h/1", {"n": 1}, headers={"request-id": "req-9"})
    (m,) = run_json(run, "show", "h/1")["messages"]
    assert (m["headers"], m["group"]) == ({"request-id": "req-9"}, None)
    result = run("show", "-q", "emails", "h/1")
    assert result.exit_code == 0
    assert "header request-id" in result.stdout and "req-9" in result.stdout


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


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"], indirect=True)
def test_retry_lists_only_the_keys_it_retried_when_another_retry_races_it(
    backend: Backend, run: Run
) -> None:
    """Another operator retried the key while this command waited for it: this command
    changed nothing, and says so (not dead any more), instead of listing it as retried."""
    seed(backend)
    held, done = threading.Event(), threading.Event()

    def other_operator() -> None:
        with backend.Session() as s, s.begin():
            assert queue("emails").requeue_dead(s, MessageFilter(keys=("e/dead",))) == 1
            held.set()
            time.sleep(2)  # the command below waits for this transaction
        done.set()

    racer = threading.Thread(target=other_operator)
    racer.start()
    try:
        assert held.wait(30)
        result = run("retry", "-q", "emails", "e/dead", "--json")
    finally:
        racer.join(30)
    assert done.is_set()
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc == {"retried": [], "not_dead": ["e/dead"], "queues": {"emails": 0}}


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
def test_drop_changes_no_more_than_it_asked_to_confirm(
    backend: Backend, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The question said "Drop 2 messages", and the command then dropped whatever matched
    when it ran, a message offered while the question waited included."""
    seed(backend)

    def answer(*args: Any, **kwargs: Any) -> bool:
        with backend.Session() as s, s.begin():  # offered while the question waits
            DelayedQueue[Any]("emails").offer(s, "later/9", {"late": True})
        return True

    monkeypatch.setattr("click.confirm", answer)
    result = run("drop", "-q", "emails", "--key-prefix", "later/")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "drop: 2 messages"
    assert [key for _, key in rows(backend) if key.startswith("later/")] == ["later/9"]


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
        # Were tracebacks (an OverflowError): past what a timedelta, or now + it, holds.
        (["k", "--in", "99999999999d"], "longer than any duration"),
        (["k", "--in", "3000000d"], "--in must be at most 365000 days"),
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


def packaged_head() -> str:
    from alembic.script import ScriptDirectory

    from sqla_delayedq.migrations import SCRIPT_DIR

    head = ScriptDirectory(str(SCRIPT_DIR)).get_current_head()
    assert head is not None
    return head


@pytest.mark.parametrize("fresh_database", ["sqlite", "postgresql", "mariadb"], indirect=True)
def test_db_upgrade_and_current(fresh_database: tuple[str, URL]) -> None:
    _, url = fresh_database
    u, head = url_of(url), packaged_head()
    result = invoke(u, "db", "current")
    assert result.exit_code == 0, result.output
    assert "not initialised" in result.stdout
    assert json.loads(invoke(u, "db", "current", "--json").stdout)["up_to_date"] is False
    result = invoke(u, "db", "upgrade")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"upgraded base -> {head}"
    assert invoke(u, "db", "upgrade").stdout.strip() == f"already at {head}"
    doc = json.loads(invoke(u, "db", "current", "--json").stdout)
    assert doc == {"current": [head], "heads": [head], "up_to_date": True}
    assert f"{head} (head)" in invoke(u, "db", "current").stdout
    assert "no messages" in invoke(u, "stats").stdout
    tables = set(sa.inspect(sa.create_engine(url, poolclass=sa.NullPool)).get_table_names())
    # The message table, the dashboard's two, the controls and our own version table (not
    # alembic_version).
    assert tables == {
        "delayed_queue",
        "delayedq_workers",
        "delayedq_stats",
        "delayedq_queue_controls",
        "alembic_version_sqla_delayedq",
    }


def test_db_upgrade_sql_prints_the_ddl(tmp_path: Path) -> None:
    result = invoke(f"sqlite:///{tmp_path / 'x.sqlite'}", "db", "upgrade", "--sql")
    assert result.exit_code == 0, result.output
    assert "CREATE TABLE delayed_queue" in result.stdout
    assert "CREATE TABLE alembic_version_sqla_delayedq" in result.stdout
    assert not (tmp_path / "x.sqlite").exists() or (tmp_path / "x.sqlite").stat().st_size == 0


def test_db_upgrade_refuses_a_table_another_history_created(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.sqlite'}"
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    DelayedMessage.metadata.create_all(engine)

    for command in ("upgrade", "current"):
        result = invoke(url, "db", command)
        assert_one_line_error(result, 1, "table 'delayed_queue' exists", "sqla_delayedq@head")
    assert set(sa.inspect(engine).get_table_names()) == {
        "delayed_queue",
        "delayedq_workers",
        "delayedq_stats",
        "delayedq_queue_controls",
    }


# -- worker ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["tests.cli_handlers", "-q", "q"], "is not module:attribute"),
        (["tests.nope:handle", "-q", "q"], "cannot import module 'tests.nope'"),
        (["tests.cli_handlers:nope", "-q", "q"], "has no attribute 'nope'"),
        (["tests.cli_handlers:not_callable", "-q", "q"], "is an int: pass a Worker"),
        (["tests.cli_handlers:slow"], "Missing option '--queue'"),
        (["tests.cli_app:make_nothing"], "make_nothing() returned int"),
        (["tests.cli_app:jobs"], "returned DelayedQueue"),
        (["tests.cli_handlers:slow", "-q", "q", "--mode", "fast"], "'fast' is not one of"),
        (["tests.cli_handlers:slow", "-q", "q", "--lease", "0"], "must be greater than 0"),
        (["tests.cli_handlers:slow", "-q", "q", "--concurrency", "0"], "--concurrency"),
        (
            ["tests.cli_handlers:slow", "-q", "q", "--handler-timeout", "0"],
            "--handler-timeout must be greater than 0",
        ),
    ],
)
def test_worker_bad_input(
    args: list[str], fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELAYEDQ_TEST_APP_URL", f"sqlite:///{tmp_path / 'app.sqlite'}")
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
    # Released, uncounted, due when a lease from the stop ends (not beside a running handler).
    assert (m["state"], m["lock_token"], m["attempts"]) == ("scheduled", None, 0)


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


# -- worker TARGET: a worker of one's own --------------------------------------------------------

APP_URL_VAR = "DELAYEDQ_TEST_APP_URL"


@pytest.fixture
def app_tables(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """tests.cli_app's tables in the backend's database, and its URL in its setting."""
    monkeypatch.setenv(APP_URL_VAR, url_of(backend.url))
    from tests import cli_app

    cli_app.Base.metadata.create_all(backend.engine)
    try:
        yield
    finally:
        cli_app.Base.metadata.drop_all(backend.engine)


def offer_orders(backend: Backend, *keys: str) -> None:
    from tests.cli_app import Order, audit, jobs

    q = jobs()
    with backend.Session() as s, s.begin():
        for i, key in enumerate(keys, 1):
            if key.startswith("audit/"):
                audit().offer(s, key, {"n": i})
            else:
                q.offer(s, key, Order(i, 1234 * i))


def app_rows(backend: Backend) -> dict[str, tuple[str, int]]:
    with backend.engine.connect() as conn:
        t = sa.table("app_jobs", sa.column("key"), sa.column("status"), sa.column("attempts"))
        return {r.key: (r.status, r.attempts) for r in conn.execute(sa.select(t))}


def wait_for_prefix(
    events: Path, prefix: str, proc: subprocess.Popen[str], timeout: float = 60
) -> str:
    """The first event line starting with ``prefix``, once it is written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if events.exists():
            for line in events.read_text().splitlines():
                if line.startswith(prefix):
                    return line
        if proc.poll() is not None:
            pytest.fail(f"worker exited with {proc.returncode}: {proc.communicate()[1]}")
        time.sleep(0.05)
    pytest.fail(f"no event starting {prefix!r} in {timeout} s")


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not {what} after {timeout} s")
        time.sleep(0.05)


def handled(line: str) -> tuple[str, str, int, float]:
    """``handled KEY TYPE TOTAL LEASE`` -> (key, payload type, total in cents, lease left)."""
    _, key, type_name, total, lease = line.split()
    return key, type_name, int(total), float(lease)


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> str:
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    return stderr


@on_all_backends
def test_worker_runs_a_worker_of_ones_own_with_its_lease_serializer_and_retry_policy(
    backend: Backend,
    app_tables: None,
    events: Path,
    start_worker: Callable[..., subprocess.Popen[str]],
) -> None:
    offer_orders(backend, "o/1", "fail/2")
    proc = start_worker("tests.cli_app:worker")
    key, type_name, total, lease = handled(wait_for_prefix(events, "handled o/1 ", proc))
    # The app's serializer decoded {"id": 1, "total": "12.34"} into an Order; its 2-hour lease
    # (not the command line's 300 s default) was in force when the handler started.
    assert (key, type_name, total) == ("o/1", "Order", 1234)
    assert 7000 < lease <= 7200
    wait_for_prefix(events, "handled fail/2 ", proc)
    # The app's retry policy (one attempt) made it dead at once; the default would retry it.
    wait_until(lambda: app_rows(backend).get("fail/2") == ("dead", 1), "dead after 1 attempt")
    wait_until(lambda: "o/1" not in app_rows(backend), "o/1 acknowledged")
    stderr = stop(proc)
    assert proc.returncode == 0, stderr
    assert "running tests.cli_app:worker: Worker serving jobs (app_jobs)" in stderr
    assert "stopped cleanly" in stderr
    assert sorted(line.split()[1] for line in events.read_text().splitlines()) == ["fail/2", "o/1"]


@on_all_backends
def test_worker_runs_an_async_worker_a_function_of_ones_own_returns(
    backend: Backend,
    app_tables: None,
    events: Path,
    start_worker: Callable[..., subprocess.Popen[str]],
) -> None:
    offer_orders(backend, "o/1")
    proc = start_worker("tests.cli_app:make_async_worker")
    key, type_name, total, lease = handled(wait_for_prefix(events, "handled o/1 ", proc))
    assert (key, type_name, total) == ("o/1", "Order", 1234)
    assert 7000 < lease <= 7200
    wait_until(lambda: app_rows(backend) == {}, "o/1 acknowledged")
    stderr = stop(proc, signal.SIGINT)
    assert proc.returncode == 0, stderr
    assert "AsyncWorker serving jobs (app_jobs)" in stderr


@on_all_backends
def test_worker_runs_a_worker_of_ones_own_that_serves_an_entity_queue(
    backend: Backend,
    app_tables: None,
    events: Path,
    start_worker: Callable[..., subprocess.Popen[str]],
) -> None:
    """Workers serve entity queues (workers.md): the table check before the run knows an
    entity-queue table from a message table, and still refuses a table that is neither."""
    from tests.cli_app import Shipment

    offer_orders(backend, "o/1")
    with backend.Session() as s, s.begin():
        shipment = Shipment(id=7, address="Main Street 1")
        s.add(shipment)
        EntityQueue(Shipment).schedule(s, shipment)
    proc = start_worker("tests.cli_app:make_entity_worker")
    wait_for_prefix(events, "shipped 7 Main Street 1", proc)
    wait_for_prefix(events, "handled o/1 ", proc)
    stderr = stop(proc)
    assert proc.returncode == 0, stderr
    assert "serving jobs (app_jobs), app_shipments (app_shipments)" in stderr
    with backend.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE app_shipments"))
        conn.execute(
            sa.text("CREATE TABLE app_shipments (id INTEGER PRIMARY KEY, address VARCHAR(200))")
        )
    proc = start_worker("tests.cli_app:make_entity_worker")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert (
        "table 'app_shipments' in " in stderr
        and "is not an entity-queue table: it lacks the EntityQueueMixin column "
        "queue_next_attempt_at"
        in stderr
    ), stderr


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (["-q", "jobs"], "--queue"),
        (["--mode", "transactional"], "--mode"),
        (["--lease", "5m"], "--lease"),
        (["--serializer", "bytes"], "--serializer"),
        (["--payload-type", "order"], "--payload-type"),
        (["--max-attempts", "3"], "--max-attempts"),
        (["--batch-size", "10"], "--batch-size"),
        (["--handler-timeout", "1m"], "--handler-timeout"),
        (["--url", "sqlite://"], "--url"),
        (["--table", "app_jobs"], "--table"),
        (["--concurrency", "8"], "--concurrency"),
        (["-c", "8"], "--concurrency"),
        (["--poll-interval", "1"], "--poll-interval"),
        (["--drain-timeout", "1"], "--drain-timeout"),
        (["--no-listen"], "--no-listen"),
        (["--groups"], "--groups"),
        (["--dead-blocks-group"], "--dead-blocks-group"),
        (["--priorities"], "--priorities"),
        (["--priority-aging", "5m"], "--priority-aging"),
        (["--otel"], "--otel"),
    ],
)
@pytest.mark.parametrize("target", ["tests.cli_app:empty_worker", "tests.cli_app:make_worker"])
def test_worker_refuses_flags_that_a_worker_of_ones_own_decides(
    args: list[str], flags: str, target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # empty_worker fails at once if it is ever run, and make_worker is never called: a flag that
    # is not refused ends the test with another error instead of running a worker.
    monkeypatch.setenv(APP_URL_VAR, f"sqlite:///{tmp_path / 'app.sqlite'}")
    result = invoke(None, "worker", target, *args)
    assert_one_line_error(result, 2, f"{flags} does not apply to {target}", "set it on your Worker")
    assert not (tmp_path / "app.sqlite").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--dead-blocks-group"], "--dead-blocks-group needs --groups"),
        (["--priority-aging", "5m"], "--priority-aging needs --priorities"),
        (["--priorities", "--priority-aging", "0"], "--priority-aging must be greater than 0"),
    ],
)
def test_worker_refuses_group_and_priority_flags_that_cannot_work(
    args: list[str], fragment: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'q.sqlite'}"
    result = invoke(url, "worker", "tests.cli_handlers:with_pid", "-q", "jobs", *args)
    assert_one_line_error(result, 2, fragment)


def test_worker_names_every_refused_flag_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(APP_URL_VAR, f"sqlite:///{tmp_path / 'app.sqlite'}")
    result = invoke(None, "worker", "tests.cli_app:empty_worker", "--lease", "5m", "-q", "jobs")
    assert_one_line_error(
        result,
        2,
        "--queue, --lease do not apply",
        "set them on your Worker (the queues registered on it; DelayedQueue(lease=...)",
    )


@pytest.mark.parametrize("args", [["-q", "q"], []])
def test_worker_refuses_an_async_function_and_says_to_build_an_async_worker(
    args: list[str], tmp_path: Path
) -> None:
    result = invoke(
        f"sqlite:///{tmp_path / 'x.sqlite'}", "worker", "tests.cli_handlers:async_handler", *args
    )
    assert_one_line_error(
        result, 2, "is an async function", "build an AsyncWorker", "pass module:worker"
    )


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
def test_worker_that_stops_on_an_error_exits_1_with_one_line(
    backend: Backend,
    app_tables: None,
    events: Path,
    start_worker: Callable[..., subprocess.Popen[str]],
) -> None:
    from tests import cli_app

    offer_orders(backend, "o/1")
    proc = start_worker("tests.cli_app:worker")
    wait_for_prefix(events, "handled o/1 ", proc)
    table: sa.Table = cli_app.JobMessage.__table__  # type: ignore[assignment]
    table.drop(backend.engine)  # under the running worker
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("Error: delayedq-worker stopped on an error it cannot retry: "), last
    assert "app_jobs" in last
    assert "Traceback" in stderr  # logged by the worker before the one-line error


@pytest.mark.parametrize(
    "target", [["tests.cli_app:worker"], ["tests.cli_handlers:slow", "-q", "jobs"]]
)
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_worker_log_level_applies_to_both_forms(
    backend: Backend,
    app_tables: None,
    events: Path,
    start_worker: Callable[..., subprocess.Popen[str]],
    target: list[str],
) -> None:
    offer_orders(backend, "o/1")
    with backend.Session() as s, s.begin():
        DelayedQueue[Any]("jobs").offer(s, "job-1", {"sleep": 0})
    proc = start_worker(*target, "--log-level", "WARNING")
    wait_for_prefix(events, "handled o/1" if "cli_app" in target[0] else "done job-1", proc)
    stderr = stop(proc)
    assert proc.returncode == 0, stderr
    assert "INFO" not in stderr and "stopped cleanly" not in stderr, stderr


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_worker_metrics_port_adds_prometheus_to_a_worker_of_ones_own(
    backend: Backend,
    app_tables: None,
    events: Path,
    start_worker: Callable[..., subprocess.Popen[str]],
) -> None:
    import urllib.request

    offer_orders(backend, "o/1", "fail/2")
    port = free_port()
    proc = start_worker("tests.cli_app:worker", "--metrics-port", str(port))
    wait_for_prefix(events, "handled fail/2 ", proc)
    expected = (
        'delayedq_processed_total{queue="jobs"} 1.0',
        'delayedq_dead_total{queue="jobs"} 1.0',
        'delayedq_messages{queue="jobs",state="dead"} 1.0',
    )

    def scraped() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return all(line in text.splitlines() for line in expected)

    wait_until(scraped, "the worker's counts and the app table's depth in /metrics")
    stderr = stop(proc)
    assert proc.returncode == 0, stderr


# -- --app: the table and the database of one's own worker ---------------------------------------


@on_all_backends
@pytest.mark.parametrize("app", ["tests.cli_app:make_worker", "tests.cli_app:make_async_worker"])
def test_app_commands_read_the_table_of_ones_own_worker(
    backend: Backend, app_tables: None, app: str
) -> None:
    offer_orders(backend, "o/1", "o/2")

    def app_json(*args: str, env: dict[str, str] | None = None) -> Any:
        # A database URL in the environment that would fail: --app brings the app's engine.
        result = invoke("nosuchdialect://x", *args, "--json", env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    doc = app_json("stats", "--app", app)
    assert doc["table"] == "app_jobs"
    assert [(q["queue"], q["due"]) for q in doc["queues"]] == [("jobs", 2)]
    doc = app_json("ls", "--app", app)
    assert [(m["key"], m["payload_type"]) for m in doc["messages"]] == [
        ("o/1", "order"),
        ("o/2", "order"),
    ]
    (m,) = app_json("show", "o/2", "--app", app)["messages"]
    assert m["payload"] == {"id": 2, "total": "24.68"}  # as the app's serializer stored it
    doc = app_json("stats", env={"DELAYEDQ_APP": app})
    assert doc["table"] == "app_jobs"
    assert run_json(lambda *a: invoke(url_of(backend.url), *a), "stats")["queues"] == []


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
def test_app_admin_commands_change_the_table_of_ones_own_worker(
    backend: Backend, app_tables: None
) -> None:
    offer_orders(backend, "o/1", "o/2")
    app = "tests.cli_app:make_worker"
    result = invoke(None, "reschedule", "--app", app, "o/1", "--in", "1h", "--json")
    assert json.loads(result.stdout)["changed"] == 1, result.output
    result = invoke(None, "drop", "--app", app, "o/2", "--yes", "--json")
    assert json.loads(result.stdout)["changed"] == 1, result.output
    assert app_rows(backend) == {"o/1": ("pending", 0)}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
def test_app_cron_ls_reads_the_table_of_ones_own_worker(backend: Backend, app_tables: None) -> None:
    from sqla_delayedq.cron import CronConfig, PeriodicTick, install_tick
    from tests.cli_app import JobMessage

    config = CronConfig("reports", PeriodicTick(timedelta(minutes=10)))
    with backend.Session() as s, s.begin():
        queue = DelayedQueue[Any]("cron", model=JobMessage)
        install_tick(s, queue, config, lookahead=timedelta(hours=1))
    result = invoke(None, "cron", "ls", "--app", "tests.cli_app:make_worker", "--json")
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["cron"]
    assert (entry["queue"], entry["prefix"], entry["config_hash"]) == (
        "cron",
        "reports",
        config.config_hash,
    )


@on_all_backends
def test_app_with_queues_in_two_tables_picks_by_queue_or_table(
    backend: Backend, app_tables: None
) -> None:
    offer_orders(backend, "o/1", "audit/2")
    app = "tests.cli_app:make_two_table_worker"

    def app_run(*args: str) -> Result:
        return invoke(None, *args, "--app", app)

    assert_one_line_error(
        app_run("stats"), 2, "live in several tables (app_jobs: jobs; app_audit: audit)", "-q"
    )
    doc = json.loads(app_run("stats", "-q", "audit", "--json").stdout)
    assert (doc["table"], [q["queue"] for q in doc["queues"]]) == ("app_audit", ["audit"])
    doc = json.loads(app_run("ls", "--table", "app_jobs", "--json").stdout)
    assert [m["key"] for m in doc["messages"]] == ["o/1"]
    assert_one_line_error(app_run("stats", "--table", "nope"), 2, "holds none of the queues")
    assert_one_line_error(app_run("stats", "-q", "mail"), 2, "'mail' is not a queue of")
    assert_one_line_error(
        invoke(None, "stats", "--app", app, "--url", url_of(backend.url)), 2, "--url and --app"
    )


@pytest.mark.parametrize(
    ("app", "fragment"),
    [
        ("tests.cli_app", "is not module:attribute"),
        ("tests.cli_app:nope", "has no attribute 'nope'"),
        ("tests.cli_app:jobs", "returned DelayedQueue"),
        ("tests.cli_app:URL_VAR", "is a str; it must be a Worker"),
        ("tests.cli_app:handle", "is a function that takes arguments"),
        ("tests.cli_broken_app:worker", "failed: KeyError: 'DELAYEDQ_TEST_SETTING"),
    ],
)
def test_app_must_name_a_worker(
    app: str, fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(APP_URL_VAR, f"sqlite:///{tmp_path / 'app.sqlite'}")
    assert_one_line_error(invoke(None, "ls", "--app", app), 2, fragment)


def test_several_processes_cannot_share_one_metrics_port(tmp_path: Path) -> None:
    """Every child served the same port: all but one failed to bind, three times each, and the
    supervisor stopped everything with status 1 (found in review). Refused up front."""
    url = f"sqlite:///{tmp_path / 'w.sqlite'}"
    result = invoke(
        url, "worker", "tests.cli_handlers:slow", "-q", "q", "-p", "2", "--metrics-port", "19391"
    )
    assert_one_line_error(result, 2, "--metrics-port serves one process's metrics")


def test_a_metrics_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    """``--metrics-port`` on a port another process listens on ended in a 53-line traceback."""
    import socket

    url = f"sqlite:///{tmp_path / 'w.sqlite'}"
    assert invoke(url, "db", "upgrade").exit_code == 0
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = invoke(url, "worker", "tests.cli_handlers:slow", "-q", "q", "--metrics-port", port)
    assert_one_line_error(result, 1, f"--metrics-port {port}: cannot serve", "choose a free port")


# -- tables that are missing or are not message tables -----------------------------------------


def test_a_missing_sqlite_file_is_refused_not_created(tmp_path: Path) -> None:
    """A mistyped SQLite path: connecting created an empty database file there, and the
    command then said the table was missing (found in review)."""
    path = tmp_path / "typo.sqlite"
    for command in (["stats"], ["ls"], ["show", "k"], ["doctor"]):
        result = invoke(f"sqlite:///{path}", *command)
        assert_one_line_error(result, 2, f"no SQLite database at '{path}'")
    result = invoke(f"sqlite:///{path}", "db", "current")  # a deploy script's question
    assert result.exit_code == 0 and "not initialised" in result.stdout
    assert not path.exists()


@pytest.mark.parametrize("fresh_database", ["sqlite", "postgresql", "mariadb"], indirect=True)
def test_a_missing_table_gets_advice_that_fits_it(
    fresh_database: tuple[str, URL], monkeypatch: pytest.MonkeyPatch
) -> None:
    u = url_of(fresh_database[1])
    if fresh_database[0] == "sqlite":  # an empty database file (a missing file is refused)
        sa.create_engine(fresh_database[1], poolclass=sa.NullPool).connect().close()
    result = invoke(u, "stats")
    assert_one_line_error(
        result, 1, "table 'delayed_queue' does not exist", "create it with 'delayedq db upgrade'"
    )
    own = "it is your application's table: create it with your own migrations " + (
        "(e.g. alembic upgrade head)"
    )
    assert_one_line_error(
        invoke(u, "ls", "--table", "outbox_messages"), 1, "'outbox_messages' does not exist", own
    )
    monkeypatch.setenv(APP_URL_VAR, u)
    result = invoke(None, "show", "k", "--app", "tests.cli_app:make_worker")
    assert_one_line_error(result, 1, "table 'app_jobs' does not exist", own)
    assert "db upgrade" not in result.stderr
    # The worker checks its tables before it starts, through its own engine and driver.
    for target in ("tests.cli_app:make_worker", "tests.cli_app:make_async_worker"):
        result = invoke(None, "worker", target)
        assert_one_line_error(result, 1, "table 'app_jobs' does not exist", own)


@on_all_backends
def test_an_entity_table_or_a_domain_table_is_refused_in_one_line(
    backend: Backend, app_tables: None, run: Run
) -> None:
    for command in (["stats"], ["ls"], ["show", "k"], ["drop", "--all", "-q", "q", "--yes"]):
        assert_one_line_error(
            run(*command, "--table", "app_shipments"),
            1,
            "table 'app_shipments' is an entity-queue table",
            "queue_next_attempt_at",
            "not a message table",
        )
    assert_one_line_error(
        run("ls", "--table", "app_customers"),
        1,
        "table 'app_customers'",
        "is not a message table: it lacks the QueueMessageMixin columns queue, key, payload_type",
    )


def test_a_worker_whose_table_check_cannot_reach_the_database_starts_anyway(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A database that refuses connections for a moment (a restart, a failover) is no
    configuration error: the check warns and the worker starts, retrying on its own. Exiting
    made ``--processes`` count quick exits and, after three, stop every child, healthy ones
    included. A missing table still stops it."""
    from sqla_delayedq import create_engine
    from sqla_delayedq._cli_base import RuntimeFailure
    from sqla_delayedq._cli_worker import check_tables

    table = DelayedMessage.__table__
    refused = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    with caplog.at_level("WARNING", logger="sqla_delayedq"):
        check_tables(refused, [table])  # type: ignore[list-item]
    assert "could not check the tables" in caplog.text
    refused.dispose()
    empty = create_engine("sqlite://")
    with pytest.raises(RuntimeFailure):
        check_tables(empty, [table])  # type: ignore[list-item]
