"""Payload identity on every backend: when a re-offer is ``IGNORED`` and when it is ``UPDATED``.

A re-offer is ``IGNORED`` only when the stored payload is the same JSON document: a boolean is
never the number Python calls equal to it (``True == 1``), and a number is the same number
whatever Python type the driver reads it back as (PostgreSQL's ``jsonb`` hands the float ``1e23``
back as the int ``10**23``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from sqla_delayedq import OfferMode, Outcome

MODES = [OfferMode.REPLACE, OfferMode.KEEP_SCHEDULE]


def typed(value: Any) -> Any:
    """``value`` with the type of every scalar spelled out (``True`` and ``1`` differ)."""
    if isinstance(value, dict):
        return sorted((k, typed(v)) for k, v in value.items())
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value)


def reoffer(q: Any, s: Any, payload: Any, how: str, mode: OfferMode, at: Any = None) -> Outcome:
    if how == "batch":
        return q.offer_batch(s, [("k", payload, at)], mode=mode)[0].outcome
    return q.offer(s, "k", payload, at, mode=mode).outcome


BOOLEAN_VS_NUMBER = {
    "true-over-1": ({"flag": 1}, {"flag": True}),
    "1-over-true": ({"flag": True}, {"flag": 1}),
    "false-over-0": ({"flag": 0}, {"flag": False}),
    "false-over-0.0": ({"flag": 0.0}, {"flag": False}),
    "in-a-list": ({"n": [1, 0]}, {"n": [True, False]}),
    "nested": ({"a": {"b": [{"c": 1}]}}, {"a": {"b": [{"c": True}]}}),
    "top-level": (1, True),
}


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("how", ["offer", "batch"])
@pytest.mark.parametrize(
    ("stored", "offered"), BOOLEAN_VS_NUMBER.values(), ids=BOOLEAN_VS_NUMBER.keys()
)
def test_a_boolean_over_the_number_python_calls_equal_is_updated(
    backend, make_queue, stored, offered, how, mode
):
    q = make_queue()
    with backend.Session.begin() as s:
        assert q.offer(s, "k", stored).outcome is Outcome.CREATED
    with backend.Session.begin() as s:
        assert reoffer(q, s, offered, how, mode) is Outcome.UPDATED
    with backend.Session.begin() as s:
        env = q.try_poll(s)
        assert env is not None and typed(env.payload) == typed(offered)
        assert q.ack(s, env) is True


SAME_NUMBER = {
    "int-and-float": ({"x": 1}, {"x": 1.0}),
    "float-and-int": ({"x": 2.0}, {"x": 2}),
    "exponent": ({"x": 1e23, "y": 2.5e-7}, {"x": 1e23, "y": 2.5e-7}),
    "float-and-its-int": ({"x": 1e23}, {"x": 10**23}),
    "large-exponent": ({"x": [1e300, -1e22]}, {"x": [1e300, -1e22]}),
    "zero-signs": ({"x": -0.0}, {"x": 0}),
}


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("how", ["offer", "batch"])
@pytest.mark.parametrize(("stored", "offered"), SAME_NUMBER.values(), ids=SAME_NUMBER.keys())
def test_the_same_json_number_is_ignored_whatever_python_type_reads_it(
    backend, make_queue, clock, stored, offered, how, mode
):
    at = clock() + timedelta(hours=1)
    q = make_queue()
    with backend.Session.begin() as s:
        assert q.offer(s, "k", stored, at).outcome is Outcome.CREATED
    with backend.Session.begin() as s:
        assert reoffer(q, s, offered, how, mode, at) is Outcome.IGNORED


@pytest.mark.parametrize("how", ["offer", "batch"])
def test_an_identical_reoffer_leaves_a_message_in_flight_alone(backend, make_queue, clock, how):
    """The lease of a taken message survives an identical re-offer: it is not delivered twice."""
    payload = {"x": 1e23, "y": 2.5e-7, "big": 12345678901234567890.0, "ok": True}
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer(s, "k", payload, clock())
    with backend.Session.begin() as s:
        taken = q.try_poll(s)
    assert taken is not None
    with backend.Session.begin() as s:
        assert reoffer(q, s, payload, how, OfferMode.REPLACE, clock()) is Outcome.IGNORED
        assert reoffer(q, s, payload, how, OfferMode.KEEP_SCHEDULE) is Outcome.IGNORED
    with backend.Session.begin() as s:
        assert q.try_poll(s) is None  # still leased: no second delivery
        assert q.ack(s, taken) is True


@pytest.mark.parametrize("how", ["offer", "batch"])
def test_numbers_that_differ_only_past_float_precision_are_updated(backend, make_queue, how):
    """``float(2**53 + 1) == 2**53``: the int is not the float it rounds to."""
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer(s, "k", {"x": 2**53 + 1})
    with backend.Session.begin() as s:
        assert reoffer(q, s, {"x": float(2**53)}, how, OfferMode.REPLACE) is Outcome.UPDATED


SAME = [
    ({"a": 1, "b": [1.0, "x"]}, {"b": [1, "x"], "a": 1.0}),
    (1e23, 10**23),
    (-0.0, 0),
    (None, None),
    ("1", "1"),
    ([], []),
]
DIFFERENT = [
    (True, 1),
    (1, True),
    (False, 0),
    (0.0, False),
    (True, 1.0),
    ([True], [1]),
    ({"a": False}, {"a": 0}),
    ({"a": 1}, {"a": 1, "b": 1}),
    ([1, 2], [1, 2, 3]),
    ("1", 1),
    (None, 0),
    (None, False),
    ([], {}),
    (2**53 + 1, float(2**53)),
    (0.1, 0.2),
]


@pytest.mark.parametrize(("a", "b"), SAME, ids=repr)
def test_same_json_calls_equal_the_same_json_value(a, b):
    from sqla_delayedq._codec import same_json

    assert same_json(a, b) and same_json(b, a)


@pytest.mark.parametrize(("a", "b"), DIFFERENT, ids=repr)
def test_same_json_tells_booleans_numbers_and_shapes_apart(a, b):
    from sqla_delayedq._codec import same_json

    assert not same_json(a, b) and not same_json(b, a)
