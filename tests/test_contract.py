"""Conformance: batch offer and poll, retries and dead letters, poison, read and admin sides."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
import sqlalchemy as sa

from sqla_delayedq import (
    ConfirmationRequired,
    DelayedMessage,
    Delivery,
    ExponentialBackoff,
    InvalidArgument,
    JsonSerializer,
    MessageFilter,
    NackOutcome,
    OfferMode,
    Outcome,
    State,
)
from tests.fix_queue import record_sql

T = cast(sa.Table, DelayedMessage.__table__)


@pytest.fixture
def backend(conformance_backend):
    """SQLite, PostgreSQL, MariaDB, and PostgreSQL through psycopg's async driver."""
    return conformance_backend


def rows(backend) -> int:
    with backend.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(T)).scalar_one()


# -- offer_batch -------------------------------------------------------------------------


def test_offer_batch_outcomes_in_input_order(backend, make_queue, clock):
    q = make_queue()
    at = clock() + timedelta(minutes=1)
    with backend.Session() as s, s.begin():
        q.offer(s, "old-same", {"v": 0}, at)
        q.offer(s, "old-diff", {"v": 0}, at)
    with backend.Session() as s, s.begin():
        results = q.offer_batch(
            s,
            [
                ("new", {"v": 1}, at),
                ("old-same", {"v": 0}, at),
                ("old-diff", {"v": 9}, at),
                ("new", {"v": 1}, at),  # repeated identical: ignored
                ("new", {"v": 2}, at),  # repeated different: updated
                (None, {"v": 3}),
            ],
        )
    assert [r.outcome for r in results] == [
        Outcome.CREATED,
        Outcome.IGNORED,
        Outcome.UPDATED,
        Outcome.IGNORED,
        Outcome.UPDATED,
        Outcome.CREATED,
    ]
    with backend.Session() as s:
        assert q.get(s, "new").payload == {"v": 2}
        assert q.get(s, "old-diff").payload == {"v": 9}
        assert q.get(s, results[-1].key).payload == {"v": 3}
    assert rows(backend) == 4


def test_offer_batch_modes(backend, make_queue, clock):
    q = make_queue()
    at = clock() + timedelta(minutes=1)
    later = at + timedelta(hours=1)
    with backend.Session() as s, s.begin():
        q.offer(s, "a", 1, at)
        skipped = q.offer_batch(s, [("a", 2, later), ("b", 2, later)], mode="skip")
        assert [r.outcome for r in skipped] == [Outcome.IGNORED, Outcome.CREATED]
        kept = q.offer_batch(s, [("a", 3, later)], mode="keep_schedule")
        assert kept[0].outcome is Outcome.UPDATED
        info = q.get(s, "a")
        assert (info.payload, info.scheduled_at) == (3, at)


def test_offer_batch_5000_with_repeats_and_existing_keys_is_exact(backend, make_queue, clock):
    q = make_queue()
    at = clock()
    with backend.Session() as s, s.begin():
        # 500 keys already present: 250 identical to what the batch offers, 250 different.
        q.offer_batch(s, [(f"k{i:05d}", {"i": i, "old": i % 2 == 1}, at) for i in range(500)])
    batch = [(f"k{i:05d}", {"i": i, "old": False}, at) for i in range(4900)]
    batch += [(f"k{i:05d}", {"i": i, "old": False, "again": True}, at) for i in range(1000, 1100)]
    with record_sql(backend.engine) as statements, backend.Session() as s, s.begin():
        results = q.offer_batch(s, batch)
    assert len(results) == 5000
    got = [r.outcome for r in results]
    expected = [Outcome.IGNORED if i % 2 == 0 else Outcome.UPDATED for i in range(500)]
    expected += [Outcome.CREATED] * 4400 + [Outcome.UPDATED] * 100
    assert got == expected
    assert [r.key for r in results] == [k for k, _, _ in batch]
    assert rows(backend) == 4900
    assert len(statements) <= 20  # a few statements per chunk, never one per message
    with backend.Session() as s:
        assert q.get(s, "k01050").payload == {"i": 1050, "old": False, "again": True}
        assert q.get(s, "k00001").payload == {"i": 1, "old": False}


def test_offer_batch_of_large_payloads_fits_each_statement_in_the_server_s_packet(
    backend, make_queue
):
    """1,000 payloads of 20 KB (20 MB): MariaDB refused the one insert of its chunk, larger
    than its 16 MiB ``max_allowed_packet``, as "server has gone away", a TransientError that
    failed again on every retry (found in review, through the Spark path)."""
    q = make_queue()
    big = "x" * 20_000
    with backend.Session() as s, s.begin():
        results = q.offer_batch(s, [(f"k{i:04d}", {"i": i, "text": big}) for i in range(1000)])
    assert [r.outcome for r in results] == [Outcome.CREATED] * 1000
    assert rows(backend) == 1000
    with backend.Session() as s:
        info = q.get(s, "k0999")
        assert info is not None and info.payload == {"i": 999, "text": big}
    # A key offered twice, small then large: its row carries the large one. Headers of
    # 7,900 three-byte characters go into every row (24 MB in UTF-8 for 1,000).
    twice: list[tuple[str, dict[str, Any]]] = [(f"t{i:04d}", {"i": i}) for i in range(1000)]
    twice += [(f"t{i:04d}", {"i": i, "text": big}) for i in range(1000)]
    with backend.Session() as s, s.begin():
        assert len(q.offer_batch(s, twice)) == 2000
        headed = [(f"h{i:04d}", {"i": i}) for i in range(1000)]
        q.offer_batch(s, headed, headers={"trace": "\u20ac" * 7900})
    assert rows(backend) == 3000


# -- try_poll_many -----------------------------------------------------------------------


def test_try_poll_many_in_schedule_order_with_per_message_envelopes(backend, make_queue, clock):
    q = make_queue(lease=timedelta(seconds=10))
    now = clock()
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"k{i}", i, now - timedelta(seconds=i)) for i in range(6)])
    with backend.Session() as s, s.begin():
        first = q.try_poll(s)
    assert first.key == "k5"
    clock.advance(11)  # k5's lease runs out: its next take is a redelivery
    with backend.Session() as s, s.begin():
        envs = q.try_poll_many(s, 10)
    # k5's expired lease ends at t0+10, after every other message's due time.
    assert [e.key for e in envs] == ["k4", "k3", "k2", "k1", "k0", "k5"]
    assert [e.delivery for e in envs] == [Delivery.FIRST] * 5 + [Delivery.REDELIVERY]
    assert envs[-1].scheduled_at == first.lease_until  # the due time before this take
    assert len({e.lock_token for e in envs}) == 6
    assert all(e.lease_until == clock() + timedelta(seconds=10) for e in envs)
    with backend.Session() as s, s.begin():
        assert q.ack(s, first) is False
        assert q.ack_many(s, envs) == 6


def test_try_poll_many_claims_with_one_statement_on_postgresql(pg, make_queue, clock):
    q = make_queue()
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(f"k{i}", i) for i in range(50)])
    with record_sql(pg.engine) as statements, pg.Session() as s, s.begin():
        envs = q.try_poll_many(s, 20)
    claims = [x for x in statements if "delayed_queue" in x]
    assert len(claims) == 1 and claims[0].lstrip().startswith("WITH picked")
    assert len(envs) == 20 and all(e.delivery is Delivery.FIRST for e in envs)


# -- failures, retries and dead letters ----------------------------------------------------


def test_fails_three_times_then_succeeds(backend, make_queue, clock):
    policy = ExponentialBackoff(max_attempts=5, initial=timedelta(seconds=1), jitter=0)
    q = make_queue(retry=policy)
    with backend.Session() as s, s.begin():
        q.offer(s, "job", {"n": 1})
    deliveries = []
    for attempt in range(1, 5):
        with backend.Session() as s, s.begin():
            env = q.try_poll(s)
            assert env is not None and env.attempt == attempt
            deliveries.append(env.attempt)
            if attempt < 4:
                assert q.nack(s, env, ValueError(f"boom {attempt}")) is NackOutcome.RETRY_SCHEDULED
                info = q.get(s, "job")
                assert info.attempts == attempt and f"boom {attempt}" in info.last_error
                assert info.last_attempt_at == clock()
                assert info.scheduled_at == clock() + timedelta(seconds=2 ** (attempt - 1))
                assert q.try_poll(s) is None  # not before the backoff
            else:
                assert q.ack(s, env)
        clock.advance(timedelta(seconds=2**attempt))
    assert deliveries == [1, 2, 3, 4]
    with backend.Session() as s:
        assert q.get(s, "job") is None


def test_always_failing_message_is_dead_after_max_attempts(backend, make_queue, clock):
    q = make_queue(retry=ExponentialBackoff(max_attempts=5, jitter=0))
    with backend.Session() as s, s.begin():
        q.offer(s, "job", {"n": 1})
    outcomes = []
    for _ in range(10):
        with backend.Session() as s, s.begin():
            env = q.try_poll(s)
            if env is None:
                break
            outcomes.append(q.nack(s, env, "always fails"))
        clock.advance(timedelta(hours=2))
    assert outcomes == [NackOutcome.RETRY_SCHEDULED] * 4 + [NackOutcome.DEAD]
    with backend.Session() as s, s.begin():
        info = q.get(s, "job")
        assert info.status == "dead" and info.state is State.DEAD
        assert info.attempts == 5 and info.last_error == "always fails"
        assert info.scheduled_at is None
        assert q.counts(s).dead == 1
        assert q.requeue_dead(s) == 1
        env = q.try_poll(s)
        assert env is not None and env.attempt == 1


def test_nack_at_an_explicit_time_and_stale_nack(backend, make_queue, clock):
    q = make_queue(lease=timedelta(seconds=5))
    with backend.Session() as s, s.begin():
        q.offer(s, "k", 1)
    with backend.Session() as s, s.begin():
        env = q.try_poll(s)
        at = clock() + timedelta(minutes=7)
        assert q.nack(s, env, "later", at=at) is NackOutcome.RETRY_SCHEDULED
        assert q.get(s, "k").scheduled_at == at
        assert q.nack(s, env, "again") is NackOutcome.STALE


def test_poison_message_at_the_head_is_buried_and_polling_goes_on(backend, make_queue, clock):
    q = make_queue()
    now = clock()
    with backend.Session() as s, s.begin():
        q.offer(s, "poison", {"x": 1}, now - timedelta(seconds=10))
        q.offer(s, "good", {"x": 2}, now - timedelta(seconds=5))
        s.execute(T.update().where(T.c.key == "poison").values(payload=None))  # corrupt it
    with backend.Session() as s, s.begin():
        env = q.try_poll(s)
        assert env is not None and env.key == "good"
    with backend.Session() as s:
        info = q.get(s, "poison")
        assert info.status == "dead" and "DecodeError" in info.last_error
        assert info.decode_error is not None


def test_release_and_extend(backend, make_queue, clock):
    q = make_queue(lease=timedelta(seconds=10))
    with backend.Session() as s, s.begin():
        q.offer(s, "k", 1)
    with backend.Session() as s, s.begin():
        env = q.try_poll(s)
        with pytest.raises(InvalidArgument, match="lease must be at most"):
            q.extend(s, env, timedelta.max)  # was an OverflowError: its end is past year 9999
        longer = q.extend(s, env, timedelta(minutes=30))
        assert longer is not None and longer.lease_until == clock() + timedelta(minutes=30)
    clock.advance(60)
    with backend.Session() as s, s.begin():
        assert q.try_poll(s) is None  # the extended lease still holds
        assert q.release(s, longer) is True
        assert q.release(s, longer) is False  # guarded by the token
        assert q.extend(s, longer) is None
        again = q.try_poll(s)
        assert again is not None and again.attempt == 1 and again.delivery is Delivery.FIRST


# -- read side ---------------------------------------------------------------------------


def test_counts_oldest_due_and_search(backend, make_queue, clock):
    q = make_queue(lease=timedelta(seconds=30))
    now = clock()
    with backend.Session() as s, s.begin():
        q.offer_batch(
            s,
            [
                ("order/1", {"companyId": 3345, "kind": "a"}, now - timedelta(seconds=30)),
                ("order/2", {"companyId": 3345, "kind": "b"}, now - timedelta(seconds=10)),
                ("order/3", {"companyId": 7, "kind": "a"}, now + timedelta(hours=1)),
                ("invoice/1", {"companyId": 3345, "vip": True}, now - timedelta(seconds=1)),
            ],
        )
        assert q.oldest_due(s) == now - timedelta(seconds=30)
    with backend.Session() as s, s.begin():
        q.try_poll(s)  # order/1 goes in flight
    with backend.Session() as s:
        counts = q.counts(s)
        assert (counts.due, counts.scheduled, counts.in_flight, counts.dead) == (2, 1, 1, 0)
        assert counts.pending == 4
        assert q.oldest_due(s) == now - timedelta(seconds=10)
        company = q.search(s, MessageFilter(payload={"companyId": 3345}))
        # Batches insert in key order, so ids (the search order) follow the keys.
        assert [m.key for m in company] == ["invoice/1", "order/1", "order/2"]
        both = MessageFilter(payload={"companyId": 3345, "kind": "a"})
        assert [m.key for m in q.search(s, both)] == ["order/1"]
        assert [m.key for m in q.search(s, MessageFilter(payload={"vip": True}))] == ["invoice/1"]
        assert [m.key for m in q.search(s, MessageFilter(key_prefix="order/"))] == [
            "order/1",
            "order/2",
            "order/3",
        ]
        in_flight = q.search(s, MessageFilter(state="in_flight"))
        assert [m.key for m in in_flight] == ["order/1"] and in_flight[0].state is State.IN_FLIGHT
        assert [m.key for m in q.search(s, MessageFilter(state=State.SCHEDULED))] == ["order/3"]
        assert q.count(s, MessageFilter(state="due")) == 2
        page = q.search(s, limit=2)
        assert len(page) == 2 and len(q.search(s, after_id=page[-1].id)) == 2
        assert q.contains(s, "order/3") and not q.contains(s, "nope")
        with pytest.raises(InvalidArgument, match="unknown state"):
            q.search(s, MessageFilter(state="weird"))
        with pytest.raises(InvalidArgument, match="only str, int"):
            q.search(s, MessageFilter(payload={"x": [1]}))


def test_key_prefix_patterns_are_escaped(backend, make_queue):
    q = make_queue()
    with backend.Session() as s, s.begin():
        for key in ("a_b/1", "a%b/1", "axb/1", "aXb/1"):
            q.offer(s, key, 1)
        assert [m.key for m in q.search(s, MessageFilter(key_prefix="a_b"))] == ["a_b/1"]
        assert [m.key for m in q.search(s, MessageFilter(key_prefix="a%b"))] == ["a%b/1"]
        assert q.drop_where(s, MessageFilter(key_prefix="a_b")) == 1
        assert q.contains(s, "axb/1")


# -- admin side --------------------------------------------------------------------------


def test_drop_reschedule_and_drop_all(backend, make_queue, clock):
    q = make_queue()
    other = make_queue("other")
    now = clock()
    later = now + timedelta(days=1)
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"k{i}", {"companyId": i % 3}, later) for i in range(9)])
        other.offer(s, "k0", 1)
        assert q.drop(s, "k0") is True and q.drop(s, "k0") is False
        assert q.drop_where(s, MessageFilter(payload={"companyId": 1})) == 3
        assert q.reschedule(s, "k2") == 1  # process now
        assert q.try_poll(s).key == "k2"
        assert q.reschedule(s, MessageFilter(payload={"companyId": 2}), now) == 2  # k5, k8
        assert q.reschedule(s, "k2") == 0  # in flight: its lease is kept
        assert [e.key for e in q.try_poll_many(s, 10)] == ["k5", "k8"]
        with pytest.raises(ConfirmationRequired):
            q.drop_all(s)
        with pytest.raises(ConfirmationRequired):
            q.drop_all(s, confirm="other")
        assert q.drop_all(s, confirm="q") == 5
        assert other.contains(s, "k0")
        with pytest.raises(InvalidArgument):
            q.drop_where(s, None)


def test_process_now_counts_the_attempt_an_expired_lease_lost(backend, make_queue, clock):
    """A consumer took the message and died; an operator made it due now (or later) before
    another take: the lost attempt counts as the take counts it (process now leaves it to the
    take, which sees a redelivery; a move to later counts it at once), so clicking "process now"
    never hands a message that kills its consumer its attempts back."""
    q = make_queue(lease=timedelta(seconds=10), retry=ExponentialBackoff(max_attempts=3))
    with backend.Session() as s, s.begin():
        q.offer(s, "crasher", {"n": 1})
    attempts, deliveries = [], []
    for move in ("now", "later", None, None):
        with backend.Session() as s, s.begin():
            env = q.try_poll(s)  # taken, then the consumer "crashes": no ack, no nack
            if env is None:
                break
            attempts.append(env.attempt)
            deliveries.append(env.delivery)
        clock.advance(11)
        with backend.Session() as s, s.begin():
            if move == "now":
                assert q.reschedule(s, "crasher") == 1
            elif move == "later":
                later = clock() + timedelta(days=1)
                assert q.reschedule(s, MessageFilter(keys=("crasher",)), later) == 1
                clock.advance(timedelta(days=1))
            assert q.get(s, "crasher").attempts == len(attempts) - (move != "later")
    assert attempts == [1, 2, 3]
    assert deliveries == [Delivery.FIRST, Delivery.REDELIVERY, Delivery.FIRST]
    with backend.Session() as s:
        info = q.get(s, "crasher")
        assert info.status == "dead" and info.attempts == 3


def _crash_until_dead(backend, q, clock, key, press: str | None) -> list[tuple[int, Delivery]]:
    """Take ``key`` and "crash" (no settle) until no take hands it out; after the second lost
    lease an operator presses "process now" (``press="now"``) or moves it a day later."""
    deliveries = []
    for _ in range(5):
        with backend.Session() as s, s.begin():
            env = q.try_poll(s)
            if env is None:
                break
            deliveries.append((env.attempt, env.delivery))
        clock.advance(11)
        if len(deliveries) == 2 and press is not None:
            with backend.Session() as s, s.begin():
                at = None if press == "now" else clock() + timedelta(days=1)
                assert q.reschedule(s, key, at) == 1
            if press == "later":
                clock.advance(timedelta(days=1))
    return deliveries


@pytest.mark.parametrize("press", ["now", "later"])
def test_a_message_whose_lost_lease_used_up_its_attempts_is_buried_whether_rescheduled_or_not(
    backend, make_queue, clock, press
):
    """Its consumer died on its last attempt: the take buries it ("lease ran out") instead of
    delivering it again. Process now, or a move to later, before that take changes nothing of
    it: never an attempt past max_attempts, the same status, attempts and error."""
    policy = dict(lease=timedelta(seconds=10), retry=ExponentialBackoff(max_attempts=2))
    alone, pressed_q = make_queue("alone", **policy), make_queue("pressed", **policy)
    with backend.Session() as s, s.begin():
        alone.offer(s, "k", {"n": 1})
        pressed_q.offer(s, "k", {"n": 1})
    untouched = _crash_until_dead(backend, alone, clock, "k", None)
    pressed = _crash_until_dead(backend, pressed_q, clock, "k", press)
    assert untouched == [(1, Delivery.FIRST), (2, Delivery.REDELIVERY)]
    assert pressed == untouched
    with backend.Session() as s:
        expected = alone.get(s, "k")
        got = pressed_q.get(s, "k")
    assert expected.status == "dead" and expected.attempts == 2
    assert "lease ran out without an ack on 2 attempts" in expected.last_error
    assert (got.status, got.attempts) == (expected.status, expected.attempts)
    if press == "now":  # the same take buried it, for the same reason
        assert got.last_error == expected.last_error
    else:
        assert got.last_error.startswith("no attempt left: 2 attempts were counted")


def test_a_take_never_hands_out_an_attempt_past_max_attempts(backend, make_queue, clock):
    """A message that failed more often than a queue's max_attempts allows (it failed under a
    higher one) is buried by that queue's take, not run once more."""
    generous = make_queue(retry=ExponentialBackoff(max_attempts=5))
    strict = make_queue(retry=ExponentialBackoff(max_attempts=2))
    with backend.Session() as s, s.begin():
        generous.offer(s, "k", {"n": 1})
    for _ in range(2):
        with backend.Session() as s, s.begin():
            env = generous.try_poll(s)
            assert generous.nack(s, env, "boom") is NackOutcome.RETRY_SCHEDULED
        clock.advance(timedelta(days=1))
    with backend.Session() as s, s.begin():
        assert strict.try_poll(s) is None
    with backend.Session() as s:
        info = strict.get(s, "k")
    assert info.status == "dead" and info.attempts == 2
    assert info.last_error.startswith("no attempt left: 2 attempts were counted")


@pytest.mark.parametrize("retention", [None, timedelta(days=1)])
@pytest.mark.parametrize("used_up_by", ["failures", "a lost lease"])
def test_a_transactional_take_never_hands_out_an_attempt_past_max_attempts(
    backend, make_queue, clock, retention, used_up_by
):
    """As the lease take above: a message with no attempt left is buried by ``process_one``
    (and ``consume``), its handler never run. The plain consume (no retention) ran it once
    more, as attempt max_attempts + 1 or as the redelivery of a lease that used up the last
    attempt, where a lease take and a consume under retention buried it."""
    lease = timedelta(seconds=10)
    generous = make_queue(retry=ExponentialBackoff(max_attempts=5), lease=lease)
    strict = make_queue(retry=ExponentialBackoff(max_attempts=2), lease=lease, retention=retention)
    with backend.Session() as s, s.begin():
        generous.offer(s, "k", {"n": 1})
    failures = 2 if used_up_by == "failures" else 1
    for _ in range(failures):
        with backend.Session() as s, s.begin():
            env = generous.try_poll(s)
            assert generous.nack(s, env, "boom") is NackOutcome.RETRY_SCHEDULED
        clock.advance(timedelta(days=1))
    if used_up_by == "a lost lease":
        with backend.Session() as s, s.begin():
            assert generous.try_poll(s).attempt == 2  # its consumer dies: no ack, no nack
        clock.advance(lease + timedelta(seconds=1))
    handled: list[str] = []
    with backend.Session() as s, s.begin():
        assert strict.process_one(s, lambda env, _: handled.append(env.key)) is None
        assert strict.consume(s) == []
    assert handled == []
    with backend.Session() as s:
        info = strict.get(s, "k")
    assert info.status == "dead" and info.attempts == 2
    if used_up_by == "failures":
        assert info.last_error.startswith("no attempt left: 2 attempts were counted")
    else:
        assert "lease ran out without an ack on 2 attempts" in info.last_error


@pytest.mark.parametrize("take", ["lease", "transactional"])
def test_a_message_a_take_buries_is_logged(backend, make_queue, clock, caplog, take):
    """No handler runs to fail, so the take itself says it, on the workers' logger at ERROR (a
    message never becomes dead without a line in the log): an undecodable payload, and
    attempts used up. Both were buried in silence."""
    generous = make_queue(retry=ExponentialBackoff(max_attempts=5))
    strict = make_queue(retry=ExponentialBackoff(max_attempts=1))
    now = clock()
    with backend.Session() as s, s.begin():
        generous.offer(s, "used-up", {"n": 1}, now - timedelta(seconds=10))
        generous.offer(s, "poison", {"n": 2}, now - timedelta(seconds=5))
        s.execute(T.update().where(T.c.key == "poison").values(payload_type="other"))
    with backend.Session() as s, s.begin():
        env = generous.try_poll(s)
        assert env.key == "used-up"
        assert generous.nack(s, env, "boom", now) is NackOutcome.RETRY_SCHEDULED
    caplog.set_level(logging.ERROR, logger="sqla_delayedq.worker")
    with backend.Session() as s, s.begin():
        if take == "lease":
            assert strict.try_poll_many(s, 2) == []
        else:
            assert strict.process_one(s, lambda env, _: None) is None
    logged = sorted(
        r.getMessage()
        for r in caplog.records
        if r.name == "sqla_delayedq.worker" and r.levelno == logging.ERROR
    )
    assert len(logged) == 2, logged
    poison, used_up = logged
    assert poison.startswith("q/poison is dead: the take buried it without delivering it: ")
    assert "DecodeError" in poison
    assert used_up.startswith("q/used-up is dead: the take buried it without delivering it: ")
    assert "no attempt left: 1 attempts were counted" in used_up
    with backend.Session() as s:
        assert [strict.get(s, k).status for k in ("poison", "used-up")] == ["dead", "dead"]


def test_retention_keeps_acked_messages_as_done_then_prunes(backend, make_queue, clock):
    q = make_queue(retention=timedelta(hours=1))
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 1})
    with backend.Session() as s, s.begin():
        env = q.try_poll(s)
        assert q.ack(s, env)
        info = q.get(s, "k")
        assert info.status == "done" and info.scheduled_at is None and info.state is State.DONE
        assert q.try_poll(s) is None
        assert q.offer(s, "k", {"v": 1}).outcome is Outcome.IGNORED  # dedupe window
        assert q.counts(s).done == 1
        assert q.prune(s) == 0
    clock.advance(timedelta(hours=2))
    with backend.Session() as s, s.begin():
        assert q.prune(s) == 1
        assert q.get(s, "k") is None


@pytest.mark.parametrize("how", ["process_one", "consume"])
def test_a_transactional_take_under_retention_leaves_the_next_message_to_others(
    server_backend, make_queue, clock, how
):
    """Under retention a transactional take is a lease in the caller's transaction, and it
    locked one row more than it took (to say whether more was due) until that transaction
    ended, the handler's: a second consumer found nothing due meanwhile (found in review)."""
    backend = server_backend
    q = make_queue(retention=timedelta(days=1))
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [("a", {}), ("b", {})])
    clock.advance(timedelta(seconds=1))  # past their due time (see the entity test's note)
    seen: list[str] = []

    def second() -> None:
        with backend.Session() as other, other.begin():
            if how == "consume":
                seen.extend(e.key for e in q.consume(other, 1))
            else:
                q.process_one(other, lambda env, session: seen.append(env.key))

    with backend.Session() as s, s.begin():
        if how == "consume":
            assert len(q.consume(s, 1)) == 1
            second()
        else:
            q.process_one(s, lambda env, session: second())
    assert seen == ["b"]


def test_process_one_under_retention_keeps_a_handled_message_done(backend, make_queue, clock):
    """The workers' transactional mode deleted a handled message of a queue with retention,
    though ``consume`` and an ack keep it as done: the dedupe window was lost, and offered
    again with its key, the message was created and handled twice. A failure is recorded in
    the handler's transaction, or after its rollback, as for any consumed message."""
    policy = ExponentialBackoff(max_attempts=3, initial=timedelta(seconds=30), jitter=0)
    q = make_queue(retention=timedelta(days=1), retry=policy)
    with backend.Session() as s, s.begin():
        keys = ("done", "fails", "bails")  # due in this order
        q.offer_batch(
            s, [(k, {"n": i}, clock() - timedelta(seconds=3 - i)) for i, k in enumerate(keys)]
        )
    handled: list[Any] = []

    def handle(env: Any, session: Any) -> None:
        handled.append(env)
        if env.key == "fails":
            raise ValueError("no")
        if env.key == "bails":
            raise SystemExit("the handler bails out")

    with backend.Session() as s, s.begin():
        assert q.process_one(s, handle)[1:] == (None, None)
    with backend.Session() as s, s.begin():
        _, error, outcome = q.process_one(s, handle)
        assert isinstance(error, ValueError) and outcome is NackOutcome.RETRY_SCHEDULED
    with pytest.raises(SystemExit), backend.Session() as s, s.begin():
        q.process_one(s, handle)
    assert [(e.key, e.attempt, e.lock_token) for e in handled] == [
        ("done", 1, ""),
        ("fails", 1, ""),
        ("bails", 1, ""),
    ]
    with backend.Session() as s, s.begin():  # as the worker records the attempt that bailed
        assert q.record_failure(s, handled[2], "bailed") is NackOutcome.RETRY_SCHEDULED
    with backend.Session() as s, s.begin():
        done, fails, bails = (q.get(s, k) for k in ("done", "fails", "bails"))
        assert done.state is State.DONE
        assert q.offer(s, "done", {"n": 0}).outcome is Outcome.IGNORED  # the dedupe window
        assert (fails.state, fails.attempts) == (State.SCHEDULED, 1)
        assert fails.last_error.startswith("ValueError: no")
        assert fails.scheduled_at == clock() + timedelta(seconds=30)
        assert (bails.state, bails.attempts, bails.last_error) == (State.SCHEDULED, 1, "bailed")


# -- consume (transactional mode, seed 002) -----------------------------------------------


def test_consume_removes_on_commit_and_restores_on_rollback(backend, make_queue, clock):
    q = make_queue(retry=ExponentialBackoff(max_attempts=2, initial=timedelta(seconds=5), jitter=0))
    now = clock()
    with backend.Session() as s, s.begin():
        q.offer_batch(
            s, [("a", 1, now - timedelta(seconds=2)), ("b", 2, now - timedelta(seconds=1))]
        )
    with pytest.raises(RuntimeError), backend.Session() as s, s.begin():
        envs = q.consume(s, 5)
        assert [e.key for e in envs] == ["a", "b"] and envs[0].attempt == 1
        raise RuntimeError("handler failed: everything rolls back")
    with backend.Session() as s, s.begin():
        assert q.record_failure(s, envs[0], "boom") is NackOutcome.RETRY_SCHEDULED
        assert q.record_failure(s, envs[0], "boom again") is NackOutcome.STALE
        info = q.get(s, "a")
        assert (info.attempts, info.last_error) == (1, "boom")
        assert info.scheduled_at == now + timedelta(seconds=5)
    with backend.Session() as s, s.begin():
        (env,) = q.consume(s, 5)
        assert env.key == "b"
    with backend.Session() as s:
        assert q.get(s, "b") is None
    clock.advance(5)
    with pytest.raises(RuntimeError), backend.Session() as s, s.begin():
        (env,) = q.consume(s)
        assert env.key == "a" and env.attempt == 2
        raise RuntimeError("fails again")
    with backend.Session() as s, s.begin():
        assert q.record_failure(s, env, "final") is NackOutcome.DEAD
        assert q.get(s, "a").status == "dead"


@pytest.mark.parametrize("mode", [OfferMode.REPLACE, OfferMode.KEEP_SCHEDULE])
def test_a_failure_recorded_after_a_rollback_spares_a_version_offered_meanwhile(
    backend, make_queue, clock, mode
):
    """The rolled-back attempt of v1 was recorded on v2, offered in between with the same due
    time: v2 took v1's attempt (dead at once with one attempt allowed) without its handler
    ever running. The record now applies only to the version that was taken."""
    q = make_queue(retry=ExponentialBackoff(max_attempts=1, initial=timedelta(seconds=5)))
    now = clock()
    at = now - timedelta(seconds=1)
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"text": "v1"}, at)
    with pytest.raises(RuntimeError), backend.Session() as s, s.begin():
        (env,) = q.consume(s)
        raise RuntimeError("v1's handler failed: rolled back")
    with backend.Session() as s, s.begin():
        assert q.offer(s, "k", {"text": "v2"}, at, mode=mode).outcome is Outcome.UPDATED
    with backend.Session() as s, s.begin():
        assert q.record_failure(s, env, "v1 failed") is NackOutcome.STALE
    with backend.Session() as s, s.begin():
        (taken,) = q.consume(s)
        assert taken.payload == {"text": "v2"} and taken.attempt == 1
    # Without an offer in between, the record applies (and, one attempt allowed, buries it).
    with backend.Session() as s, s.begin():
        q.offer(s, "j", {"text": "j"}, at)
    with pytest.raises(RuntimeError), backend.Session() as s, s.begin():
        (env,) = q.consume(s)
        raise RuntimeError("rolled back")
    with backend.Session() as s, s.begin():
        assert q.record_failure(s, env, "j failed") is NackOutcome.DEAD
        assert q.get(s, "j").status == "dead"


@pytest.mark.parametrize("retention", [None, timedelta(days=1)])
def test_a_failure_after_a_rollback_is_recorded_for_a_message_whose_lease_ran_out(
    backend, make_queue, clock, retention
):
    """A consumer took the message and died; its lease ran out; a transactional consume took
    it again and rolled back. With retention that take counted the lost lease in the
    transaction the rollback undid, so the envelope's attempt no longer matched the row and the
    failure was reported STALE: no error, no backoff, due again at once."""
    q = make_queue(
        lease=timedelta(seconds=10),
        retention=retention,
        retry=ExponentialBackoff(max_attempts=5, initial=timedelta(seconds=30), jitter=0),
    )
    with backend.Session() as s, s.begin():
        q.offer(s, "k", 1)
    with backend.Session() as s, s.begin():
        assert q.try_poll(s) is not None  # taken by a consumer that dies
    clock.advance(timedelta(seconds=11))
    with pytest.raises(RuntimeError), backend.Session() as s, s.begin():
        (env,) = q.consume(s)
        raise RuntimeError("the handler failed: rolled back")
    # The redelivery carries the next attempt (the lost one counted), as a lease take's does.
    assert env.delivery is Delivery.REDELIVERY and env.attempt == 2
    with backend.Session() as s, s.begin():
        assert q.record_failure(s, env, "handler failed") is NackOutcome.RETRY_SCHEDULED
    with backend.Session() as s:
        info = q.get(s, "k")
        assert info.attempts == 2 and info.last_error == "handler failed"
        assert info.scheduled_at == clock() + timedelta(seconds=60)


@pytest.mark.parametrize("how", ["process_one", "consume", "consume-retention", "consume-limited"])
def test_a_transactional_failure_after_a_lost_lease_counts_both_attempts(
    backend, make_queue, clock, how
):
    """A consumer took the message and died; a transactional take counted the lost attempt
    (it buries a message whose lost lease was its last), but the failure its handler then
    recorded counted only its own: with two attempts allowed, the message was due a third
    time. Lease mode counts both, and so do entities."""
    q = make_queue(
        "lost-then-failed",
        lease=timedelta(seconds=10),
        retention=timedelta(days=1) if how == "consume-retention" else None,
        retry=ExponentialBackoff(max_attempts=2, initial=timedelta(seconds=30), jitter=0),
    )
    with backend.Session() as s, s.begin():
        q.offer(s, "k", 1)
        if how == "consume-limited":
            q.set_limits(s, max_in_flight=5)
    with backend.Session() as s, s.begin():
        assert q.try_poll(s) is not None  # taken by a consumer that dies
    clock.advance(timedelta(seconds=11))
    if how == "process_one":

        def fail(env: Any, session: Any) -> None:
            raise RuntimeError("the handler failed")

        with backend.Session() as s, s.begin():
            processed = q.process_one(s, fail)
        assert processed is not None
        env, outcome = processed[0], processed[2]
    else:
        with pytest.raises(RuntimeError), backend.Session() as s, s.begin():
            (env,) = q.consume(s)
            raise RuntimeError("the handler failed: rolled back")
        with backend.Session() as s, s.begin():
            outcome = q.record_failure(s, env, "the handler failed")
    assert (env.delivery, env.attempt) == (Delivery.REDELIVERY, 2)
    assert outcome is NackOutcome.DEAD
    with backend.Session() as s:
        info = q.get(s, "k")
        assert (info.status, info.attempts) == ("dead", 2)


def test_consume_buries_poison_and_goes_on(backend, make_queue, clock):
    q = make_queue()
    now = clock()
    with backend.Session() as s, s.begin():
        q.offer(s, "poison", {"x": 1}, now - timedelta(seconds=10))
        q.offer(s, "good", {"x": 2}, now - timedelta(seconds=5))
        s.execute(T.update().where(T.c.key == "poison").values(payload_type="other"))
    with backend.Session() as s, s.begin():
        assert [e.key for e in q.consume(s, 2)] == ["good"]
    with backend.Session() as s:
        info = q.get(s, "poison")
        assert info.status == "dead" and "DecodeError" in info.last_error


def test_consume_on_postgresql_is_one_statement(pg, make_queue):
    q = make_queue()
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(f"k{i}", i) for i in range(10)])
    with record_sql(pg.engine) as statements, pg.Session() as s, s.begin():
        assert len(q.consume(s, 4)) == 4
    assert len([x for x in statements if "delayed_queue" in x]) == 1


def test_payload_filters_compare_json_types_not_casts(backend, make_queue):
    q = make_queue()
    with backend.Session() as s, s.begin():
        q.offer_batch(
            s,
            [
                ("int", {"x": 5}),
                ("float", {"x": 5.0}),
                ("half", {"x": 1.5}),
                ("text", {"x": "5"}),
                ("word", {"x": "abc"}),
                ("true", {"x": True}),
                ("one", {"x": 1}),
                ("zero", {"x": 0}),
                ("missing", {"y": 5}),
                ("odd name", {"a.b c-d": 7}),
            ],
        )

        def keys(**payload):
            return sorted(m.key for m in q.search(s, MessageFilter(payload=payload)))

        assert keys(x=5) == ["float", "int"]
        assert keys(x="5") == ["text"]
        assert keys(x=True) == ["true"]
        assert keys(x=1) == ["one"]
        assert keys(x=0) == ["zero"]
        assert keys(x=1.5) == ["half"]
        assert keys(x="abc") == ["word"]
        assert keys(**{"a.b c-d": 7}) == ["odd name"]
        with pytest.raises(InvalidArgument, match="quote"):
            keys(**{'say "hi"': 1})
        assert q.drop_where(s, MessageFilter(payload={"x": "abc"})) == 1


def test_guards_on_admin_and_settle_input(backend, make_queue, clock):
    q = make_queue()
    with backend.Session() as s, s.begin():
        q.offer(s, "k", 1)
        with pytest.raises(InvalidArgument, match="at least one condition"):
            q.drop_where(s, MessageFilter())
        env = q.try_poll(s)
        with pytest.raises(InvalidArgument, match="naive"):
            from datetime import datetime

            q.nack(s, env, "x", at=datetime(2030, 1, 1))
        assert q.contains(s, "k")


class _Policy:
    """A retry policy of the user's own, with whatever values a test gives it."""

    def __init__(self, max_attempts: Any, delay: Any) -> None:
        self.max_attempts, self._delay = max_attempts, delay

    def delay(self, attempts: int) -> Any:
        return self._delay


@pytest.mark.parametrize("max_attempts", ["3", None, 2.5, 0, -1, True])
def test_a_policy_without_a_whole_number_of_attempts_is_refused_by_the_queue(
    make_queue, max_attempts
):
    """Accepted before, it stopped the worker at the first failure ("3", None: TypeError), or
    buried the message at once (0, -1)."""
    with pytest.raises(InvalidArgument, match="max_attempts"):
        make_queue(retry=_Policy(max_attempts, timedelta(seconds=1)))
    with pytest.raises(InvalidArgument, match="retry must have"):
        make_queue(retry=object())


@pytest.mark.parametrize("delay", [None, 1.5, datetime(2030, 1, 1), float("nan")])
def test_a_policy_delay_that_is_no_timedelta_is_a_clear_error(backend, make_queue, delay):
    q = make_queue(retry=_Policy(3, delay))
    with backend.Session() as s, s.begin():
        q.offer(s, "k", 1)
        env = q.try_poll(s)
        with pytest.raises(InvalidArgument, match=r"_Policy.delay\(1\) returned .* timedelta"):
            q.nack(s, env, "x")


def test_expired_leases_count_as_attempts_until_dead(backend, make_queue, clock):
    q = make_queue(lease=timedelta(seconds=10), retry=ExponentialBackoff(max_attempts=3))
    with backend.Session() as s, s.begin():
        q.offer(s, "crasher", {"n": 1})
    attempts = []
    for _ in range(5):
        with backend.Session() as s, s.begin():
            env = q.try_poll(s)  # taken, then the consumer "crashes": no ack, no nack
            if env is None:
                break
            attempts.append(env.attempt)
        clock.advance(11)
    assert attempts == [1, 2, 3]
    with backend.Session() as s:
        info = q.get(s, "crasher")
        assert info.status == "dead" and "lease ran out" in info.last_error
        assert info.attempts == 3


def test_consume_refills_past_poison(backend, make_queue, clock):
    q = make_queue()
    now = clock()
    with backend.Session() as s, s.begin():
        q.offer(s, "poison", {"x": 1}, now - timedelta(seconds=10))
        q.offer(s, "good", {"x": 2}, now - timedelta(seconds=5))
        s.execute(T.update().where(T.c.key == "poison").values(payload_type="other"))
    with backend.Session() as s, s.begin():
        assert [e.key for e in q.consume(s, 1)] == ["good"]


def test_drop_where_with_only_an_sql_condition(backend, make_queue):
    q = make_queue()
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [("a", 1), ("b", 2)])
        assert q.drop_where(s, MessageFilter(where=T.c.key == "a")) == 1
        assert [m.key for m in q.search(s)] == ["b"]


def test_offer_batch_of_bytes_and_exact_times(backend, make_queue, clock):
    from datetime import datetime

    from sqla_delayedq import BytesSerializer

    q = make_queue(serializer=BytesSerializer())
    at = datetime(2031, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    with backend.Session() as s, s.begin():
        results = q.offer_batch(s, [("a", b"\x00\x01raw", at), ("b", b"", at)])
        assert [r.outcome for r in results] == [Outcome.CREATED, Outcome.CREATED]
    with backend.Session() as s:
        a, b = q.get(s, "a"), q.get(s, "b")
        assert (a.payload, b.payload) == (b"\x00\x01raw", b"")
        assert a.scheduled_at == at and a.scheduled_at_initially == at


class _UpperJson:
    """A serializer of our own with JSON storage: not a JsonSerializer subclass."""

    type_name = "upper"
    storage = "json"

    def encode(self, payload: str) -> object:
        return {"text": payload.upper(), "pair": (1, 2)}

    def decode(self, stored: object) -> str:
        assert isinstance(stored, dict)
        return str(stored["text"]).lower()


def test_offer_batch_writes_payloads_as_serialized_and_reoffers_are_ignored(
    backend, make_queue, clock
):
    """The batch splices serialized payloads into its insert; a later identical offer agrees."""
    q = make_queue()
    payloads = {
        "plain": {"n": 1},
        "tuple": {"pair": (1, 2), "nested": [{"x": None}]},
        "unicode": {"s": 'quote " backslash \\ \u00e9\u4e2d\U0001f600 \n tab\t'},
        "int-keys": {1: "one"},
        "scalar": 7,
        "list": [1, 2.5, True],
    }
    with backend.Session() as s, s.begin():
        results = q.offer_batch(s, list(payloads.items()))
        assert [r.outcome for r in results] == [Outcome.CREATED] * len(payloads)
    with backend.Session() as s, s.begin():
        for key, payload in payloads.items():
            assert q.offer(s, key, payload).outcome is Outcome.IGNORED, key
        again = q.offer_batch(s, list(payloads.items()))
        assert [r.outcome for r in again] == [Outcome.IGNORED] * len(payloads)
        got = {key: q.get(s, key).payload for key in payloads}
    assert got["tuple"] == {"pair": [1, 2], "nested": [{"x": None}]}
    assert got["unicode"] == payloads["unicode"]
    assert got["int-keys"] == {"1": "one"}
    assert (got["scalar"], got["list"]) == (7, [1, 2.5, True])

    custom = make_queue("custom", serializer=_UpperJson())
    with backend.Session() as s, s.begin():
        assert [r.outcome for r in custom.offer_batch(s, [("c", "hi")])] == [Outcome.CREATED]
    with backend.Session() as s, s.begin():
        assert custom.offer(s, "c", "hi").outcome is Outcome.IGNORED
        assert custom.get(s, "c").payload == "hi"
        assert [m.key for m in custom.search(s, MessageFilter(payload={"text": "HI"}))] == ["c"]


class _WrappedJson(JsonSerializer[Any]):
    """A JsonSerializer subclass that changes what is stored: its ``encode`` must be used."""

    def encode(self, payload: Any) -> Any:
        return {"wrapped": payload}

    def decode(self, stored: Any) -> Any:
        return stored["wrapped"]


def test_a_json_serializer_subclass_s_encode_is_what_every_offer_stores(backend, make_queue):
    """Regression: the plain serializer's fast path skipped an overridden ``encode``, storing
    the bare payload, which the subclass's ``decode`` then could not read."""
    q = make_queue(serializer=_WrappedJson("wrapped"))
    with backend.Session() as s, s.begin():
        q.offer(s, "one", 1)
        q.offer_batch(s, [("two", 2), ("three", [3])])
    with backend.engine.connect() as conn:
        stored = dict(conn.execute(sa.select(T.c.key, T.c.payload)).all())
    assert stored == {"one": {"wrapped": 1}, "two": {"wrapped": 2}, "three": {"wrapped": [3]}}
    with backend.Session() as s, s.begin():
        assert {e.key: e.payload for e in q.try_poll_many(s, 10)} == {
            "one": 1,
            "two": 2,
            "three": [3],
        }
        assert q.offer_batch(s, [("two", 2)])[0].outcome is Outcome.IGNORED


# -- an update of a message in flight waits for the old delivery ---------------------------------


@pytest.mark.parametrize("via", ["offer", "offer_batch"])
@pytest.mark.parametrize("mode", [OfferMode.REPLACE, OfferMode.KEEP_SCHEDULE])
@pytest.mark.parametrize("end", ["ack", "nack", "release", "lease runs out", "extended"])
def test_an_update_of_a_message_in_flight_waits_for_the_old_delivery(
    backend, make_queue, clock, via, mode, end
):
    """The new version is never taken beside the old version's handler: it is held in flight
    until the old delivery ends. The old consumer's ack, failure or release ends the hold (none
    of them settles the new version), its heartbeat lengthens it, its death ends it with its
    lease; the new version is then a first delivery with a fresh count of attempts."""
    q = make_queue(lease=timedelta(seconds=30))
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 1})
        q.offer(s, "other", {"v": 1}, clock() + timedelta(hours=2))
    with backend.Session() as s, s.begin():
        old = q.try_poll(s)
    assert old is not None and old.key == "k"
    clock.advance(timedelta(seconds=1))
    with backend.Session() as s, s.begin():
        if via == "offer":
            outcome = q.offer(s, "k", {"v": 2}, mode=mode).outcome
        else:
            [result] = q.offer_batch(s, [("k", {"v": 2})], mode=mode)
            outcome = result.outcome
        assert outcome is Outcome.UPDATED
    with backend.Session() as s, s.begin():
        assert q.get(s, "k").state is State.IN_FLIGHT
        assert q.try_poll(s) is None  # held for the old delivery
        assert q.count(s, MessageFilter(state="in_flight")) == 1
    if end == "extended":  # the old consumer's heartbeat keeps it held past the first lease
        with backend.Session() as s, s.begin():
            assert q.extend(s, old, timedelta(seconds=60)) is not None
        clock.advance(timedelta(seconds=40))
        with backend.Session() as s, s.begin():
            assert q.try_poll(s) is None
    with backend.Session() as s, s.begin():
        if end in ("ack", "extended"):
            assert q.ack(s, old) is False  # does not delete the new version
        elif end == "nack":
            assert q.nack(s, old, "old failed") is NackOutcome.STALE  # not recorded on it
        elif end == "release":
            assert q.release(s, old) is False
    if end == "lease runs out":
        with backend.Session() as s, s.begin():
            assert q.try_poll(s) is None
        clock.advance(timedelta(seconds=30))  # the old consumer died: its lease ends
    with backend.Session() as s, s.begin():
        new = q.try_poll(s)
    assert new is not None and new.payload == {"v": 2}
    assert new.delivery is Delivery.FIRST and new.attempt == 1
    with backend.Session() as s, s.begin():
        info = q.get(s, "k")
        assert info.attempts == 0 and info.last_error is None
        assert q.ack(s, new)


def test_holding_tells_whether_a_take_committed(backend, make_queue, clock):
    """What a consumer reads after a take whose commit failed where it may have happened: the
    envelopes whose rows carry their tokens (also held for an update made since) if it
    committed; none if it rolled back or they were settled since."""
    q = make_queue(lease=timedelta(seconds=30))
    with backend.Session() as s, s.begin():
        q.offer(s, "a", {"v": 1})
        q.offer(s, "b", {"v": 1})
    with backend.Session() as s:
        lost = q.try_poll_many(s, 2)
        s.rollback()  # the take did not commit
        assert q.holding(s, lost) == []
    with backend.Session() as s, s.begin():
        taken = q.try_poll_many(s, 2)
    assert len(taken) == 2 and {e.lock_token for e in taken}.isdisjoint(e.lock_token for e in lost)
    with backend.Session() as s, s.begin():
        assert q.holding(s, lost) == []  # another take's tokens
        assert q.holding(s, taken) == taken
        q.offer(s, "a", {"v": 2})  # held for this delivery: still its to settle
    with backend.Session() as s, s.begin():
        assert q.holding(s, taken) == taken
        assert q.ack(s, taken[1])
        assert q.holding(s, taken) == taken[:1]


@pytest.mark.parametrize("end", ["ack", "lease runs out"])
def test_an_update_in_flight_keeps_its_own_later_time(backend, make_queue, clock, end):
    """A replacement due later than the old lease ends is due at its own time once the hold
    ends; one due before that waits for the hold, then is due at once."""
    q = make_queue(lease=timedelta(seconds=30))
    with backend.Session() as s, s.begin():
        q.offer(s, "late", {"v": 1})
        q.offer(s, "soon", {"v": 1})
    with backend.Session() as s, s.begin():
        taken = {e.key: e for e in q.try_poll_many(s, 2)}
    t0 = clock()
    with backend.Session() as s, s.begin():
        q.offer(s, "late", {"v": 2}, t0 + timedelta(minutes=10))
        q.offer(s, "soon", {"v": 2}, t0 + timedelta(seconds=5))
    if end == "ack":
        clock.advance(timedelta(seconds=10))
        with backend.Session() as s, s.begin():
            assert not q.ack(s, taken["late"]) and not q.ack(s, taken["soon"])
            assert q.get(s, "soon").scheduled_at == t0 + timedelta(seconds=10)  # at once
            assert q.get(s, "late").scheduled_at == t0 + timedelta(minutes=10)
    else:  # the old consumer died: both held to the end of its lease
        with backend.Session() as s, s.begin():
            for key in ("soon", "late"):
                info = q.get(s, key)
                assert info.state is State.IN_FLIGHT
                assert info.scheduled_at == t0 + timedelta(seconds=30)
        clock.advance(timedelta(seconds=30))
    with backend.Session() as s, s.begin():
        [soon] = q.try_poll_many(s, 5)  # "late" is not delivered before its own time...
        assert soon.key == "soon" and q.ack(s, soon)
        late_info = q.get(s, "late")  # ... but given back to it, a plain scheduled message
        assert late_info.state is State.SCHEDULED and late_info.lock_token is None
        assert late_info.scheduled_at == t0 + timedelta(minutes=10)
    clock.set(t0 + timedelta(minutes=10))
    with backend.Session() as s, s.begin():
        [late] = q.try_poll_many(s, 5)
        assert late.key == "late" and late.delivery is Delivery.FIRST


@pytest.mark.parametrize("way", ["try_poll_many", "consume"])
def test_a_hold_whose_consumer_died_ends_with_its_lease_for_the_group_and_the_limit(
    backend, make_queue, clock, way
):
    """Updated in flight to a time an hour away, and its old consumer dies: the message counted
    as in flight (its group blocked, its slot of the in-flight limit used) for the whole hour.
    The hold ends with the old lease; the new version still waits for its own time."""
    groups = make_queue(name="held-group", groups=True, lease=timedelta(seconds=30))
    limited = make_queue(name="held-limited", lease=timedelta(seconds=30))
    t0 = clock()
    with backend.Session() as s, s.begin():
        limited.set_limits(s, max_in_flight=1)
        groups.offer(s, "a1", {"v": 1}, t0 - timedelta(seconds=2), group="A")
        groups.offer(s, "a2", {"v": 1}, t0 - timedelta(seconds=1), group="A")
        limited.offer(s, "m1", {"v": 1}, t0 - timedelta(seconds=2))
        limited.offer(s, "m2", {"v": 1}, t0 - timedelta(seconds=1))
    with backend.Session() as s, s.begin():
        assert [e.key for e in groups.try_poll_many(s, 5)] == ["a1"]
        assert [e.key for e in limited.try_poll_many(s, 5)] == ["m1"]
    with backend.Session() as s, s.begin():
        groups.offer(s, "a1", {"v": 2}, t0 + timedelta(hours=1))
        limited.offer(s, "m1", {"v": 2}, t0 + timedelta(hours=1))
    clock.advance(timedelta(seconds=31))  # the old consumer never settled: its lease ended

    def take(s: Any, q: Any) -> list[str]:
        envs = q.consume(s, 5) if way == "consume" else q.try_poll_many(s, 5)
        if way != "consume":
            q.ack_many(s, envs)
        return [e.key for e in envs]

    for q, key in ((groups, "a2"), (limited, "m2")):  # each in a transaction of its own
        with backend.Session() as s, s.begin():
            assert take(s, q) == [key]
        with backend.Session() as s, s.begin():  # not before their own time: given back to it
            assert take(s, q) == []
    with backend.Session() as s, s.begin():
        for q, key in ((groups, "a1"), (limited, "m1")):
            info = q.get(s, key)
            assert info.state is State.SCHEDULED and info.scheduled_at == t0 + timedelta(hours=1)
    clock.set(t0 + timedelta(hours=1))
    with backend.Session() as s, s.begin():
        [a1] = groups.try_poll_many(s, 5)
        assert a1.key == "a1" and a1.payload == {"v": 2} and a1.delivery is Delivery.FIRST


def test_keep_schedule_on_a_held_message_keeps_the_held_version_s_time(backend, make_queue, clock):
    """REPLACE at +10 min while in flight, then KEEP_SCHEDULE with a new payload: the message
    keeps +10 min, as it would had it never been in flight (it ran at once instead)."""
    q = make_queue(lease=timedelta(seconds=30))
    t0 = clock()
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 1})
    with backend.Session() as s, s.begin():
        old = q.try_poll(s)
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 2}, t0 + timedelta(minutes=10))
        q.offer(s, "k", {"v": 3}, mode=OfferMode.KEEP_SCHEDULE)
    with backend.Session() as s, s.begin():
        assert not q.ack(s, old)  # ends the hold
        assert q.get(s, "k").scheduled_at == t0 + timedelta(minutes=10)
        assert q.try_poll(s) is None


def test_a_hold_for_a_time_before_the_epoch_still_holds(backend, make_queue, clock):
    """An update asking for a time before 1970 ("as early as possible"): the hold must still
    follow the old delivery (its heartbeat lengthens it, its ack ends it), and updating it again
    must not outgrow the lock token column."""
    q = make_queue(lease=timedelta(seconds=30))
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 1})
    with backend.Session() as s, s.begin():
        old = q.try_poll(s)
    early = datetime(1900, 1, 1, tzinfo=UTC)
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 2}, early)
        q.offer(s, "k", {"v": 3}, early + timedelta(days=1))
    with backend.Session() as s, s.begin():
        assert q.extend(s, old, timedelta(seconds=60)) is not None
    clock.advance(timedelta(seconds=40))
    with backend.Session() as s, s.begin():
        assert q.try_poll(s) is None  # still held for the old delivery
        assert not q.ack(s, old)
    with backend.Session() as s, s.begin():
        new = q.try_poll(s)
        assert new is not None and new.payload == {"v": 3}


def test_record_failure_ends_a_hold_on_a_limited_consume(backend, make_queue, clock):
    """A limited queue's consume leases apart; the caller rolls back, an offer updates the
    message meanwhile (held for that delivery); record_failure then finds no row of its own and
    says STALE, but it must end the hold, not leave the new version waiting out the lease."""
    q = make_queue(lease=timedelta(minutes=5))
    with backend.Session() as s, s.begin():
        q.set_limits(s, max_in_flight=5)
        q.offer(s, "k", {"v": 1})
    with pytest.raises(RuntimeError), backend.Session() as s, s.begin():
        (env,) = q.consume(s)
        raise RuntimeError("the handler failed: rolled back")
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"v": 2})
    with backend.Session() as s, s.begin():
        assert q.record_failure(s, env, "boom") is NackOutcome.STALE
    with backend.Session() as s, s.begin():
        [new] = q.try_poll_many(s, 5)
        assert new.payload == {"v": 2} and new.delivery is Delivery.FIRST


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "fails"])
def test_a_drop_that_waited_for_a_handler_under_retention_deletes_the_row_it_left(
    server_backend, make_queue, clock, fails
):
    """Under retention a transactional handler leaves its message done (or dead, its last
    attempt failed). On MariaDB a ``drop`` that waited for that handler read through the due
    index, past the entry the row had moved to: it returned False and the row stayed (found in
    review)."""
    import threading
    import time

    backend = server_backend
    q = make_queue(retention=timedelta(hours=1), retry=ExponentialBackoff(max_attempts=1))
    with backend.Session.begin() as s:
        q.offer(s, "k", {"x": 1})
    clock.advance(timedelta(seconds=1))
    running, dropped = threading.Event(), []

    def admin() -> None:
        running.wait(10)
        with backend.Session.begin() as other:
            dropped.append(q.drop(other, "k"))

    thread = threading.Thread(target=admin)
    thread.start()

    def handler(envelope: Any, session: Any) -> None:
        running.set()
        time.sleep(0.5)  # the drop waits for this transaction meanwhile
        if fails:
            raise RuntimeError("boom")

    with backend.Session.begin() as s:
        q.process_one(s, handler)
    thread.join(30)
    assert dropped == [True]
    with backend.Session() as s:
        assert q.get(s, "k") is None
