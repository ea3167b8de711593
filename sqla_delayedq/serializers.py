"""Payload serializers.

A serializer turns a payload into what is stored and back, and names the payload type that is
recorded on every row (``payload_type``) and checked on read. ``storage`` says which column
holds the value: ``"json"`` payloads go to the JSON column (queryable by field on every
backend), ``"bytes"`` payloads to the binary column.

Typed payloads: :class:`DataclassSerializer` and :class:`PydanticSerializer` (the ``pydantic``
extra) check the payload's type on offer and rebuild it on poll: a queue built with
``serializer=PydanticSerializer(Order)`` is a ``DelayedQueue[Order]`` whose envelopes carry an
``Order``. A stored payload that no longer fits the class (a field removed, renamed or retyped
by a deploy since it was offered) is a :class:`~sqla_delayedq.DecodeError`: the message is
buried as dead with that error, never handed to a handler and never a crash of the worker.
"""

from __future__ import annotations

import dataclasses
import json
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

from ._typed import CHANGED, UnknownFields, build, to_json
from .errors import DecodeError, EncodeError, InvalidArgument

if TYPE_CHECKING:
    from pydantic import BaseModel

T = TypeVar("T")
D = TypeVar("D")
M = TypeVar("M", bound="BaseModel")

__all__ = [
    "BytesSerializer",
    "DataclassSerializer",
    "JsonSerializer",
    "PydanticSerializer",
    "Serializer",
]

Storage = Literal["json", "bytes"]

#: ``json.dumps(payload, allow_nan=False)`` without building an encoder per call.
_ENCODER = json.JSONEncoder(allow_nan=False)


def _not_json(value: object) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# The C encoder behind ``_ENCODER.encode``, called without its Python wrapper: a batch offer
# serializes each payload, and the wrapper's two calls cost more than encoding a small payload.
# It gets no circular-reference map (that map is not safe to share between calls), so a cycle
# ends in RecursionError, which ``dumps`` reports like any payload JSON cannot hold.
_C_ENCODE = (
    None
    if c_make_encoder is None
    else c_make_encoder(
        None, _not_json, encode_basestring_ascii, None, ": ", ", ", False, False, False
    )
)


@runtime_checkable
class Serializer(Protocol[T]):
    """What a queue needs to store payloads of type ``T``."""

    type_name: str
    storage: Storage

    def encode(self, payload: T) -> Any:
        """Return a JSON-compatible value (``storage == "json"``) or ``bytes``."""

    def decode(self, stored: Any) -> T:
        """Rebuild a payload from what :meth:`encode` returned; raise on corrupt data."""


class JsonSerializer(Generic[T]):
    """JSON documents (dicts, lists, numbers, strings), stored in the JSON column.

    ``type_name`` lets several payload types share one queue table and be told apart;
    a row whose recorded type differs from the queue's is treated as poison.
    """

    storage: Storage = "json"

    def __init__(self, type_name: str = "json") -> None:
        if not type_name or len(type_name) > 100:
            raise InvalidArgument("type_name must be 1 to 100 characters")
        self.type_name = type_name

    def dumps(self, payload: T) -> str:
        """The payload as JSON text; rejects what JSON cannot hold (sets, NaN, objects)."""
        try:
            if _C_ENCODE is None:
                return _ENCODER.encode(payload)
            return "".join(_C_ENCODE(payload, 0))
        except (TypeError, ValueError) as exc:
            raise EncodeError(f"payload is not JSON-serializable: {exc}") from exc
        except RecursionError as exc:
            raise EncodeError(
                "payload is not JSON-serializable: it refers to itself, or nests too deeply"
            ) from exc

    def dumps_many(self, payloads: list[T]) -> list[str]:
        """:meth:`dumps` of each payload, in one comprehension over the C encoder (a batch
        offer's hot loop); the first payload JSON cannot hold raises as :meth:`dumps` words it."""
        if _C_ENCODE is not None and type(self).dumps is JsonSerializer.dumps:
            try:
                return ["".join(_C_ENCODE(payload, 0)) for payload in payloads]
            except (TypeError, ValueError, RecursionError):
                pass  # the loop below finds the payload and raises its error
        return [self.dumps(payload) for payload in payloads]

    def dumps_array(self, payloads: list[T]) -> str | None:
        """The payloads as one JSON array of :meth:`dumps`'s texts, in one call of the C
        encoder (a batch offer's hot path); None when that cannot be had (a subclass's own
        ``dumps``, no C encoder, a payload JSON cannot hold: call :meth:`dumps` on each)."""
        if _C_ENCODE is None or type(self).dumps is not JsonSerializer.dumps:
            return None
        try:
            return "".join(_C_ENCODE(payloads, 0))
        except (TypeError, ValueError, RecursionError):
            return None

    def encode(self, payload: T) -> Any:
        # Round-trip once: rejects what JSON cannot hold before SQL runs and normalises tuples
        # to lists, so the identity check on re-offer is exact.
        return json.loads(self.dumps(payload))

    def decode(self, stored: Any) -> T:
        # ``stored`` is the JSON value the column type already decoded: a ``str`` is a payload
        # that is a JSON string ("3", "[1]", "x"), never text to parse again. Bytes cannot be
        # a JSON value: they are undecoded text from a driver.
        if isinstance(stored, (bytes, bytearray, memoryview)):
            try:
                stored = json.loads(bytes(stored))
            except ValueError as exc:
                raise DecodeError(f"stored JSON is corrupt: {exc}") from exc
        return stored  # type: ignore[no-any-return]


class BytesSerializer:
    """Raw bytes, stored in the binary column untouched."""

    storage: Storage = "bytes"

    def __init__(self, type_name: str = "bytes") -> None:
        if not type_name or len(type_name) > 100:
            raise InvalidArgument("type_name must be 1 to 100 characters")
        self.type_name = type_name

    def encode(self, payload: bytes) -> bytes:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise EncodeError(f"BytesSerializer takes bytes, got {type(payload).__name__}")
        return bytes(payload)

    def decode(self, stored: Any) -> bytes:
        if not isinstance(stored, (bytes, bytearray, memoryview)):
            raise DecodeError(f"expected bytes in the binary column, got {type(stored).__name__}")
        return bytes(stored)


def _reads_back(decode: Any, encoded: Any, name: str) -> Any:
    """``encoded``, once ``decode`` has read it back: a payload that would be stored in a form
    its own class cannot read is an :class:`EncodeError` now, not a dead message at its first
    take (a ``datetime`` in a ``date`` field, a value dataclasses let through untyped, a field
    a model dumps but does not take)."""
    try:
        decode(encoded)
    except DecodeError as exc:
        why = str(exc).replace(f" {CHANGED}", "")
        raise EncodeError(
            f"this {name} would be stored as JSON it cannot be read back from: {why}"
        ) from exc
    return encoded


def _type_name(type_name: str | None, cls: type) -> str:
    name = cls.__qualname__ if type_name is None else type_name
    if not name or len(name) > 100:
        raise InvalidArgument("type_name must be 1 to 100 characters")
    return name


def _check_unknown(unknown_fields: str) -> UnknownFields:
    if unknown_fields not in ("error", "ignore"):
        raise InvalidArgument(f"unknown_fields must be 'error' or 'ignore', got {unknown_fields!r}")
    return unknown_fields  # type: ignore[return-value]


class DataclassSerializer(Generic[D]):
    """Instances of one dataclass, stored as JSON (queryable by field) and rebuilt on read.

    :param cls: the dataclass. Fields may be JSON values, nested dataclasses, lists, tuples,
        dicts, ``Optional``/unions, ``Literal``, enums, ``datetime``/``date``/``time``,
        ``UUID`` and ``Decimal``; reading checks each value against the field's type, and so
        does an offer (dataclasses do not check types): a payload that would not read back,
        such as a ``datetime`` in a ``date`` field, is an :class:`~sqla_delayedq.EncodeError`.
        ``field(init=False)`` values are written but not read back (the class computes them).
    :param type_name: recorded on every row and checked on read; defaults to the class's
        qualified name. Name it explicitly to keep messages readable across a class rename.
    :param unknown_fields: a stored field the class does not define is an error (poison) by
        default; ``"ignore"`` drops it instead.
    """

    storage: Storage = "json"

    def __init__(
        self, cls: type[D], type_name: str | None = None, *, unknown_fields: str = "error"
    ) -> None:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise InvalidArgument(f"DataclassSerializer needs a dataclass, got {cls!r}")
        self.cls = cls
        self.type_name = _type_name(type_name, cls)
        self.unknown_fields = _check_unknown(unknown_fields)

    def __repr__(self) -> str:
        return f"DataclassSerializer({self.cls.__qualname__}, type_name={self.type_name!r})"

    def encode(self, payload: D) -> Any:
        if not isinstance(payload, self.cls):
            raise EncodeError(
                f"this queue takes {self.cls.__qualname__} payloads, got {type(payload).__name__}"
            )
        return _reads_back(self.decode, to_json(payload), self.cls.__qualname__)

    def decode(self, stored: Any) -> D:
        value: D = build(self.cls, stored, "payload", self.unknown_fields)
        return value


class PydanticSerializer(Generic[M]):
    """Instances of one pydantic model (v2), stored as JSON and validated on read.

    Needs the ``pydantic`` extra (``pip install 'sqla_delayedq[pydantic]'``). Writing stores
    ``model_dump(mode="json", by_alias=True)`` (computed fields included, so they can be
    filtered on; reading drops them); reading runs ``model_validate``, and a stored document
    that fails it is a :class:`~sqla_delayedq.DecodeError` listing each error. An offer whose
    dump would not validate back is an :class:`~sqla_delayedq.EncodeError`.

    :param model: the ``BaseModel`` subclass.
    :param type_name: as for :class:`DataclassSerializer`.
    :param unknown_fields: a stored top-level field the model does not define is an error by
        default (pydantic itself would drop it silently), unless the model allows extra fields;
        ``"ignore"`` leaves it to the model's own ``extra`` setting.
    """

    storage: Storage = "json"

    def __init__(
        self, model: type[M], type_name: str | None = None, *, unknown_fields: str = "error"
    ) -> None:
        try:
            import pydantic
        except ImportError:
            raise InvalidArgument(
                "PydanticSerializer needs pydantic: pip install 'sqla_delayedq[pydantic]'"
            ) from None
        if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
            raise InvalidArgument(f"PydanticSerializer needs a pydantic BaseModel, got {model!r}")
        self.model = model
        self.type_name = _type_name(type_name, model)
        self.unknown_fields = _check_unknown(unknown_fields)
        self._validation_error = pydantic.ValidationError
        #: Computed fields are written (queryable) but are outputs: reading drops them.
        self._computed = frozenset(
            n
            for name, info in model.model_computed_fields.items()
            for n in (name, info.alias)
            if isinstance(n, str)
        )
        self._known: frozenset[str] | None = None
        if self.unknown_fields == "error" and model.model_config.get("extra") != "allow":
            names: set[str] = set()
            for name, info in model.model_fields.items():
                names.add(name)
                names.update(a for a in (info.alias, info.validation_alias) if isinstance(a, str))
            self._known = frozenset(names)

    def __repr__(self) -> str:
        return f"PydanticSerializer({self.model.__qualname__}, type_name={self.type_name!r})"

    def encode(self, payload: M) -> Any:
        if not isinstance(payload, self.model):
            raise EncodeError(
                f"this queue takes {self.model.__qualname__} payloads, got {type(payload).__name__}"
            )
        dumped = payload.model_dump(mode="json", by_alias=True)
        return _reads_back(self.decode, dumped, self.model.__qualname__)

    def decode(self, stored: Any) -> M:
        name = self.model.__qualname__
        problems: list[str] = []
        if self._computed and isinstance(stored, dict) and not self._computed.isdisjoint(stored):
            stored = {k: v for k, v in stored.items() if k not in self._computed}
        if self._known is not None and isinstance(stored, dict):
            extra = sorted(k for k in stored if k not in self._known)
            if extra:
                problems.append(f"field(s) {', '.join(map(repr, extra))} not defined by {name}")
        try:
            value = self.model.model_validate(stored)
        except self._validation_error as exc:
            problems += [
                f"{'.'.join(map(str, ('payload', *e['loc'])))}: {e['msg']}" for e in exc.errors()
            ]
        if problems:
            raise DecodeError(f"payload does not fit {name}: {'; '.join(problems)} {CHANGED}")
        return value
