"""Handlers: which kind a consumer can run, and calling one so that nothing is acknowledged
unrun.

A synchronous consumer (the thread worker, ``process_one``) refuses ``async def`` handlers, and
treats an awaitable result as a failed attempt; the asyncio worker refuses plain functions. The
rules live here so the queues and both workers apply the same ones.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from .errors import InvalidArgument

__all__ = [
    "HandlerNotAwaited",
    "call_sync_handler",
    "check_async_handler",
    "check_sync_handler",
    "is_async_callable",
]


class HandlerNotAwaited(TypeError):
    """A handler run by a synchronous consumer returned an awaitable: it never ran."""


def is_async_callable(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine (``async def``, partials and objects of one)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return False
    # An object: calling it runs its class's __call__ (an instance attribute is not consulted).
    return inspect.iscoroutinefunction(type(fn).__call__)


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


def check_async_handler(handler: Any, where: str) -> None:
    """Refuse what the asyncio worker cannot await: non-callables and plain functions."""
    if not callable(handler):
        raise InvalidArgument(f"{where}: a handler must be callable, not {type(handler).__name__}")
    if not is_async_callable(handler):
        raise InvalidArgument(
            f"{where}: {_name(handler)} is not an async function; the asyncio worker awaits its "
            "handlers. Define it with 'async def', or register it on sqla_delayedq.worker.Worker"
        )


def call_sync_handler(handler: Callable[..., Any], *args: Any) -> Any:
    """Call a handler of a synchronous consumer; an awaitable result is a failure, not success.

    The coroutine is closed unrun and :class:`HandlerNotAwaited` is raised, so the attempt is
    recorded as failed (and retried) instead of being acknowledged.
    """
    result = handler(*args)
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if close is not None:
            close()  # no "never awaited" warning: the failure below says it instead
        raise HandlerNotAwaited(
            f"handler {_name(handler)} returned {type(result).__name__}, which a synchronous "
            "worker cannot await: the message was not handled. Register async handlers on "
            "sqla_delayedq.aio.AsyncWorker"
        )
    return result
