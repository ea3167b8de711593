"""Payload serializers.

A serializer turns a payload into what is stored and back, and names the payload type that is
recorded on every row (``payload_type``) and checked on read. ``storage`` says which column
holds the value: ``"json"`` payloads go to the JSON column (queryable by field on every
backend), ``"bytes"`` payloads to the binary column.
"""

from __future__ import annotations

import json
from typing import Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

from .errors import DecodeError, EncodeError, InvalidArgument

T = TypeVar("T")

__all__ = ["BytesSerializer", "JsonSerializer", "Serializer"]

Storage = Literal["json", "bytes"]

#: ``json.dumps(payload, allow_nan=False)`` without building an encoder per call.
_ENCODER = json.JSONEncoder(allow_nan=False)


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
            return _ENCODER.encode(payload)
        except (TypeError, ValueError) as exc:
            raise EncodeError(f"payload is not JSON-serializable: {exc}") from exc

    def encode(self, payload: T) -> Any:
        # Round-trip once: rejects what JSON cannot hold before SQL runs and normalises tuples
        # to lists, so the identity check on re-offer is exact.
        return json.loads(self.dumps(payload))

    def decode(self, stored: Any) -> T:
        if isinstance(stored, (bytes, str)):
            try:
                stored = json.loads(stored)
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
