"""Dataclass payloads as JSON and back, guided by the class's type hints.

Writing turns a dataclass into JSON values: nested dataclasses become objects, tuples lists,
``datetime``/``date``/``time`` ISO text, ``UUID`` and ``Decimal`` text, enums their value.
A ``field(init=False)`` is written too but not read back (the class computes it again).
Reading rebuilds the dataclass from its type hints and checks the stored document against it:
a missing required field, a field the class no longer defines, or a value of the wrong type is a
:class:`~sqla_delayedq.DecodeError` naming the path (``payload.items[2].sku``), which buries the
message as poison instead of handing a handler something that does not fit.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import types
import typing
import uuid
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, Union

from .errors import DecodeError

__all__ = ["CHANGED", "UnknownFields", "build", "to_json"]

#: What reading does with a stored field the class does not define.
UnknownFields = Literal["error", "ignore"]

_NONE = type(None)

#: Why a stored payload usually stops fitting its class.
CHANGED = "(the class changed since the message was offered?)"


def to_json(value: Any) -> Any:
    """``value`` as JSON values (see the module); the encoder refuses anything else."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return to_json(value.value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {(k.value if isinstance(k, enum.Enum) else k): to_json(v) for k, v in value.items()}
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (uuid.UUID, Decimal)):
        return str(value)
    return value


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception as exc:  # an unresolvable forward reference
        raise DecodeError(f"cannot read the type hints of {cls.__qualname__}: {exc}") from exc


def _fail(path: str, expected: str, value: Any) -> DecodeError:
    return DecodeError(f"{path}: expected {expected}, got {type(value).__name__} {value!r:.60}")


def build(hint: Any, value: Any, path: str, unknown: UnknownFields) -> Any:
    """``value`` (stored JSON) as an instance of ``hint``; :class:`DecodeError` when it does not
    fit."""
    if hint is Any or hint is object:
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint, value, path, unknown)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        return _union(args, value, path, unknown)
    if origin is Literal:
        if value not in args:
            raise _fail(path, f"one of {list(args)}", value)
        return value
    if origin in (list, set, frozenset, tuple) or hint in (list, tuple, set, frozenset):
        return _sequence(origin or hint, args, value, path, unknown)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise _fail(path, "an object", value)
        inner = args[1] if len(args) == 2 else Any
        return {k: build(inner, v, f"{path}[{k!r}]", unknown) for k, v in value.items()}
    if isinstance(hint, type):
        return _scalar(hint, value, path)
    return value  # a TypeVar, a Protocol, an Annotated form we do not check: as stored


def _dataclass(cls: type, value: Any, path: str, unknown: UnknownFields) -> Any:
    if not isinstance(value, dict):
        raise _fail(path, f"an object for {cls.__qualname__}", value)
    every = dataclasses.fields(cls)
    fields = {f.name: f for f in every if f.init}
    # A ``field(init=False)`` is written (it may be worth a filter) but never read back: the
    # class computes it again (``__post_init__`` or its default).
    derived = {f.name for f in every if not f.init}
    name = cls.__qualname__
    problems: list[str] = []
    extra = (
        sorted(k for k in value if k not in fields and k not in derived)
        if unknown == "error"
        else []
    )
    if extra:
        problems.append(f"field(s) {', '.join(map(repr, extra))} not defined by {name}")
    missing = [
        n
        for n, f in fields.items()
        if n not in value
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        problems.append(f"required field(s) {', '.join(map(repr, missing))} of {name} missing")
    if problems:
        raise DecodeError(f"{path}: {'; '.join(problems)} {CHANGED}")
    hints = _hints(cls)
    kwargs = {
        n: build(hints.get(n, Any), value[n], f"{path}.{n}", unknown) for n in fields if n in value
    }
    try:
        return cls(**kwargs)
    except Exception as exc:  # __post_init__ validation
        raise DecodeError(f"{path}: {cls.__qualname__}(...) raised {exc!r}") from exc


def _union(args: tuple[Any, ...], value: Any, path: str, unknown: UnknownFields) -> Any:
    if value is None and _NONE in args:
        return None
    options = [a for a in args if a is not _NONE]
    errors: list[str] = []
    for option in options:
        try:
            return build(option, value, path, unknown)
        except DecodeError as exc:
            errors.append(str(exc))
    raise DecodeError(errors[0] if len(errors) == 1 else f"{path}: fits none of {errors}")


def _sequence(
    kind: Any, args: tuple[Any, ...], value: Any, path: str, unknown: UnknownFields
) -> Any:
    if not isinstance(value, list):
        raise _fail(path, "an array", value)
    if kind is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise _fail(path, f"{len(args)} items", value)
        return tuple(
            build(a, v, f"{path}[{i}]", unknown)
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    inner = args[0] if args else Any
    items = [build(inner, v, f"{path}[{i}]", unknown) for i, v in enumerate(value)]
    return items if kind is list else kind(items)


_PARSERS: dict[type, Any] = {
    dt.datetime: dt.datetime.fromisoformat,
    dt.date: dt.date.fromisoformat,
    dt.time: dt.time.fromisoformat,
    uuid.UUID: uuid.UUID,
    Decimal: Decimal,
}


def _scalar(hint: type, value: Any, path: str) -> Any:
    if issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise _fail(path, f"a value of {hint.__qualname__}", value) from None
    for kind, parse in _PARSERS.items():
        if issubclass(hint, kind):
            if not isinstance(value, str):
                raise _fail(path, f"{kind.__name__} text", value)
            try:
                return parse(value)
            except (ValueError, InvalidOperation):
                raise _fail(path, f"{kind.__name__} text", value) from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, bool):
        raise _fail(path, hint.__name__, value)
    if not isinstance(value, hint):
        raise _fail(path, hint.__name__, value)
    return value
