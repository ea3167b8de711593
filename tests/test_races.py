"""Races run for real on PostgreSQL and MariaDB: many threads, one database, counted deliveries."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, cast

import pytest
import sqlalchemy as sa

from sqla_delayedq import DelayedMessage, DelayedQueue, MessageFilter, Outcome, is_transient

T = cast(sa.Table, DelayedMessage.__table__)


def in_transaction(backend, fn, attempts: int = 20) -> Any:
    """Run ``fn(session)`` in a transaction, retrying transient errors as a user would."""
    for attempt in range(attempts):
        try:
            with backend.Session() as s, s.begin():
                return fn(s)
        except Exception as exc:
            if not is_transient(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


def test_ten_threads_offer_one_new_key_exactly_one_created(server_backend):
    q = DelayedQueue("race")
    barrier = threading.Barrier(10)

    def offer(i: int) -> Outcome:
        with server_backend.Session() as s, s.begin():
            barrier.wait()
            return q.offer(s, "the-key", {"same": True}).outcome

    with ThreadPoolExecutor(10) as pool:
        outcomes = list(pool.map(offer, range(10)))
    assert outcomes.count(Outcome.CREATED) == 1
    assert outcomes.count(Outcome.IGNORED) == 9
    with server_backend.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(T)).scalar_one() == 1


def test_ten_threads_offer_different_payloads_exactly_one_created(server_backend):
    q = DelayedQueue("race")
    barrier = threading.Barrier(10)

    def offer(i: int) -> Outcome:
        def attempt(s):
            return q.offer(s, "the-key", {"writer": i}).outcome

        barrier.wait()
        return in_transaction(server_backend, attempt)

    with ThreadPoolExecutor(10) as pool:
        outcomes = list(pool.map(offer, range(10)))
    assert outcomes.count(Outcome.CREATED) == 1
    assert outcomes.count(Outcome.UPDATED) + outcomes.count(Outcome.IGNORED) == 9
    with server_backend.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(T)).scalar_one() == 1


def test_eight_consumers_drain_2000_messages_each_exactly_once(server_backend):
    q = DelayedQueue("drain", lease=timedelta(minutes=5))
    total = 2000
    with server_backend.Session() as s, s.begin():
        results = q.offer_batch(s, [(f"m{i:05d}", {"i": i}) for i in range(total)])
    assert all(r.outcome is Outcome.CREATED for r in results)

    delivered: list[str] = []  # a list, not a set: duplicates must show
    lock = threading.Lock()

    def consume() -> None:
        idle = 0
        while idle < 3:

            def take_and_ack(s):
                env = q.try_poll(s)
                if env is not None:
                    assert q.ack(s, env)
                return env

            env = in_transaction(server_backend, take_and_ack)
            if env is None:
                idle += 1
                continue
            idle = 0
            with lock:
                delivered.append(env.key)

    with ThreadPoolExecutor(8) as pool:
        for f in [pool.submit(consume) for _ in range(8)]:
            f.result()
    duplicates = [k for k, n in Counter(delivered).items() if n > 1]
    assert duplicates == []
    assert len(delivered) == total
    with server_backend.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(T)).scalar_one() == 0


def test_lease_mode_consumers_never_share_a_message(server_backend):
    """Take and commit, process outside the transaction, ack in a new one (at-least-once)."""
    q = DelayedQueue("lease", lease=timedelta(minutes=5))
    total = 600
    with server_backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"m{i:04d}", i) for i in range(total)])
    delivered: list[int] = []
    lock = threading.Lock()

    def consume() -> None:
        while True:
            envs = in_transaction(server_backend, lambda s: q.try_poll_many(s, 7))
            if not envs:
                return
            with lock:
                delivered.extend(e.payload for e in envs)
            acked = in_transaction(server_backend, lambda s, envs=envs: q.ack_many(s, envs))
            assert acked == len(envs)

    with ThreadPoolExecutor(6) as pool:
        for f in [pool.submit(consume) for _ in range(6)]:
            f.result()
    assert sorted(delivered) == list(range(total))


def test_offer_batch_races_single_offers_on_overlapping_keys(server_backend):
    """5,000-message batch (100 repeats, 500 existing) while 4 threads offer overlapping keys."""
    q = DelayedQueue("batch-race")
    with server_backend.Session() as s, s.begin():
        q.offer_batch(s, [(f"k{i:05d}", {"i": i, "v": "old"}) for i in range(500)])
    batch = [(f"k{i:05d}", {"i": i, "v": "batch"}) for i in range(4900)]
    batch += [(f"k{i:05d}", {"i": i, "v": "batch-again"}) for i in range(2000, 2100)]
    single_keys = [f"k{i:05d}" for i in range(0, 6000, 7)]  # old, batch-new and unseen keys
    created: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(5)

    def run_batch() -> None:
        start.wait()
        results = in_transaction(server_backend, lambda s: q.offer_batch(s, batch))
        assert [r.key for r in results] == [k for k, _ in batch]
        with lock:
            created.extend(r.key for r in results if r.outcome is Outcome.CREATED)

    def run_singles(worker: int) -> None:
        start.wait()
        for key in single_keys[worker::4]:
            result = in_transaction(
                server_backend, lambda s, key=key: q.offer(s, key, {"v": f"single-{worker}"})
            )
            if result.outcome is Outcome.CREATED:
                with lock:
                    created.append(key)

    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(run_batch)] + [pool.submit(run_singles, w) for w in range(4)]
        for f in futures:
            f.result()

    expected_keys = {k for k, _ in batch} | set(single_keys)
    new_keys = expected_keys - {f"k{i:05d}" for i in range(500)}
    assert sorted(created) == sorted(new_keys)  # every new key created exactly once
    with server_backend.engine.connect() as conn:
        stored = conn.execute(
            sa.select(T.c.key, T.c.payload).where(T.c.queue == "batch-race")
        ).all()
    assert len(stored) == len(expected_keys)
    assert {k for k, _ in stored} == expected_keys
    for _key, payload in stored:
        assert payload["v"] in ("old", "batch", "batch-again") or payload["v"].startswith("single")


def test_racing_offers_of_one_new_key_never_deadlock(server_backend):
    """No retries here: ten writers of one new key, each with its own payload, five rounds.

    On MariaDB the offers used to share-lock the duplicate and then deadlock upgrading it;
    every caller must now get an outcome, exactly one of them CREATED per key.
    """
    q = DelayedQueue("race-nodeadlock")
    for round_ in range(5):
        key = f"key-{round_}"
        barrier = threading.Barrier(10)

        def offer(i: int, key: str = key, barrier: threading.Barrier = barrier) -> Outcome:
            with server_backend.Session() as s, s.begin():
                barrier.wait()
                return q.offer(s, key, {"writer": i}).outcome

        with ThreadPoolExecutor(10) as pool:
            outcomes = list(pool.map(offer, range(10)))  # raises if any offer raised
        assert outcomes.count(Outcome.CREATED) == 1
        assert outcomes.count(Outcome.UPDATED) == 9  # each writer changed the payload


def test_racing_batches_of_the_same_new_keys_never_deadlock(server_backend):
    """Four batches of the same 300 new keys at once, no retries, three rounds."""
    q = DelayedQueue("batch-nodeadlock")
    for round_ in range(3):
        keys = [f"r{round_}-{i:04d}" for i in range(300)]
        barrier = threading.Barrier(4)

        def offer_batch(
            writer: int, keys: list[str] = keys, barrier: threading.Barrier = barrier
        ) -> list[Outcome]:
            with server_backend.Session() as s, s.begin():
                barrier.wait()
                messages = [(k, {"w": writer}) for k in keys]
                return [r.outcome for r in q.offer_batch(s, messages)]

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(offer_batch, range(4)))
        for i in range(300):
            per_key = [outcomes[i] for outcomes in results]
            assert per_key.count(Outcome.CREATED) == 1, keys[i]


DROPS = {
    "drop": lambda q, s: int(q.drop(s, "k")),
    "drop_where": lambda q, s: q.drop_where(s, MessageFilter(keys=("k",))),
    "drop_all": lambda q, s: q.drop_all(s, confirm="tx-drop"),
}


@pytest.mark.parametrize("drop", DROPS.values(), ids=DROPS.keys())
def test_a_drop_waiting_for_a_failing_transactional_handler_deletes_its_message(
    server_backend, drop
):
    q = DelayedQueue("tx-drop")
    with server_backend.Session.begin() as s:
        q.offer(s, "k", {"v": 1})
    started, go = threading.Event(), threading.Event()

    def handler(envelope, session):
        started.set()
        go.wait(30)
        raise RuntimeError("the handler fails while the drop waits for it")

    def consume() -> None:
        with server_backend.Session.begin() as s:
            q.process_one(s, handler)

    def admin() -> int:
        with server_backend.Session.begin() as s:
            return drop(q, s)

    with ThreadPoolExecutor(2) as pool:
        consumer = pool.submit(consume)
        assert started.wait(30)
        dropped = pool.submit(admin)
        time.sleep(1)  # the drop waits for the handler's transaction
        go.set()
        consumer.result(30)
        assert dropped.result(30) == 1
    with server_backend.Session() as s:
        assert q.get(s, "k") is None  # not retried after the drop said it deleted it


def test_a_reschedule_waiting_for_a_failing_transactional_handler_moves_its_message(backend):
    """Every backend agrees (see docs/admin.md): a reschedule that waited for a transactional
    handler applies to the message as that transaction left it. The handler failed and put
    its message back for a retry: the reschedule moves that, and says so."""
    q = DelayedQueue("tx-reschedule")
    with backend.Session.begin() as s:
        q.offer(s, "k", {"v": 1})
    started, go = threading.Event(), threading.Event()

    def handler(envelope, session):
        started.set()
        go.wait(30)
        raise RuntimeError("the handler fails while the reschedule waits for it")

    def consume() -> None:
        with backend.Session.begin() as s:
            q.process_one(s, handler)

    def admin() -> int:
        with backend.Session.begin() as s:
            return q.reschedule(s, "k")

    with ThreadPoolExecutor(2) as pool:
        consumer = pool.submit(consume)
        assert started.wait(30)
        moved = pool.submit(admin)
        time.sleep(1)  # the reschedule waits for the handler's transaction
        go.set()
        consumer.result(30)
        assert moved.result(30) == 1
    with backend.Session() as s:
        info = q.get(s, "k")
        assert info is not None and info.attempts == 1 and info.last_error is not None
        assert "handler fails" in info.last_error
        assert info.scheduled_at is not None and info.last_attempt_at is not None
        assert info.scheduled_at <= info.last_attempt_at  # due when asked, not at its retry time
