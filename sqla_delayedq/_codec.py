"""The payload codec and the text rules: what may be stored, how it is stored, how it is read.

Everything that writes or reads a payload goes through :class:`Codec`: offers (single and
batch), polls, the read side, cron and the command line. It also holds the rules for the text
columns that identify a message (queue name, key) and for the error text a failure records:

- Text that some backend cannot store is refused before any SQL runs, on every backend, so a
  queue behaves the same wherever it lives: NUL (PostgreSQL rejects it in ``text`` and in
  ``jsonb``) and lone UTF-16 surrogates (no UTF-8 encoding exists for them).
- A stored payload that cannot be decoded (corrupt JSON text on SQLite, a wrong type name, a
  serializer that raises) becomes a :class:`~sqla_delayedq.DecodeError`, never a driver or
  ``json`` exception: reads select the payload through :class:`LenientJSON`, which hands
  unparseable text over as :class:`CorruptJSON` instead of raising inside the result row.
"""

from __future__ import annotations

import json
import re
import traceback
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any, Generic, TypeVar

from sqlalchemy import Text, literal
from sqlalchemy.engine import Dialect
from sqlalchemy.types import JSON, TypeDecorator

from .errors import DecodeError, EncodeError, InvalidArgument
from .serializers import JsonSerializer, Serializer

T = TypeVar("T")

__all__ = [
    "Codec",
    "CorruptJSON",
    "LenientJSON",
    "check_name",
    "check_names",
    "check_strings",
    "check_text",
    "decode_headers",
    "encode_headers",
    "error_text",
    "same_json",
    "verbatim",
]

#: Longest error text a failure records.
ERROR_MAX = 8000
#: Longest a message's headers may be, as stored JSON text.
HEADERS_MAX = 8000

_BAD_CHARS = re.compile("[\x00\ud800-\udfff]")
#: A ``\\uXXXX`` escape in JSON text that is not itself escaped (an even run of backslashes).
_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u([0-9a-fA-F]{4})")


def _describe(char: str) -> str:
    if char == "\x00":
        return "a NUL character (\\x00), which PostgreSQL cannot store"
    return f"a lone surrogate (\\u{ord(char):04x}), which has no UTF-8 encoding"


def check_text(value: str, what: str) -> str:
    """Refuse text no backend can store portably (NUL, lone surrogates), naming ``what``."""
    bad = _BAD_CHARS.search(value)
    if bad is not None:
        raise InvalidArgument(
            f"{what} contains {_describe(bad.group())} at position {bad.start()}; "
            "sqla_delayedq refuses it on every backend so queues stay portable"
        )
    return value


def check_name(value: Any, what: str, limit: int) -> str:
    """A queue name or key: a non-empty string of at most ``limit`` storable characters."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(f"{what} must not be empty")
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters; the limit is {limit}")
    return check_text(value, what)


def check_names(values: list[Any], what: str, limit: int) -> None:
    """:func:`check_name` of each value, over the whole list at once (each check a loop in C,
    for a batch offer's keys); one value at a time only when one fails, for its error."""
    try:
        joined = "\x01".join(values)  # TypeError: not all strings
    except TypeError:
        joined = None
    if joined is None or not all(values) or max(map(len, values), default=0) > limit:
        joined = None
    if joined is None or _BAD_CHARS.search(joined) is not None:
        for value in values:
            check_name(value, what, limit)


def check_strings(value: Any, what: str) -> tuple[str, ...]:
    """A collection of strings (a tuple, list or set), each storable, as a tuple.

    A lone ``str`` (or ``bytes``) is refused: iterating it would give its characters, and an
    operation meant for the key ``"ab"`` would apply to the keys ``"a"`` and ``"b"``.
    """
    if isinstance(value, str):
        raise InvalidArgument(
            f"{what} must be a collection of strings, got the str {value[:40]!r}; "
            f"for one, pass {what}=({value[:40]!r},)"
        )
    if isinstance(value, (bytes, bytearray, memoryview)) or not isinstance(value, Iterable):
        raise InvalidArgument(
            f"{what} must be a collection of strings (a tuple, list or set), "
            f"got {type(value).__name__}"
        )
    items = tuple(value)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidArgument(
                f"{what} must hold strings; item {i} is {type(item).__name__} {item!r:.40}"
            )
        check_text(item, f"{what}[{i}]")
    return items


def error_text(error: BaseException | str) -> str:
    """What a failed attempt records: the exception line and traceback, storable everywhere."""
    if isinstance(error, BaseException):
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        tb = "".join(traceback.format_tb(error.__traceback__)) if error.__traceback__ else ""
        if tb:
            text = f"{text}\n{tb}"
    else:
        text = str(error)
    # The text of an error is evidence, not identity: replace what cannot be stored.
    return _BAD_CHARS.sub("\ufffd", text[:ERROR_MAX])


def encode_headers(headers: Mapping[str, str] | None) -> str | None:
    """A message's headers as stored: a JSON object of strings, or None for none.

    Headers are metadata offered beside the payload (a trace context, a request id). They are
    checked like keys, before any SQL runs: string names and values, storable everywhere, and
    at most :data:`HEADERS_MAX` characters of JSON in all.
    """
    if headers is None:
        return None
    if not isinstance(headers, Mapping):
        raise InvalidArgument(
            f"headers must be a mapping of str to str, got {type(headers).__name__}"
        )
    if not headers:
        return None
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidArgument(
                f"headers must map str to str; {name!r}: {type(value).__name__} is not"
            )
        check_text(name, f"header name {name[:40]!r}")
        check_text(value, f"header {name[:40]!r}")
    text = json.dumps(dict(sorted(headers.items())), ensure_ascii=False, separators=(",", ":"))
    if len(text) > HEADERS_MAX:
        raise InvalidArgument(
            f"headers are {len(text)} characters as JSON; the limit is {HEADERS_MAX}"
        )
    return text


def decode_headers(text: str | None) -> dict[str, str]:
    """Stored headers as a dict; empty when there are none.

    Headers never make a message undeliverable: stored text that is not a JSON object of strings
    (written by hand, say) reads as no headers.
    """
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
        return {}
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(v, str)}


def _json_problem(text: str) -> str | None:
    """Why JSON ``text`` cannot be stored everywhere (NUL or a lone surrogate), or None."""
    if "\\u" not in text:
        return None  # the common case: nothing escaped, nothing to scan
    codes = [(m.start(), int(m.group(1), 16)) for m in _ESCAPE.finditer(text)]
    for i, (pos, code) in enumerate(codes):
        if code == 0:
            return _describe("\x00")
        if 0xD800 <= code <= 0xDBFF:  # a high surrogate must be followed by a low one
            nxt = codes[i + 1] if i + 1 < len(codes) else None
            if nxt is None or nxt[0] != pos + 6 or not 0xDC00 <= nxt[1] <= 0xDFFF:
                return _describe(chr(code))
        elif 0xDC00 <= code <= 0xDFFF:  # a low surrogate must follow a high one
            prev = codes[i - 1] if i else None
            if prev is None or prev[0] != pos - 6 or not 0xD800 <= prev[1] <= 0xDBFF:
                return _describe(chr(code))
    return None


def _bad_path(value: Any, path: str = "payload") -> str:
    """Where in a JSON value the first unstorable string is (for the error message)."""
    if isinstance(value, str):
        return path if _BAD_CHARS.search(value) else ""
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and _BAD_CHARS.search(k):
                return f"{path} (a key)"
            found = _bad_path(v, f"{path}[{k!r}]")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _bad_path(v, f"{path}[{i}]")
            if found:
                return found
    return ""


def same_json(a: Any, b: Any) -> bool:
    """Whether two decoded JSON values are the same JSON document: the rule that decides
    whether an offer is ``IGNORED``.

    Stricter than ``==``, which calls ``True`` equal to ``1``: a boolean equals only the same
    boolean, recursively through arrays and objects (object key order does not matter). Numbers
    compare as the JSON numbers they are, whatever Python type a driver reads them as: ``1`` and
    ``1.0`` are the same number, and so are the float ``1e23`` and the int ``10**23`` that
    PostgreSQL's ``jsonb`` hands back for it (it stores the decimal value, not the double).
    """
    if type(a) is not type(b):
        return _same_across_types(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same_json, a, b))
    return bool(a == b)  # one scalar type: ``True`` and ``1`` never get here together


def _same_across_types(a: Any, b: Any) -> bool:
    """:func:`same_json` of values of two Python types: an int and a float of one value, or
    containers a custom JSON deserializer returned as subclasses."""
    if isinstance(a, bool) or isinstance(b, bool):
        return False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return _number(a) == _number(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same_json, a, b))
    return False


def _number(value: int | float) -> Decimal:
    """The JSON number ``value`` stands for: a float is the decimal its shortest text reads."""
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


class CorruptJSON:
    """Stored JSON text that does not parse (possible on SQLite, whose JSON is plain text)."""

    __slots__ = ("error", "text")

    def __init__(self, text: Any, error: Exception) -> None:
        self.text = text
        self.error = error

    def __eq__(self, other: object) -> bool:
        return False  # never equal to a payload, so an offer over it updates it

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CorruptJSON({str(self.text)[:40]!r})"


def verbatim(value: Any) -> Any:
    """A payload value read through :class:`LenientJSON`, as it must be written back: corrupt
    text is written back unchanged (as text, not re-encoded as a JSON string)."""
    if isinstance(value, CorruptJSON):
        return literal(value.text, Text())
    return value


def lenient_loads(text: str | bytes) -> Any:
    """``json.loads`` for a driver that decodes JSON columns itself (psycopg): a value nested
    too deep to parse reads as :class:`CorruptJSON`, a decode error of its own message, rather
    than a RecursionError that fails the whole read (a take: every worker stopped)."""
    try:
        return json.loads(text)
    except RecursionError as exc:
        return CorruptJSON(text, exc)


class LenientJSON(TypeDecorator[Any]):
    """The payload column as reads select it: unparseable JSON becomes :class:`CorruptJSON`.

    Used with ``type_coerce`` in select lists only; it changes no SQL and no DDL.
    """

    impl = JSON
    cache_ok = True

    def result_processor(self, dialect: Dialect, coltype: Any) -> Any:
        inner = super().result_processor(dialect, coltype)
        if inner is None:
            return None

        def process(value: Any) -> Any:
            try:
                return inner(value)
            except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
                return CorruptJSON(value, exc)

        return process


class Codec(Generic[T]):
    """Serialize, store, decode and compare the payloads of one serializer."""

    def __init__(self, serializer: Serializer[T]) -> None:
        if not isinstance(serializer, Serializer):
            raise InvalidArgument("serializer must have type_name, storage, encode and decode")
        self.serializer = serializer
        self.type_name = serializer.type_name
        self.json = serializer.storage == "json"
        #: JsonSerializer's own text, without the round trip through ``encode`` (unless a
        #: subclass changed what ``encode`` returns: then its ``encode`` is what is stored).
        self._plain: JsonSerializer[Any] | None = (
            serializer
            if isinstance(serializer, JsonSerializer)
            and type(serializer).encode is JsonSerializer.encode
            else None
        )

    def serialize(self, payload: T) -> str | bytes:
        """``payload`` as stored: JSON text or bytes, validated before any SQL runs."""
        if self._plain is not None:
            text = self._plain.dumps(payload)
        elif not self.json:
            encoded = self.serializer.encode(payload)
            if not isinstance(encoded, (bytes, bytearray, memoryview)):
                raise EncodeError(
                    f"{type(self.serializer).__name__}.encode returned "
                    f"{type(encoded).__name__}; a bytes serializer must return bytes"
                )
            return bytes(encoded)
        else:
            try:
                text = json.dumps(self.serializer.encode(payload), allow_nan=False)
            except EncodeError:
                raise
            except (TypeError, ValueError) as exc:
                raise EncodeError(f"payload is not JSON-serializable: {exc}") from exc
        return self._checked(text)

    def serialize_many(self, payloads: list[T]) -> Sequence[str | bytes]:
        """:meth:`serialize` of each payload: the same results, and the error of the first
        payload in error. The plain JSON serializer's payloads are encoded and checked a batch
        at a time (a batch offer's hot loop), then one at a time only when a check fails."""
        if self._plain is None:
            return [self.serialize(payload) for payload in payloads]
        texts = self._plain.dumps_many(payloads)
        if "null" in texts or "\\u" in "".join(texts):  # rare: find and name the one
            texts = [self._checked(text) for text in texts]
        return texts

    def serialize_array(self, payloads: list[T]) -> str | None:
        """The payloads as one JSON array of what :meth:`serialize` stores for each, checked as
        it checks them, in one encoder call; None where only :meth:`serialize` of each will do
        (another serializer than the plain JSON one). A payload in error raises its error."""
        if self._plain is None:
            return None
        text = self._plain.dumps_array(payloads)
        if text is None or None in payloads or _json_problem(text) is not None:
            for payload in payloads:  # rare: the payload in error raises, as serialize words it
                self.serialize(payload)
        return text

    @staticmethod
    def _checked(text: str) -> str:
        """Stored JSON ``text``, refused when no backend can store it portably."""
        if text == "null":
            # Stored, JSON null reads back as no payload at all, which is how a damaged row
            # looks: such a message would be buried at its first take, never handled.
            raise EncodeError(
                "payload is None (JSON null), which a queue cannot tell from a missing payload; "
                "offer a value, {} for a message that carries no data"
            )
        problem = _json_problem(text)
        if problem is not None:
            where = _bad_path(json.loads(text)) or "payload"
            raise EncodeError(
                f"{where} contains {problem}; sqla_delayedq refuses it on every backend so "
                "queues stay portable"
            )
        return text

    def columns(self, stored: str | bytes) -> dict[str, Any]:
        """The payload columns of a row holding what :meth:`serialize` returned."""
        if self.json:
            payload = json.loads(stored)
            return {"payload_type": self.type_name, "payload": payload, "payload_bytes": None}
        return {"payload_type": self.type_name, "payload": None, "payload_bytes": stored}

    def values(self, payload: T) -> dict[str, Any]:
        """The payload columns of a row holding ``payload``."""
        return self.columns(self.serialize(payload))

    def decode(self, row: Any) -> T:
        """The payload of a stored row; :class:`DecodeError` when it cannot be read."""
        if row.payload_type != self.type_name:
            raise DecodeError(
                f"payload type {row.payload_type!r} does not match this queue's "
                f"serializer {self.type_name!r}"
            )
        stored = row.payload if self.json else row.payload_bytes
        if stored is None:  # offers refuse a null payload: a row without one is damaged
            raise DecodeError(f"no payload in the {self.serializer.storage} column")
        if isinstance(stored, CorruptJSON):
            raise DecodeError(f"stored JSON is corrupt: {stored.error}")
        try:
            return self.serializer.decode(stored)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def same(row: Any, values: dict[str, Any]) -> bool:
        """Whether a stored row already holds exactly these payload columns (JSON compared by
        :func:`same_json`, bytes byte for byte)."""
        return bool(
            row.payload_type == values["payload_type"]
            and same_json(row.payload, values["payload"])
            and row.payload_bytes == values["payload_bytes"]
        )


class RawCodec(Codec[Any]):
    """For inspection (the command line): any stored payload, JSON or bytes, whatever its type
    name; corrupt JSON text is still a :class:`DecodeError`."""

    def decode(self, row: Any) -> Any:
        if isinstance(row.payload, CorruptJSON):
            raise DecodeError(f"stored JSON is corrupt: {row.payload.error}")
        if row.payload is not None:
            return row.payload
        if row.payload_bytes is not None:
            return bytes(row.payload_bytes)
        return None
