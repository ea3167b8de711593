"""Handlers: which kind a consumer can run, and calling one so that nothing is acknowledged
unrun.

A synchronous consumer (the thread worker, ``process_one``) refuses ``async def`` handlers, and
treats an awaitable result as a failed attempt; the asyncio worker refuses plain functions. Hooks
and side tasks may be either on the asyncio worker, which awaits an ``async def``; the thread
worker refuses those it would never await. The rules live here so the queues and both workers
apply the same ones.

A transactional handler runs in a savepoint of the transaction that took its message
(:func:`run_in_savepoint`), and that transaction is not the handler's to end: a
``session.commit()`` inside it is refused before anything commits (it would commit the message's
removal whether or not the handler then succeeds), and a ``session.rollback()``, which cannot be
refused, is reported as :class:`~sqla_delayedq.HandlerMisuse` instead of passing for success.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from .errors import HandlerMisuse, InvalidArgument, TransientError

__all__ = [
    "HandlerNotAwaited",
    "HandlerNotRun",
    "call_sync_handler",
    "check_arity",
    "check_async_handler",
    "check_callback",
    "check_sync_handler",
    "check_transactional",
    "is_async_callable",
    "is_cancellation",
    "is_interruption",
    "refuse_unrun",
    "run_in_savepoint",
]

#: ``Session.info`` key: the savepoint a transactional handler runs in, while it runs.
_HANDLING = "sqla_delayedq.handling"


class HandlerNotRun(TypeError):
    """A handler returned what still holds its work (a generator, or a coroutine nobody will
    await): the message was not handled, so the attempt fails instead of being acknowledged."""


class HandlerNotAwaited(HandlerNotRun):
    """A handler returned an awaitable that its consumer does not await: it never ran."""


def _called(fn: Any) -> Any:
    """What runs when ``fn`` is called: through partials, and an object's class's ``__call__``
    (an instance attribute is not consulted)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return fn
    return type(fn).__call__


def is_async_callable(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine (``async def``, partials and objects of one)."""
    return inspect.iscoroutinefunction(_called(fn))


def _generator_kind(fn: Any) -> str | None:
    """``"a generator function"`` or ``"an async generator function"``: calling one runs none
    of its body. None for anything else."""
    called = _called(fn)
    if inspect.isasyncgenfunction(called):
        return "an async generator function"
    if inspect.isgeneratorfunction(called):
        return "a generator function"
    return None


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` cancels the code it interrupts rather than reporting a failure: asyncio's
    ``CancelledError`` (a drain that timed out, a cancelled ``run()``) and greenlet's
    ``GreenletExit``. Looked up only where those modules are loaded: without them neither can
    be raised, and importing asyncio here would weigh on every import of the package."""
    for module, name in (("asyncio", "CancelledError"), ("greenlet", "GreenletExit")):
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None and isinstance(exc, kind):
            return True
    return False


def is_interruption(exc: BaseException) -> bool:
    """Whether ``exc`` interrupts rather than fails: ``KeyboardInterrupt`` and cancellations
    (:func:`is_cancellation`). A worker never swallows those where it swallows a hook's or a
    side task's errors, ``SystemExit`` and other ``BaseException`` subclasses included."""
    return isinstance(exc, KeyboardInterrupt) or is_cancellation(exc)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def check_sync_handler(handler: Any, where: str) -> None:
    """Refuse what a synchronous consumer cannot run: non-callables and ``async def``."""
    if not callable(handler):
        raise InvalidArgument(f"{where}: a handler must be callable, not {type(handler).__name__}")
    if is_async_callable(handler):
        raise InvalidArgument(
            f"{where}: {_name(handler)} is an async function; a synchronous worker would call it, "
            "never await it and acknowledge a message that was never handled. Register it on "
            "sqla_delayedq.aio.AsyncWorker, or pass a plain function"
        )
    _refuse_generators(handler, where)


def _refuse_generators(handler: Any, where: str) -> None:
    kind = _generator_kind(handler)
    if kind is not None:
        raise InvalidArgument(
            f"{where}: {_name(handler)} is {kind} (it uses yield): calling it creates a "
            "generator and runs none of its body, so its messages would be acknowledged "
            "unhandled. Do the work in the function itself and return (no yield)"
        )


#: Functions already found to take a call's arguments, by what decides it (their code object,
#: how many defaults, which keyword-only ones have one, how many arguments): a consumer checks
#: each handler it is given, and a wrapper made per message has the same code every time.
_FITS: set[tuple[Any, ...]] = set()


def check_arity(handler: Any, count: int, where: str, call: str) -> None:
    """Refuse a handler that cannot be called with the ``count`` positional arguments it will
    get (``call`` shows the call, ``handler(envelope, session)``): each of its messages would
    fail with a ``TypeError`` until it is dead, a configuration's fault blamed on the messages.
    A callable without a readable signature (a builtin) is let through: its call will tell."""
    key = None
    if type(handler) is types.FunctionType:
        kw = handler.__kwdefaults__
        key = (handler.__code__, len(handler.__defaults__ or ()), tuple(kw or ()), count)
        if key in _FITS:
            return
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(count))
    except TypeError as exc:
        raise InvalidArgument(
            f"{where}: {_name(handler)}{signature} cannot be called as {call} ({exc}); every "
            "message would fail with a TypeError until it is dead"
        ) from None
    if key is not None:
        _FITS.add(key)


def check_transactional(handler: Any, where: str) -> None:
    """:func:`check_arity` for a transactional handler, which gets the message's Session."""
    check_arity(handler, 2, where, "handler(envelope, session) in transactional mode")


def check_async_handler(handler: Any, where: str) -> None:
    """Refuse what the asyncio worker cannot await: non-callables and plain functions."""
    if not callable(handler):
        raise InvalidArgument(f"{where}: a handler must be callable, not {type(handler).__name__}")
    _refuse_generators(handler, where)
    if not is_async_callable(handler):
        raise InvalidArgument(
            f"{where}: {_name(handler)} is not an async function; the asyncio worker awaits its "
            "handlers. Define it with 'async def', or register it on sqla_delayedq.worker.Worker"
        )


def check_callback(
    fn: Any,
    where: str,
    *,
    awaits: bool,
    caller: str = "a thread worker",
    instead: str = "run the worker as sqla_delayedq.aio.AsyncWorker, which awaits it",
) -> None:
    """Refuse a hook or a side task that its ``caller`` would call without running it: a
    non-callable, a generator function, and an ``async def`` where nothing awaits it
    (``awaits``: the asyncio worker, which awaits an ``async def`` and calls a plain one)."""
    if not callable(fn):
        raise InvalidArgument(f"{where} must be callable, not {type(fn).__name__}")
    kind = _generator_kind(fn)
    if kind is not None:
        raise InvalidArgument(
            f"{where}: {_name(fn)} is {kind} (it uses yield): calling it runs none of its "
            "body. Do the work in the function itself and return (no yield)"
        )
    if not awaits and is_async_callable(fn):
        raise InvalidArgument(
            f"{where}: {_name(fn)} is an async function; {caller} would call it and never "
            f"await it, so it would never run. Make it a plain function, or {instead}"
        )


def call_sync_handler(handler: Callable[..., Any], *args: Any) -> Any:
    """Call a handler of a synchronous consumer; what it returns must not hold its work.

    See :func:`refuse_unrun`: a coroutine or generator is closed unrun and the attempt fails
    (and is retried) instead of being acknowledged.
    """
    result = handler(*args)
    return None if result is None else refuse_unrun(handler, result, awaits=False)


def refuse_unrun(handler: Any, result: Any, *, awaits: bool) -> Any:
    """``result``, what ``handler`` returned, unless it still holds the handler's work: an
    awaitable the consumer will not await (a synchronous consumer awaits nothing; the asyncio
    worker awaits the handler's own coroutine, not one it returns: a missing ``await``), or a
    generator. Those are closed unrun and :class:`HandlerNotRun` is raised, so the attempt is
    recorded as failed instead of being acknowledged."""
    if inspect.isawaitable(result) or inspect.isasyncgen(result):
        close = getattr(result, "close", None)
        if close is not None:
            close()  # no "never awaited" warning: the failure below says it instead
        if awaits:
            raise HandlerNotAwaited(
                f"async handler {_name(handler)} returned {type(result).__name__} instead of "
                "its result: a missing await? The message was not handled"
            )
        raise HandlerNotAwaited(
            f"handler {_name(handler)} returned {type(result).__name__}, which a synchronous "
            "worker cannot await: the message was not handled. Register async handlers on "
            "sqla_delayedq.aio.AsyncWorker"
        )
    if inspect.isgenerator(result):
        result.close()
        raise HandlerNotRun(
            f"handler {_name(handler)} returned a generator, whose body never ran: the message "
            "was not handled. Do the work in the handler itself and return (no yield)"
        )
    return result


def run_in_savepoint(
    session: Session, handler: Callable[..., Any], envelope: Any
) -> tuple[SessionTransaction, Exception | None]:
    """Run a transactional handler, ``handler(envelope, session)``, in a savepoint of the
    session's transaction, and flush what it wrote there.

    Returns the savepoint, still open when the handler succeeded (the caller acknowledges, then
    releases it), and the handler's exception, its writes rolled back to the savepoint. Raises
    :class:`~sqla_delayedq.HandlerMisuse` when the handler rolled back the whole transaction:
    the take went with it, so nothing of this attempt is recorded in it.
    """
    root = session.get_transaction()
    savepoint = session.begin_nested()
    session.info[_HANDLING] = savepoint
    error: Exception | None = None
    try:
        call_sync_handler(handler, envelope, session)
        session.flush()
    except Exception as exc:
        error = exc
    finally:
        session.info.pop(_HANDLING, None)
    if root is None or session.get_transaction() is not root or not root.is_active:
        raise HandlerMisuse(
            "a transactional handler rolled back (or closed) the session it was given, and "
            "the take of its message with it: the message is due again, this attempt unrecorded. "
            "Raise to fail an attempt; its writes are rolled back for you"
        ) from error
    if error is not None:
        try:
            savepoint.rollback()
        except Exception as gone:
            # The server ended the whole transaction (InnoDB does on a deadlock), the take with
            # it: nothing of this attempt can be recorded, and the message is due again. That is
            # a transient fault whatever the handler made of it (it may have wrapped the
            # deadlock in an error of its own): retried, uncounted, never a stopped worker.
            raise TransientError(
                f"the transaction ended while the handler ran ({gone}): {error}"
            ) from error
        if session.connection().invalidated:
            # The connection was lost while the handler ran, and the take with it: nothing of
            # this attempt can be recorded, and the message is due again (retried, uncounted).
            raise TransientError(
                f"the connection was lost while the handler ran: {error}"
            ) from error
    return savepoint, error


@event.listens_for(Session, "before_commit")
def _refuse_a_handler_s_commit(session: Session) -> None:
    """A commit of the transaction a transactional handler runs in, from inside the handler:
    refused before it happens (a savepoint the handler opened itself may commit)."""
    savepoint = session.info.get(_HANDLING)
    if savepoint is not None and session.get_nested_transaction() in (savepoint, None):
        raise HandlerMisuse(
            "a transactional handler must not commit the session it is given: its writes "
            "commit with the removal of its message when it returns. Raise to fail the attempt"
        )
