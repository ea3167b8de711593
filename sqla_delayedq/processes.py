"""Workers on every core: one supervisor, N worker processes of the same program.

``delayedq worker TARGET --processes N`` (or :func:`run_processes` from Python) starts N child
processes, each running ``delayedq worker TARGET`` with the same options, so each builds its own
worker (threads or asyncio, with its own engine and pool) from the user's code. The supervisor
does no queue work itself:

- a child that exits while the supervisor is running (a crash, an out-of-memory kill, a
  ``SIGKILL``) is logged and replaced; the messages it held come back when their leases run
  out, as with any worker that dies. A child that keeps failing within seconds of its start
  (a configuration error every child would hit) stops the supervisor instead of a crash loop;
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
#: A child that exits this soon after its start counts as failing to start.
QUICK_EXIT = 5.0
#: Quick exits in a row (of any one slot) after which the supervisor gives up.
MAX_QUICK_EXITS = 3


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
    #: Failures within :data:`QUICK_EXIT` of the start, in a row; and any such exits.
    quick_exits: int = 0
    quick_restarts: int = 0
    exits: list[int] = field(default_factory=list)


def run_processes(target: str, processes: int, args: Sequence[str] = ()) -> int:
    """Run ``delayedq worker TARGET *args`` in ``processes`` supervised child processes until
    SIGTERM/SIGINT; returns the exit status (0 when every child drained and exited 0).

    ``target`` is what ``delayedq worker`` takes (``module:worker``, ``module:factory``, or a
    handler function with ``-q``); ``args`` are further ``delayedq worker`` options.
    """
    if processes < 1:
        raise InvalidArgument(f"processes must be >= 1, got {processes}")
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
        env = {**os.environ, CHILD_ENV: str(slot.number)}
        start = _child_start(os.getpid()) if sys.platform != "win32" else None
        tries = 0
        while True:
            try:
                proc = slot.proc = subprocess.Popen(self.command, env=env, preexec_fn=start)
                break
            except (OSError, subprocess.SubprocessError) as exc:
                log.error("worker process %d could not be started: %s", slot.number, exc)
                tries += 1
                if tries == MAX_QUICK_EXITS:
                    return False
                time.sleep(min(2.0**tries, 10.0))
                if self.stopping:
                    return True
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
        while True:
            running = 0
            for slot in self.slots:
                proc = slot.proc
                if proc is None:
                    continue
                code = proc.poll()
                if code is None:
                    running += 1
                    continue
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
                elif slot.proc is not None:
                    running += 1
            if running == 0 and (self.stopping or failed is not None):
                break
            time.sleep(0.1)
        if failed is not None:
            return failed
        last = [slot.exits[-1] for slot in self.slots if slot.exits]
        return 0 if all(code == 0 for code in last) and not self.killing else 1

    def _replace(self, slot: _Slot, pid: int, code: int) -> int | None:
        """Start a replacement for a child that exited on its own; the status to give up
        with when it keeps failing at start."""
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with {code}"
        # Killed by a signal counts too: a crash at import (a segfault) is no less a failure.
        # One that exits 0 at once (its worker stopped itself) is no failure, but it is started
        # again after the backoff too, not ten times a second for ever.
        if time.monotonic() - slot.started < QUICK_EXIT:
            slot.quick_restarts += 1
            slot.quick_exits += code != 0
            if slot.quick_exits >= MAX_QUICK_EXITS:
                log.error(
                    "worker process %d (pid %d) %s %d times in a row within %.0f s of its "
                    "start: stopping (see its log above)",
                    slot.number,
                    pid,
                    how,
                    slot.quick_exits,
                    QUICK_EXIT,
                )
                return code if code > 0 else 1
            time.sleep(min(2.0**slot.quick_restarts, 10.0))
        else:
            slot.quick_exits = slot.quick_restarts = 0
        log.warning(
            "worker process %d (pid %d) %s; starting a new one (messages it held come back "
            "when their leases run out)",
            slot.number,
            pid,
            how,
        )
        return None if self._start(slot) else self._give_up()
