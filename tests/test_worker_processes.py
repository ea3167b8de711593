"""``delayedq worker --processes N``: a supervisor and N worker processes, on PostgreSQL and
MariaDB (and SQLite for the supervision rules).

Each test runs the real command in a subprocess, as a deployment would, and reads what the
handlers did from their event file (``start KEY PID`` / ``done KEY PID``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sqla_delayedq import DelayedQueue
from tests.fix_db import Backend
from tests.test_cli import REPO, app_tables, rows, url_of  # noqa: F401 (a fixture)

QUEUE = "jobs"


class Supervised:
    """A ``delayedq worker ... --processes N`` subprocess, with its log and event files."""

    def __init__(self, backend: Backend, tmp_path: Path, *args: str, **env: str) -> None:
        self.events = tmp_path / "events.txt"
        self.log = tmp_path / "worker.log"
        environ = {
            **os.environ,
            "DELAYEDQ_DATABASE_URL": url_of(backend.url),
            "DELAYEDQ_TEST_OUT": str(self.events),
            **env,
        }
        cmd = [sys.executable, "-m", "sqla_delayedq.cli", "worker", *args]
        with self.log.open("w") as log:
            # Its own process group, as in a terminal, where Ctrl-C signals the whole group.
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=environ, stderr=log, start_new_session=True
            )

    def lines(self, prefix: str) -> list[list[str]]:
        if not self.events.exists():
            return []
        return [ln.split() for ln in self.events.read_text().splitlines() if ln.startswith(prefix)]

    def text(self) -> str:
        return self.log.read_text()

    def wait(self, check: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if self.proc.poll() is not None:
                pytest.fail(f"supervisor exited with {self.proc.returncode}:\n{self.text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"not {what} after {timeout} s:\n{self.text()}")
            time.sleep(0.05)

    def children(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(pid) for pid in path.read_text().split()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Callable[..., Supervised]]:
    started: list[Supervised] = []

    def start(backend: Backend, *args: str, **env: str) -> Supervised:
        run = Supervised(backend, tmp_path, *args, **env)
        started.append(run)
        return run

    yield start
    for run in started:
        if run.proc.poll() is None:
            for pid in run.children():
                os.kill(pid, signal.SIGKILL)
            run.proc.kill()
            run.proc.wait()


def offer(backend: Backend, count: int, **payload: Any) -> list[str]:
    keys = [f"m{i:05d}" for i in range(count)]
    with backend.Session() as s, s.begin():
        DelayedQueue[Any](QUEUE).offer_batch(s, [(k, payload) for k in keys])
    return keys


def started_workers(run: Supervised, n: int) -> Callable[[], bool]:
    return lambda: run.text().count(f"consuming {QUEUE} with") >= n


def quick_form(*extra: str) -> list[str]:
    return ["tests.cli_handlers:with_pid", "-q", QUEUE, "--poll-interval", "0.2", *extra]


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_two_processes_handle_every_message_exactly_once(server_backend, supervise, mode):
    run = supervise(server_backend, *quick_form("-p", "2", "-c", "2", "--mode", mode))
    run.wait(started_workers(run, 2), "two worker processes consuming")
    keys = offer(server_backend, 600, sleep=0.005)
    run.wait(lambda: len(run.lines("done")) >= len(keys), "every message handled")
    assert run.stop() == 0, run.text()
    done = run.lines("done")
    assert Counter(line[1] for line in done) == Counter(keys)  # each once, none lost
    assert len({line[2] for line in done}) == 2  # both processes took messages
    assert rows(server_backend) == {}
    assert "stopping 2 worker processes" in run.text()


def test_a_killed_worker_process_is_replaced_and_its_messages_come_back(server_backend, supervise):
    run = supervise(server_backend, *quick_form("-p", "2", "-c", "2", "--lease", "3"))
    run.wait(started_workers(run, 2), "two worker processes consuming")
    keys = offer(server_backend, 12, sleep=1.0)
    run.wait(lambda: len(run.lines("start")) >= 4, "both processes busy")
    victim = int(run.lines("start")[0][2])
    os.kill(victim, signal.SIGKILL)
    run.wait(lambda: "was killed by SIGKILL; starting a new one" in run.text(), "replaced")
    run.wait(lambda: len(run.children()) == 2 and victim not in run.children(), "two children")
    run.wait(lambda: not rows(server_backend), "every message acknowledged", timeout=90)
    assert run.stop() == 0, run.text()
    done = Counter(line[1] for line in run.lines("done"))
    assert set(done) == set(keys)  # what the killed process held came back and was handled
    assert victim not in {int(line[2]) for line in run.lines("done")}


def test_sigterm_drains_every_worker_process(server_backend, supervise):
    run = supervise(server_backend, *quick_form("-p", "2", "-c", "2"))
    run.wait(started_workers(run, 2), "two worker processes consuming")
    keys = offer(server_backend, 4, sleep=2.0)
    run.wait(lambda: len(run.lines("start")) == 4, "four handlers running")
    assert len({line[2] for line in run.lines("start")}) == 2
    assert run.stop() == 0, run.text()
    assert sorted(line[1] for line in run.lines("done")) == keys  # finished, not cut off
    assert rows(server_backend) == {}
    assert run.text().count("stopped cleanly") == 2


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("app", ["make_worker", "make_async_worker"])
@pytest.mark.parametrize("when", ["running", "starting"])
@pytest.mark.usefixtures("app_tables")
def test_ctrl_c_in_a_terminal_stops_every_worker_process_with_status_0(
    backend, supervise, app, when
):
    """Ctrl-C signals the supervisor and its children at once, and the supervisor then sends
    each child SIGTERM too. A child whose worker had already stopped (an idle asyncio one stops
    within milliseconds) was killed by that SIGTERM, status -15, and the supervisor exited 1;
    one still starting was killed by either signal."""
    for trial in range(3):
        run = supervise(backend, f"tests.cli_app:{app}", "-p", "2")
        if when == "running":
            run.wait(lambda r=run: r.text().count(" started: 2 t") == 2, "two workers running")
            time.sleep(0.3)  # idle: an asyncio worker then stops before the SIGTERM comes
        else:
            run.wait(lambda r=run: len(r.children()) == 2, "two worker processes started")
            time.sleep(0.05 * trial)  # in Python's start, the import, the table check
        os.killpg(run.proc.pid, signal.SIGINT)
        assert run.proc.wait(60) == 0, run.text()
        exits = re.findall(r"worker process \d \(pid \d+\) exited with (-?\d+)", run.text())
        assert exits == ["0", "0"], run.text()
        if when == "running":
            assert run.text().count("stopped cleanly") == 2, run.text()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_worker_that_cannot_start_stops_the_supervisor(backend, supervise, tmp_path):
    """A configuration error every child hits ends the run instead of a restart loop."""
    run = supervise(
        backend,
        "tests.cli_app:worker",
        "-p",
        "2",
        DELAYEDQ_TEST_APP_URL=f"sqlite:///{tmp_path / 'no-tables.sqlite'}",
    )
    assert run.proc.wait(90) == 1, run.text()
    assert "3 times in a row before its worker ran: stopping" in run.text()
    assert "does not exist" in run.text() or "no such table" in run.text()


CHILD = """
import pathlib, signal, sys, time
flag = pathlib.Path(sys.argv[1])
if not flag.exists():
    flag.write_text("failed")
    sys.exit(1)  # the first start fails: the supervisor backs off before the next
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # as `delayedq worker` does
while True:
    time.sleep(0.1)
"""


def test_a_sigterm_during_a_restart_backoff_stops_the_replacement_too(tmp_path):
    """A child failed at its start; SIGTERM came while the supervisor waited before replacing
    it. The replacement was started after every running child had been told to stop, and
    never told: the supervisor waited for it for ever."""
    flag = tmp_path / "failed-once"
    command = [sys.executable, "-c", CHILD, str(flag)]
    supervisor = (
        "import sys; from sqla_delayedq.processes import _Supervisor; "
        f"sys.exit(_Supervisor({command!r}, 1).run())"
    )
    proc = subprocess.Popen([sys.executable, "-c", supervisor], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        time.sleep(0.5)  # the child exited, the supervisor waits 2 s before its replacement
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 1  # the failed child's status; the replacement never ran
    finally:
        if proc.poll() is None:
            for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
                os.kill(int(pid), signal.SIGKILL)
            proc.kill()
            proc.wait()


def test_a_worker_killed_by_a_signal_at_each_start_stops_the_supervisor(tmp_path):
    """A child that died of a signal within seconds of its start (a segfault at import) was
    replaced at once, for ever: no backoff and no end, unlike one that exited with a status."""
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    supervisor = (
        "import sys; from sqla_delayedq.processes import _Supervisor; "
        f"sys.exit(_Supervisor({[sys.executable, '-c', crash]!r}, 1).run())"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", supervisor], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert "was killed by SIGKILL 3 times in a row before its worker ran: stopping" in err


WAITING_CHILD = """
import os, pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # as `delayedq worker` does
pathlib.Path(sys.argv[1], str(os.getpid())).touch()
while True:
    time.sleep(0.1)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_worker_processes_stop_when_their_supervisor_is_killed(tmp_path):
    """A supervisor killed with SIGKILL left its children running, orphaned, for ever; a
    supervisor started in its place then ran N more beside them."""
    command = [sys.executable, "-c", WAITING_CHILD, str(tmp_path)]
    supervisor = (
        "import sys; from sqla_delayedq.processes import _Supervisor; "
        f"sys.exit(_Supervisor({command!r}, 2).run())"
    )
    proc = subprocess.Popen([sys.executable, "-c", supervisor], cwd=REPO)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids := [int(p.name) for p in tmp_path.iterdir()]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20

        def running(pid: int) -> bool:
            status = Path(f"/proc/{pid}/status")
            return status.exists() and "zombie" not in status.read_text()

        while any(running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in pids if running(pid)]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["worker", "m:w", "-p", "2", "-c", "3"], ["-c", "3"]),
        (
            ["worker", "-q", "jobs", "m:h", "--processes=4", "--poll-interval", "1"],
            ["-q", "jobs", "--poll-interval", "1"],
        ),
        (["worker", "m:h", "-p4", "--payload-type", "x"], ["--payload-type", "x"]),
    ],
)
def test_each_child_runs_with_the_same_options(argv, expected, monkeypatch):
    import click

    from sqla_delayedq._cli_base import ARGV
    from sqla_delayedq._cli_worker import child_args

    target = next(a for a in argv if ":" in a)
    ctx = click.Context(click.Command("worker"))
    monkeypatch.setattr(sys, "argv", ["delayedq", *argv])
    assert child_args(ctx, target) == expected
    # From main(argv) (or CliRunner): the arguments it was given, not the process's argv.
    monkeypatch.setattr(sys, "argv", ["python", "app.py"])
    ctx.meta[ARGV] = list(argv)
    assert child_args(ctx, target) == expected


def test_main_with_arguments_runs_each_child_with_them(tmp_path):
    """``sqla_delayedq.cli.main([...])`` with ``-p``: the children were started with the
    options of ``sys.argv`` (the script's own), so every option given was dropped silently
    (found in review)."""
    seen = tmp_path / "argv"
    program = (
        "import subprocess, sys\n"
        "from sqla_delayedq import processes\n"
        "def run(target, n, args):\n"
        f"    open({str(seen)!r}, 'w').write(repr((target, n, list(args))))\n"
        "    return 0\n"
        "processes.run_processes = run\n"
        "from sqla_delayedq.cli import main\n"
        "main(['worker', 'tests.cli_handlers:failing', '-q', 'jobs', '-p', '2', "
        "'--no-monitor', '--log-level', 'WARNING'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", program, "unrelated"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert seen.read_text() == repr(
        ("tests.cli_handlers:failing", 2, ["-q", "jobs", "--no-monitor", "--log-level", "WARNING"])
    )


SLOW_FAILING_CHILD = """
import sys, time
time.sleep(5.3)  # imports on a loaded host: longer than the supervisor's quick-exit window
sys.exit(1)
"""


def test_children_that_fail_before_their_worker_runs_stop_the_supervisor_however_slow(
    tmp_path,
):
    """Children that took more than 5 s to start and then failed never counted as quick
    exits, and a restart's backoff slept in the loop that notices exits: the supervisor
    restarted failing children for ever (found in review). A failure is now an exit before the
    worker ran, as the child reports it, whatever the time it took."""
    with killed_at_the_end(run_supervisor(tmp_path, SLOW_FAILING_CHILD, 2)) as proc:
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err
    assert "exited with 1 3 times in a row before its worker ran: stopping" in err, err


def test_a_usage_error_of_a_child_stops_the_supervisor_at_once(tmp_path):
    """Exit status 2 (a usage error, which every child hits alike) before the worker ran."""
    child = "import sys, time; time.sleep(0.2); sys.exit(2)"
    with killed_at_the_end(run_supervisor(tmp_path, child, 3)) as proc:
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert err.count("before its worker ran: stopping") == 1, err
    assert "starting a new one" not in err, err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"processes": "2"}, "processes must be an int >= 1, got '2'"),
        ({"processes": 2.5}, "processes must be an int >= 1"),
        ({"processes": True}, "processes must be an int >= 1"),
        ({"args": "-q jobs"}, "args must be a sequence of strings"),
        ({"args": ["-q", 5]}, "args must be a sequence of strings"),
        ({"target": ""}, "target must be a module:name string"),
    ],
)
def test_run_processes_refuses_bad_arguments_before_starting_anything(kwargs, message):
    from sqla_delayedq import InvalidArgument
    from sqla_delayedq.processes import run_processes

    call: dict[str, Any] = {"target": "tests.cli_app:worker", "processes": 2, **kwargs}
    with pytest.raises(InvalidArgument, match=message):
        run_processes(call["target"], call["processes"], call.get("args", ()))


DRAINING_CHILD = """
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def drained(*_):
    (out / f"drained-{os.getpid()}").touch()
    sys.exit(0)
signal.signal(signal.SIGTERM, drained)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # as `delayedq worker` does
(out / f"started-{os.getpid()}").touch()
while True:
    time.sleep(0.1)
"""


def run_supervisor(tmp_path: Path, child: str, n: int, patch: str = "") -> subprocess.Popen[str]:
    """``_Supervisor`` over ``n`` children running ``child`` (with ``tmp_path`` as argument),
    after ``patch`` (Python run first in the supervisor's process)."""
    command = [sys.executable, "-c", child, str(tmp_path)]
    supervisor = (
        f"import subprocess, sys\n{patch}\nfrom sqla_delayedq.processes import _Supervisor\n"
        f"sys.exit(_Supervisor({command!r}, {n}).run())"
    )
    return subprocess.Popen(
        [sys.executable, "-c", supervisor], cwd=REPO, stderr=subprocess.PIPE, text=True
    )


@contextlib.contextmanager
def killed_at_the_end(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``proc``, killed (with its children: they stop with it) if the block left it running."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_child_that_cannot_be_started_stops_the_others_drained(tmp_path):
    """The fork of a child failed (``EAGAIN``): the error left the supervisor, which killed
    every running child with SIGKILL, mid-handler. It is now tried again with the backoff, and
    then the others are stopped with SIGTERM (each drains) and the supervisor exits 1."""
    patch = (
        "import errno\nreal, calls = subprocess.Popen, []\n"
        "def popen(*a, **k):\n"
        "    calls.append(1)\n"
        "    if len(calls) > 1:\n"
        "        raise OSError(errno.EAGAIN, 'Resource temporarily unavailable')\n"
        "    return real(*a, **k)\n"
        "subprocess.Popen = popen"
    )
    with killed_at_the_end(run_supervisor(tmp_path, DRAINING_CHILD, 2, patch)) as proc:
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert err.count("worker process 2 could not be started") == 3, err
    started = {p.name.split("-")[1] for p in tmp_path.glob("started-*")}
    drained = {p.name.split("-")[1] for p in tmp_path.glob("drained-*")}
    assert len(started) == 1 and drained == started, err  # stopped with SIGTERM, not killed


def test_a_child_killed_by_a_real_time_signal_is_replaced(tmp_path):
    """``signal.Signals(35)`` raised (no name for the real-time signals): the supervisor
    ended on the error and killed the other children."""
    with killed_at_the_end(run_supervisor(tmp_path, DRAINING_CHILD, 1)) as proc:
        deadline = time.monotonic() + 30
        while not (started := list(tmp_path.glob("started-*"))):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        os.kill(int(started[0].name.split("-")[1]), signal.SIGRTMIN + 1)
        while len(list(tmp_path.glob("started-*"))) < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert f"was killed by signal {int(signal.SIGRTMIN) + 1}; starting a new one" in err, err
    assert proc.returncode == 0, err


def test_a_child_that_exits_0_at_once_is_started_again_after_a_backoff(tmp_path):
    """A child whose worker stops itself at once (exit 0) was started again ten times a
    second, for ever; it now waits the restart backoff (2, 4, 8, then 10 s) each time."""
    child = "import os, pathlib, sys; (pathlib.Path(sys.argv[1]) / str(os.getpid())).touch()"
    with killed_at_the_end(run_supervisor(tmp_path, child, 1)) as proc:
        time.sleep(5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert 2 <= len(list(tmp_path.iterdir())) <= 4, err  # 50 or so before
    assert proc.returncode == 0, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tests.cli_handlers:failing"], "Missing option '--queue'"),
        (["tests.cli_app:worker", "-c", "4"], "--concurrency does not apply"),
    ],
    ids=["quick-form-without-queue", "flag-of-a-worker-of-yours"],
)
def test_what_every_child_would_refuse_is_refused_once_before_any_starts(tmp_path, args, message):
    """With ``-p N`` these checks ran in each child, N times per restart, and the supervisor
    restarted them (found in review)."""
    env = {**os.environ, "DELAYEDQ_TEST_APP_URL": f"sqlite:///{tmp_path / 'app.sqlite'}"}
    proc = subprocess.run(
        [sys.executable, "-m", "sqla_delayedq.cli", "worker", *args, "-p", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(message) == 1, proc.stderr
    assert "worker process" not in proc.stderr, proc.stderr
