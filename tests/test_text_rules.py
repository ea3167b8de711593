"""Text rules on every backend: what cannot be stored is refused before SQL, naming the field;
key prefixes are literal and case-sensitive, payload fields match the scalar and nothing that
holds it, and keys are a collection of strings, so an admin command touches only what it names."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import pytest
import sqlalchemy as sa

from sqla_delayedq import (
    DelayedMessage,
    DelayedQueue,
    EncodeError,
    ExponentialBackoff,
    InvalidArgument,
    MessageFilter,
)
from tests.fix_queue import record_sql

T = cast(sa.Table, DelayedMessage.__table__)

BAD = {"nul": "a\x00b", "high-surrogate": "a\ud800b", "low-surrogate": "a\udc00b"}


def row_count(backend: Any) -> int:
    with backend.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(T)).scalar_one()


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
def test_unstorable_text_is_refused_before_any_sql_naming_the_field(backend, make_queue, bad):
    q = make_queue()
    with record_sql(backend.engine) as sql, backend.Session.begin() as s:
        with pytest.raises(InvalidArgument, match=r"^key contains"):
            q.offer(s, bad, {"v": 1})
        with pytest.raises(EncodeError, match=r"payload\['items'\]\[1\]\['name'\] contains"):
            q.offer(s, "k", {"items": [{"name": "ok"}, {"name": bad}]})
        with pytest.raises(EncodeError, match=r"payload \(a key\) contains"):
            q.offer(s, "k", {bad: 1})
        with pytest.raises(EncodeError, match=r"payload\[1\] contains"):
            q.offer_batch(s, [("x", "fine"), ("y", ["fine", bad])])
        with pytest.raises(InvalidArgument, match="key contains"):
            q.offer_batch(s, [("x", "fine"), (bad, "fine")])
    assert sql == []
    with pytest.raises(InvalidArgument, match="queue name contains"):
        DelayedQueue(bad)
    assert row_count(backend) == 0


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
def test_a_batch_s_payloads_encoded_at_once_are_what_each_encodes_and_its_checks(bad):
    """The batch path encodes a chunk's payloads in one call: the same text as each payload's
    own serialization, joined as a JSON array, and the same error, naming the payload's path,
    for the first payload in error; and it defers to one payload at a time where it cannot."""
    from sqla_delayedq._codec import Codec
    from sqla_delayedq.serializers import JsonSerializer

    codec: Codec[Any] = Codec(JsonSerializer())
    payloads = [{"n": 1, "t": "plain"}, [1, 2.5, None, True], "snake \U0001f40d é", {"1": {}}]
    array = codec.serialize_array(payloads)
    assert array == "[" + ", ".join(str(codec.serialize(p)) for p in payloads) + "]"
    with pytest.raises(EncodeError, match=r"payload\['x'\]\[1\] contains"):
        codec.serialize_array([{"ok": 1}, {"x": ["fine", bad]}])
    with pytest.raises(EncodeError, match="payload is None"):
        codec.serialize_array([{"ok": 1}, None])
    with pytest.raises(EncodeError, match="not JSON-serializable"):
        codec.serialize_array([{"ok": 1}, {1, 2}])

    class Wrapped(JsonSerializer[Any]):
        def dumps(self, payload: Any) -> str:
            return super().dumps({"v": payload})

    assert Codec(Wrapped()).serialize_array(payloads) is None  # its own dumps: one at a time


def test_escaped_lookalikes_and_surrogate_pairs_are_stored(backend, make_queue):
    q = make_queue()
    payloads = {
        "emoji": {"text": "snake \U0001f40d and é"},  # a surrogate pair in ASCII-escaped JSON
        "backslash-u": {"text": "\\u0000 is only text here"},
        "escaped-backslash": {"text": "\\\\ud800"},
    }
    with backend.Session.begin() as s:
        for key, payload in payloads.items():
            q.offer(s, key, payload)
    with backend.Session() as s:
        for key, payload in payloads.items():
            info = q.get(s, key)
            assert info is not None and info.payload == payload


def test_an_error_text_with_unstorable_characters_is_recorded(backend, make_queue):
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer(s, "k", {"v": 1})
    with backend.Session.begin() as s:
        env = q.try_poll(s)
        assert env is not None
        q.nack(s, env, ValueError("bad byte \x00 and \ud800 in the input"))
    with backend.Session() as s:
        info = q.get(s, "k")
    assert info is not None and info.attempts == 1
    assert "bad byte \ufffd and \ufffd in the input" in (info.last_error or "")


KEYS = ["Apple/1", "apple/2", "APPLE/3", "Ap%le/4", "Ap_le/5", "Apple /6", "Äpple/7"]


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("A", ["Apple/1", "APPLE/3", "Ap%le/4", "Ap_le/5", "Apple /6"]),
        ("a", ["apple/2"]),
        ("Apple", ["Apple/1", "Apple /6"]),
        ("Apple/", ["Apple/1"]),
        ("Ap%", ["Ap%le/4"]),
        ("Ap_", ["Ap_le/5"]),
        ("Ä", ["Äpple/7"]),
        ("ä", []),
    ],
)
def test_key_prefixes_are_literal_and_case_sensitive(backend, make_queue, prefix, expected):
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer_batch(s, [(k, {"k": k}) for k in KEYS])
    f = MessageFilter(key_prefix=prefix)
    with backend.Session() as s:
        assert sorted(m.key for m in q.search(s, f)) == sorted(expected)
        assert q.count(s, f) == len(expected)
    with backend.Session.begin() as s:
        assert q.drop_where(s, f) == len(expected)
    with backend.Session() as s:
        assert sorted(m.key for m in q.search(s)) == sorted(set(KEYS) - set(expected))


def test_the_cli_drops_only_the_keys_with_the_exact_prefix(backend, make_queue):
    from click.testing import CliRunner

    from sqla_delayedq.cli import cli

    q = DelayedQueue("cli-prefix")
    with backend.Session.begin() as s:
        q.offer_batch(s, [(k, {"k": k}) for k in KEYS])
    url = backend.url.render_as_string(hide_password=False)
    runner = CliRunner()
    listed = runner.invoke(
        cli, ["ls", "--url", url, "-q", "cli-prefix", "--key-prefix", "a", "--json"]
    )
    assert listed.exit_code == 0, listed.output
    assert '"apple/2"' in listed.output and '"Apple/1"' not in listed.output
    dropped = runner.invoke(
        cli, ["drop", "--url", url, "-q", "cli-prefix", "--key-prefix", "a", "--yes"]
    )
    assert dropped.exit_code == 0, dropped.output
    with backend.Session() as s:
        assert sorted(m.key for m in q.search(s)) == sorted(set(KEYS) - {"apple/2"})


FIELD_PAYLOADS = {
    "int": {"companyId": 3345},
    "float": {"companyId": 3345.0},
    "in-an-array": {"companyId": [3345, 12]},
    "in-a-nested-array": {"companyId": [[3345]]},
    "after-an-object": {"companyId": [{"x": 1}, 3345]},
    "in-an-object": {"companyId": {"companyId": 3345}},
    "top-level-array": [{"companyId": 3345}],
    "text": {"companyId": "3345"},
    "text-in-an-array": {"companyId": ["3345"]},
    "true": {"companyId": True},
    "true-in-an-array": {"companyId": [True]},
}

FIELD_FILTERS = [
    ({"companyId": 3345}, ["float", "int"]),
    ({"companyId": "3345"}, ["text"]),
    ({"companyId": True}, ["true"]),
]


@pytest.mark.parametrize(("field", "expected"), FIELD_FILTERS, ids=repr)
def test_a_payload_field_filter_matches_the_scalar_not_an_array_that_holds_it(
    backend, make_queue, field, expected
):
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer_batch(s, list(FIELD_PAYLOADS.items()))
    f = MessageFilter(payload=field)
    with backend.Session() as s:
        assert sorted(m.key for m in q.search(s, f)) == expected
        assert q.count(s, f) == len(expected)
    with backend.Session.begin() as s:
        assert q.reschedule(s, f) == len(expected)
    with backend.Session.begin() as s:
        assert q.drop_where(s, f) == len(expected)
    with backend.Session() as s:
        assert sorted(m.key for m in q.search(s)) == sorted(set(FIELD_PAYLOADS) - set(expected))


def test_requeue_dead_by_payload_field_leaves_arrays_that_hold_the_value(backend, make_queue):
    q = make_queue(retry=ExponentialBackoff(max_attempts=1))
    with backend.Session.begin() as s:
        q.offer_batch(s, list(FIELD_PAYLOADS.items()))
    with backend.Session.begin() as s:
        while (env := q.try_poll(s)) is not None:
            q.nack(s, env, "boom")
    with backend.Session.begin() as s:
        assert q.count(s, MessageFilter(state="dead")) == len(FIELD_PAYLOADS)
        assert q.requeue_dead(s, MessageFilter(payload={"companyId": 3345})) == 2
    with backend.Session() as s:
        requeued = q.search(s, MessageFilter(state="pending"))
        assert sorted(m.key for m in requeued) == ["float", "int"]


def test_the_cli_where_drops_only_the_scalar_field(backend, make_queue):
    from click.testing import CliRunner

    from sqla_delayedq.cli import cli

    q = DelayedQueue("cli-where")
    with backend.Session.begin() as s:
        q.offer_batch(s, list(FIELD_PAYLOADS.items()))
    url = backend.url.render_as_string(hide_password=False)
    dropped = CliRunner().invoke(
        cli, ["drop", "--url", url, "-q", "cli-where", "--where", "companyId=3345", "--yes"]
    )
    assert dropped.exit_code == 0, dropped.output
    with backend.Session() as s:
        left = sorted(m.key for m in q.search(s))
    assert left == sorted(set(FIELD_PAYLOADS) - {"int", "float"})


NOT_KEYS = {
    "str": ("ab", r"keys must be a collection of strings, got the str 'ab'; .*keys=\('ab',\)"),
    "bytes": (b"ab", "keys must be a collection of strings .*got bytes"),
    "int": (7, "keys must be a collection of strings .*got int"),
    "int-item": (("ab", 7), "keys must hold strings; item 1 is int"),
    "bytes-item": ([b"ab"], "keys must hold strings; item 0 is bytes"),
    "nul-item": (("a\x00b",), r"keys\[0\] contains a NUL"),
}


@pytest.mark.parametrize(("keys", "message"), NOT_KEYS.values(), ids=NOT_KEYS.keys())
def test_keys_that_are_not_a_collection_of_strings_are_refused_and_touch_nothing(
    backend, make_queue, keys, message
):
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer_batch(s, [(k, {"k": k}) for k in ("ab", "a", "b")])
    f = MessageFilter(keys=keys)
    with record_sql(backend.engine) as sql, backend.Session.begin() as s:
        for call in (q.drop_where, q.search, q.count, q.reschedule, q.requeue_dead):
            with pytest.raises(InvalidArgument, match=message):
                call(s, f)
    assert sql == []
    assert row_count(backend) == 3


@pytest.mark.parametrize("keys", [("ab",), ["ab"], {"ab"}, frozenset({"ab"})], ids=repr)
def test_keys_as_a_tuple_list_or_set_name_exactly_those_keys(backend, make_queue, keys):
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer_batch(s, [(k, {"k": k}) for k in ("ab", "a", "b")])
    with backend.Session.begin() as s:
        assert q.drop_where(s, MessageFilter(keys=keys)) == 1
    with backend.Session() as s:
        assert sorted(m.key for m in q.search(s)) == ["a", "b"]


def test_a_filter_on_false_never_runs_the_sql_compiled_for_true(backend, make_queue):
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer_batch(s, [("vip", {"vip": True}), ("regular", {"vip": False})])
    with backend.Session() as s:  # the same statement shapes, compiled with True first
        assert [m.key for m in q.search(s, MessageFilter(payload={"vip": True}))] == ["vip"]
        assert [m.key for m in q.search(s, MessageFilter(payload={"vip": False}))] == ["regular"]
    with backend.Session.begin() as s:
        assert q.drop_where(s, MessageFilter(payload={"vip": True, "other": 1})) == 0
        assert q.drop_where(s, MessageFilter(payload={"vip": False})) == 1
    with backend.Session() as s:
        assert [m.key for m in q.search(s)] == ["vip"]


def test_a_large_integer_field_matches_only_itself(backend, make_queue):
    # Snowflake-style ids: neighbours that one double cannot tell apart.
    snowflake = 1234567890123456789
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer_batch(s, [(str(n), {"userId": snowflake + n}) for n in (-1, 0, 1)])
        q.offer_batch(s, [("float", {"userId": 3345.0}), ("text", {"userId": "3345"})])
    with backend.Session() as s:
        assert [m.key for m in q.search(s, MessageFilter(payload={"userId": snowflake}))] == ["0"]
        assert [m.key for m in q.search(s, MessageFilter(payload={"userId": 3345}))] == ["float"]
    with backend.Session.begin() as s:
        assert q.drop_where(s, MessageFilter(payload={"userId": snowflake})) == 1
    with backend.Session() as s:
        assert sorted(m.key for m in q.search(s)) == ["-1", "1", "float", "text"]


BAD_FILTERS = {
    "prefix-nul": MessageFilter(key_prefix="k\x00"),
    "prefix-surrogate": MessageFilter(key_prefix="k\udcff"),  # what argv gives for a \xff byte
    "prefix-int": MessageFilter(key_prefix=cast(Any, 5)),
    "field-nul": MessageFilter(payload={"c\x00": 1}),
    "value-nul": MessageFilter(payload={"c": "a\x00b"}),
    "value-surrogate": MessageFilter(payload={"c": "a\ud800b"}),
    "value-nan": MessageFilter(payload={"c": float("nan")}),
    "value-inf": MessageFilter(payload={"c": float("-inf")}),
    "value-2**64": MessageFilter(payload={"c": 2**64}),
    # A double this large stands for many integers, and the backends disagreed on which.
    "value-float-2**53": MessageFilter(payload={"c": float(2**53)}),
    "value-float--2**70": MessageFilter(payload={"c": -float(2**70)}),
    "payload-list": MessageFilter(payload=cast(Any, [("c", 1)])),
}


@pytest.mark.parametrize("bad", BAD_FILTERS.values(), ids=BAD_FILTERS.keys())
def test_a_filter_no_backend_can_compare_is_refused_before_any_sql(backend, make_queue, bad):
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer(s, "k", {"c": 1})
    with record_sql(backend.engine) as sql, backend.Session.begin() as s:
        for call in (q.search, q.count, q.drop_where, q.reschedule, q.requeue_dead):
            with pytest.raises(InvalidArgument):
                call(s, bad)
    assert sql == []
    assert row_count(backend) == 1


@pytest.mark.parametrize("bad", ["k\x00", "k\ud800", 5], ids=["nul", "surrogate", "int"])
def test_a_key_no_backend_can_store_is_refused_by_get_contains_and_drop(backend, make_queue, bad):
    q = make_queue()
    with record_sql(backend.engine) as sql, backend.Session.begin() as s:
        for call in (q.get, q.contains, q.drop):
            with pytest.raises(InvalidArgument, match=r"^key"):
                call(s, bad)
    assert sql == []


@pytest.mark.parametrize("target", [None, 5, ("k",)], ids=["none", "int", "tuple"])
def test_reschedule_of_something_that_is_not_a_key_or_a_filter_is_refused(
    backend, make_queue, target
):
    """``reschedule(s, None)`` (a key looked up in a dict and missing, say) moved every
    pending message of the queue (found in review)."""
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer_batch(s, [("k", {}), ("other", {})])
    with (
        record_sql(backend.engine) as sql,
        backend.Session.begin() as s,
        pytest.raises(InvalidArgument, match=r"a key \(str\) or a MessageFilter"),
    ):
        q.reschedule(s, target, q.now() + timedelta(days=3650))
    assert sql == []
    with backend.Session() as s:
        assert all(m.scheduled_at <= q.now() for m in q.search(s))


BAD_PAGES = {
    "limit-str": ({"limit": "5"}, "limit must be an int, got str"),
    "limit-float": ({"limit": 1.5}, "limit must be an int, got float"),
    "limit-bool": ({"limit": True}, "limit must be an int, got bool"),
    "limit-0": ({"limit": 0}, "limit must be from 1"),
    "limit-2**63": ({"limit": 2**63}, "limit must be from 1"),
    "after-str": ({"after_id": "x"}, "after_id must be an int, got str"),
    "after-negative": ({"after_id": -1}, "after_id must be from 0"),
    "after-2**63": ({"after_id": 2**63}, "after_id must be from 0"),
}


@pytest.mark.parametrize(("page", "message"), BAD_PAGES.values(), ids=BAD_PAGES.keys())
def test_search_refuses_a_page_no_backend_can_read_before_any_sql(
    backend, make_queue, page, message
):
    """``after_id="x"`` returned every row on MariaDB and failed on PostgreSQL; ``2**63``
    failed with a database error or an ``OverflowError`` (found in review)."""
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer(s, "k", {})
    with (
        record_sql(backend.engine) as sql,
        backend.Session() as s,
        pytest.raises(InvalidArgument, match=message),
    ):
        q.search(s, **page)
    assert sql == []
    with backend.Session() as s:
        assert [m.key for m in q.search(s, limit=2**63 - 1, after_id=0)] == ["k"]


def test_a_message_whose_stored_text_is_not_json_fails_no_filter(backend, make_queue):
    """SQLite stores any text in the payload column: one message whose text was not JSON made
    every payload filter fail (``malformed JSON``) on the whole queue (found in review).
    PostgreSQL and MariaDB refuse such text when it is written."""
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer_batch(s, [("good", {"c": 1}), ("broken", {"c": 1}), ("other", {"c": 2})])
    corrupted = True
    try:
        with backend.engine.begin() as conn:
            text = sa.type_coerce('{"c": 1,', sa.String())  # the text as it is, not as JSON
            conn.execute(sa.update(T).where(T.c.key == "broken").values(payload=text))
    except sa.exc.DBAPIError:
        corrupted = False  # the server refused the text
    assert corrupted is (backend.name == "sqlite")
    left = ["good"] if corrupted else ["broken", "good"]
    one = MessageFilter(payload={"c": 1})
    with backend.Session() as s:
        assert sorted(m.key for m in q.search(s, one)) == left
        assert q.count(s, MessageFilter(payload={"c": 2})) == 1
        assert {m.key: m.decode_error is not None for m in q.search(s)}["broken"] is corrupted
    with backend.Session.begin() as s:
        assert q.drop_where(s, one) == len(left)
    with backend.Session() as s:
        assert sorted(m.key for m in q.search(s)) == (
            ["broken", "other"] if corrupted else ["other"]
        )


def _cli(backend: Any, *args: str) -> Any:
    from click.testing import CliRunner

    from sqla_delayedq.cli import cli

    url = backend.url.render_as_string(hide_password=False)
    return CliRunner().invoke(cli, [args[0], "--url", url, *args[1:]])


def test_the_cli_refuses_a_field_given_twice_with_different_values(backend, make_queue):
    """``--where c=1 --where c=2`` kept only ``c=2``: ``drop -y`` deleted the message with
    ``c=2``, where the two conditions together match nothing (found in review)."""
    q = DelayedQueue("twice")
    with backend.Session.begin() as s:
        q.offer_batch(s, [(f"k{i}", {"c": i, "on": True}) for i in range(3)])
    for where in (["c=1", "c=2"], ["c=1", "c=1.5"], ["on=true", "on=1"], ["c=1", 'c="1"']):
        flags = [x for w in where for x in ("--where", w)]
        dropped = _cli(backend, "drop", "-q", "twice", *flags, "-y")
        assert dropped.exit_code == 2, dropped.output
        assert "given twice" in dropped.output and "Traceback" not in dropped.output
    with backend.Session() as s:
        assert q.count(s) == 3
    # The same value twice is the same condition: c=1 and c=1.0 are one JSON number.
    dropped = _cli(backend, "drop", "-q", "twice", "--where", "c=1", "--where", "c=1.0", "-y")
    assert dropped.exit_code == 0, dropped.output
    with backend.Session() as s:
        assert sorted(m.key for m in q.search(s)) == ["k0", "k2"]


CLI_OUT_OF_RANGE = {
    "at-before-year-1": ("reschedule", "k", "--at", "0001-01-01T00:00:00+01:00"),
    "at-after-year-9999": ("reschedule", "k", "--at", "9999-12-31T23:59:59-01:00"),
    "retry-at": ("retry", "k", "--at", "0001-01-01T00:00:00+01:00"),
    "after-id-2**63": ("ls", "--after-id", str(2**63)),
    "after-id-negative": ("ls", "--after-id", "-1"),
    "limit-huge": ("ls", "--limit", str(2**64)),
    "key-and-all": ("reschedule", "k", "--all"),
}


@pytest.mark.parametrize("args", CLI_OUT_OF_RANGE.values(), ids=CLI_OUT_OF_RANGE.keys())
def test_the_cli_refuses_out_of_range_values_with_a_message(backend, make_queue, args):
    """These ended in a traceback (``OverflowError``), a database error, or (``--all`` with
    a key) were silently ignored (found in review)."""
    q = DelayedQueue("range")
    with backend.Session.begin() as s:
        q.offer(s, "k", {"c": 1})
        before = q.get(s, "k")
    result = _cli(backend, args[0], "-q", "range", *args[1:])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "rror" in result.output
    with backend.Session() as s:
        assert q.get(s, "k") == before
