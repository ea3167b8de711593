"""Workers on every core: one supervisor, N worker processes of the same program.

``delayedq worker TARGET --processes N`` (or :func:`run_processes` from Python) starts N child
processes, each running ``delayedq worker TARGET`` with the same options, so each builds its own
worker (threads or asyncio, with its own engine and pool) from the user's code. The supervisor
does no queue work itself:

- a child that exits while the supervisor is running (a crash, an out-of-memory kill, a
  ``SIGKILL``) is logged and replaced; the messages it held come back when their leases run
  out, as with any worker that dies. A child that keeps failing to start (it exits before its
  worker runs: a configuration error every child would hit) stops the supervisor instead of a
  crash loop;
- ``SIGTERM`` or ``SIGINT`` is passed to every child, which takes nothing new, lets its
  in-flight handlers finish (up to its drain timeout) and exits; the supervisor exits when all
  of them have, with 0 when every child exited 0. A second signal kills the children at once.

Each child is a separate program, so this works with every start method and leaks nothing from
the supervisor into the handlers' processes. Children log with their process id.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType

from ._consumer import STOP_SIGNALS
from .errors import InvalidArgument

__all__ = ["run_processes"]

log = logging.getLogger("sqla_delayedq.processes")

#: The environment variable a child worker sees: its slot number (1..N).
CHILD_ENV = "DELAYEDQ_WORKER_PROCESS"
#: The environment variable a child worker sees: the pipe it writes to once its worker runs.
STARTED_ENV = "DELAYEDQ_WORKER_STARTED_FD"
#: A child that exits this soon after its start is started again after a backoff.
QUICK_EXIT = 5.0
#: Failures to start in a row (of any one slot) after which the supervisor gives up.
MAX_QUICK_EXITS = 3
#: The status of a command-line usage error: every child would hit it, so the first stops all.
USAGE_ERROR = 2


def report_started() -> None:
    """In a child of the supervisor, once its worker is built and about to run: tell the
    supervisor, which then counts an exit as the worker's, not a failure to start."""
    fd = os.environ.pop(STARTED_ENV, None)
    if fd is None:
        return
    with contextlib.suppress(OSError, ValueError):
        os.write(int(fd), b"1")
        os.close(int(fd))


#: ``prctl`` option (Linux): the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1


def _child_start(supervisor: int) -> Callable[[], None]:
    """For a child, before it runs:

    - SIGTERM and SIGINT blocked until ``delayedq worker`` has its handlers for them
      (``note_stop_signals``), so one that comes while the child starts Python and imports
      the user's code stops its worker once it runs, where it killed the child (status -15);
    - on Linux, SIGTERM when the supervisor dies, so a supervisor killed with SIGKILL (the OOM
      killer, ``kill -9``) leaves no worker running unsupervised, for ever, beside those of the
      supervisor that replaces it. A supervisor that died before the request took effect is
      no longer the parent: the child stops at once.
    """

    def start() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        if sys.platform != "linux":
            return
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != supervisor:
            os._exit(1)  # before exec: nothing of the worker ran yet

    return start


def _signal_name(number: int) -> str:
    """``SIGKILL``; ``signal 35`` for one without a name here (the real-time signals)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass
class _Slot:
    number: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    #: The read end of the pipe the child reports its start on, and whether it did.
    pipe: int | None = None
    running: bool = False
    #: Failures to start, in a row; exits within :data:`QUICK_EXIT` of the start, in a row.
    quick_exits: int = 0
    quick_restarts: int = 0
    #: When the slot's next child starts (after a backoff), or None.
    restart_at: float | None = None
    exits: list[int] = field(default_factory=list)

    def read_started(self) -> None:
        """Whether the child reported its start (see :func:`report_started`), without waiting."""
        if self.pipe is None or self.running:
            return
        try:
            self.running = os.read(self.pipe, 1) == b"1"
        except BlockingIOError:
            return

    def close_pipe(self) -> None:
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None


def run_processes(target: str, processes: int, args: Sequence[str] = ()) -> int:
    """Run ``delayedq worker TARGET *args`` in ``processes`` supervised child processes until
    SIGTERM/SIGINT; returns the exit status (0 when every child drained and exited 0).

    ``target`` is what ``delayedq worker`` takes (``module:worker``, ``module:factory``, or a
    handler function with ``-q``); ``args`` are further ``delayedq worker`` options.
    """
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise InvalidArgument(f"processes must be an int >= 1, got {processes!r}")
    if not isinstance(target, str) or not target:
        raise InvalidArgument(f"target must be a module:name string, got {target!r}")
    if isinstance(args, (str, bytes)) or not all(isinstance(a, str) for a in args):
        raise InvalidArgument(f"args must be a sequence of strings (['-q', 'jobs']), got {args!r}")
    command = [sys.executable, "-m", "sqla_delayedq.cli", "worker", target, *args]
    return _Supervisor(command, processes).run()


class _Supervisor:
    def __init__(self, command: list[str], processes: int) -> None:
        self.command = command
        self.slots = [_Slot(i + 1) for i in range(processes)]
        self.stopping = False
        self.killing = False

    def _signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stopping:
            log.warning("second %s: killing the worker processes", signal.Signals(signum).name)
            self.killing = True
            self._send(signal.SIGKILL)
            return
        log.info(
            "%s: stopping %d worker processes (each drains its handlers)",
            signal.Signals(signum).name,
            len(self.slots),
        )
        self.stopping = True
        self._send(signal.SIGTERM)

    def _send(self, sig: int) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(sig)

    def _start(self, slot: _Slot) -> bool:
        """Start the child of ``slot``; False when it could not be started, after
        :data:`MAX_QUICK_EXITS` tries with the restart backoff (the fork failed, ``EAGAIN`` or
        ``ENOMEM``; the interpreter is gone): the caller stops the others, drained. Raised,
        the error ended the supervisor, which then killed every child mid-handler."""
        if self.stopping:  # a signal came while the children started, or during a backoff
            return True
        start = _child_start(os.getpid()) if sys.platform != "win32" else None
        tries = 0
        while True:
            read, write = os.pipe()
            os.set_blocking(read, False)
            env = {**os.environ, CHILD_ENV: str(slot.number), STARTED_ENV: str(write)}
            try:
                proc = slot.proc = subprocess.Popen(
                    self.command, env=env, preexec_fn=start, pass_fds=(write,)
                )
                break
            except (OSError, subprocess.SubprocessError) as exc:
                os.close(read)
                log.error("worker process %d could not be started: %s", slot.number, exc)
                tries += 1
                if tries == MAX_QUICK_EXITS:
                    return False
                time.sleep(min(2.0**tries, 10.0))
                if self.stopping:
                    return True
            finally:
                os.close(write)
        slot.close_pipe()
        slot.pipe, slot.running = read, False
        slot.started = time.monotonic()
        log.info("worker process %d started: pid %d", slot.number, proc.pid)
        if self.stopping:  # the signal came while it started: it was not among those told
            proc.send_signal(signal.SIGKILL if self.killing else signal.SIGTERM)
        return True

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            failed = None
            for slot in self.slots:
                if not self._start(slot):
                    failed = self._give_up()
                    break
            return self._watch(failed)
        finally:
            self._send(signal.SIGKILL)  # only children still running: after an error here
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _give_up(self) -> int:
        """Stop every child, each drained, to exit with status 1."""
        log.error("stopping the worker processes: one could not be started")
        self.stopping = True
        self._send(signal.SIGTERM)
        return 1

    def _watch(self, failed: int | None = None) -> int:
        """Poll the children every 0.1 s until all exited after a stop: each exit is seen
        within that, whatever backoff another slot waits out (none blocks the loop)."""
        while True:
            running = 0
            for slot in self.slots:
                if slot.restart_at is not None and not self.stopping and failed is None:
                    if time.monotonic() < slot.restart_at:
                        running += 1
                        continue
                    slot.restart_at = None
                    if not self._start(slot):
                        failed = self._give_up()
                        continue
                proc = slot.proc
                if proc is None:
                    continue
                slot.read_started()
                code = proc.poll()
                if code is None:
                    running += 1
                    continue
                slot.read_started()  # what it wrote before it exited
                slot.proc = None
                slot.exits.append(code)
                if self.stopping:
                    log.info(
                        "worker process %d (pid %d) exited with %s", slot.number, proc.pid, code
                    )
                    continue
                failed = self._replace(slot, proc.pid, code)
                if failed is not None:
                    self.stopping = True
                    self._send(signal.SIGTERM)
                else:
                    running += 1  # started again, or waiting to be
            if running == 0 and (self.stopping or failed is not None):
                break
            if self.stopping:
                for slot in self.slots:
                    slot.restart_at = None
            time.sleep(0.1)
        for slot in self.slots:
            slot.close_pipe()
        if failed is not None:
            return failed
        last = [slot.exits[-1] for slot in self.slots if slot.exits]
        return 0 if all(code == 0 for code in last) and not self.killing else 1

    def _replace(self, slot: _Slot, pid: int, code: int) -> int | None:
        """Start a replacement for a child that exited on its own (at once, or after a backoff
        when it exited soon after its start); the status to give up with when it keeps failing
        to start. A child that failed to start is one that exited before its worker ran
        (:func:`report_started`), however long its imports took: with a usage error (status
        2) every child would fail alike, so the first stops them all; with another status,
        :data:`MAX_QUICK_EXITS` in a row do."""
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with {code}"
        if not slot.running and code != 0:
            # Killed by a signal counts too: a crash at import (a segfault) is no less a failure.
            slot.quick_exits += 1
            if code == USAGE_ERROR or slot.quick_exits >= MAX_QUICK_EXITS:
                times = "" if slot.quick_exits == 1 else f" {slot.quick_exits} times in a row"
                log.error(
                    "worker process %d (pid %d) %s%s before its worker ran: stopping (see its "
                    "log above)",
                    slot.number,
                    pid,
                    how,
                    times,
                )
                return code if code > 0 else 1
        else:
            slot.quick_exits = 0
        # One that exits soon after its start (its worker stopped itself, or it failed) is
        # started again after a backoff, not ten times a second for ever.
        if time.monotonic() - slot.started < QUICK_EXIT or not slot.running:
            slot.quick_restarts += 1
            delay = min(2.0**slot.quick_restarts, 10.0)
        else:
            slot.quick_restarts = 0
            delay = 0.0
        log.warning(
            "worker process %d (pid %d) %s; starting a new one%s (messages it held come back "
            "when their leases run out)",
            slot.number,
            pid,
            how,
            f" in {delay:.0f} s" if delay else "",
        )
        slot.restart_at = time.monotonic() + delay
        return None
