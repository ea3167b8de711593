"""Headers travel with a message, and a trace follows it from the offer to every attempt.

Headers: stored by single and batch offers, read back in envelopes (lease and transactional
takes, both workers) and on the read side; not part of a message's identity; replaced by an
update; refused before any SQL when malformed. Traces: an instrumented offer stores its trace
context in the headers and a traced handler continues it, in this process or another one, with
every retry in the same trace (checked with the OpenTelemetry SDK's in-memory exporter).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import Table, update

from sqla_delayedq import DelayedQueue, ExponentialBackoff, InvalidArgument, Outcome
from sqla_delayedq.metrics import instrument_queue, traced_handler
from sqla_delayedq.models import DelayedMessage
from tests.fix_db import Backend
from tests.fix_workers import running

REPO = Path(__file__).resolve().parents[1]
NO_WAIT = ExponentialBackoff(max_attempts=3, initial=timedelta(0), jitter=0)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# -- headers -----------------------------------------------------------------------------------


def test_headers_travel_with_single_and_batch_offers(backend: Backend) -> None:
    q: DelayedQueue[Any] = DelayedQueue("mail")
    with backend.Session() as s, s.begin():
        q.offer(s, "one", {"n": 1}, headers={"traceparent": "t-1", "request-id": "r\u00e9q"})
        q.offer_batch(s, [("two", {"n": 2}), ("three", {"n": 3})], headers={"h": "b"})
        q.offer(s, "none", {"n": 4})
    with backend.Session() as s, s.begin():
        taken = {e.key: dict(e.headers) for e in q.try_poll_many(s, 10)}
    assert taken == {
        "one": {"traceparent": "t-1", "request-id": "r\u00e9q"},
        "two": {"h": "b"},
        "three": {"h": "b"},
        "none": {},
    }
    with backend.Session() as s:
        info = q.get(s, "one")
        assert info is not None and info.headers["request-id"] == "r\u00e9q"


def test_headers_are_not_identity_and_an_update_stores_the_updating_offers(
    backend: Backend,
) -> None:
    q: DelayedQueue[Any] = DelayedQueue("mail")
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"n": 1}, headers={"traceparent": "first"})
    with backend.Session() as s, s.begin():
        assert (
            q.offer(s, "k", {"n": 1}, headers={"traceparent": "again"}).outcome is Outcome.IGNORED
        )
        (batch,) = q.offer_batch(s, [("k", {"n": 1})], headers={"traceparent": "batch"})
        assert batch.outcome is Outcome.IGNORED
    with backend.Session() as s:
        info = q.get(s, "k")
        assert info is not None and dict(info.headers) == {"traceparent": "first"}
    with backend.Session() as s, s.begin():
        assert q.offer(s, "k", {"n": 2}, headers={"traceparent": "second"}).outcome is (
            Outcome.UPDATED
        )
        q.offer_batch(s, [("k", {"n": 3}), ("k", {"n": 4})], headers={"traceparent": "third"})
    with backend.Session() as s:
        info = q.get(s, "k")
        assert info is not None and dict(info.headers) == {"traceparent": "third"}
    with backend.Session() as s, s.begin():
        assert q.offer(s, "k", {"n": 5}).outcome is Outcome.UPDATED
    with backend.Session() as s:
        info = q.get(s, "k")
        assert info is not None and dict(info.headers) == {}


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"n": 1}, "must map str to str"),
        ({1: "x"}, "must map str to str"),
        (["traceparent"], "must be a mapping"),
        ({"a": "nul\x00"}, "NUL"),
        ({"a": "x" * 9000}, "the limit is 8000"),
    ],
)
def test_bad_headers_are_refused_and_nothing_is_written(
    backend: Backend, headers: Any, message: str
) -> None:
    q: DelayedQueue[Any] = DelayedQueue("mail")
    with backend.Session() as s, s.begin():
        q.offer(s, "kept", {"n": 1})
        with pytest.raises(InvalidArgument, match=message):
            q.offer(s, "k", {"n": 1}, headers=headers)
        with pytest.raises(InvalidArgument, match=message):
            q.offer_batch(s, [("k2", {"n": 1})], headers=headers)
    with backend.Session() as s:
        assert q.contains(s, "kept") and not q.contains(s, "k") and not q.contains(s, "k2")


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ([("request-id", "r1")], "must be a mapping"),
        ("ab", "must be a mapping"),
        (5, "must be a mapping"),
        ({"n": 1}, "must map str to str"),
    ],
    ids=["pairs", "str", "int", "not-str"],
)
def test_an_instrumented_queue_refuses_the_headers_a_plain_one_refuses(
    backend: Backend, spans: tuple[TracerProvider, InMemorySpanExporter], headers: Any, message: str
) -> None:
    """The instrumented offer copied ``headers`` with ``dict()`` before the queue saw them: a
    list of pairs was stored, a string raised a bare ValueError, an int a TypeError."""
    provider, _ = spans
    q = instrument_queue(DelayedQueue[Any]("mail"), tracer=provider.get_tracer("test"))
    with backend.Session() as s, s.begin():
        with pytest.raises(InvalidArgument, match=message):
            q.offer(s, "k", {"n": 1}, headers=headers)
        with pytest.raises(InvalidArgument, match=message):
            q.offer_batch(s, [("k2", {"n": 1})], headers=headers)
    with backend.Session() as s:
        assert not q.contains(s, "k") and not q.contains(s, "k2")


def test_corrupt_stored_headers_read_as_none_and_deliver(backend: Backend) -> None:
    q: DelayedQueue[Any] = DelayedQueue("mail")
    with backend.Session() as s, s.begin():
        q.offer(s, "a", {"n": 1})
        q.offer(s, "b", {"n": 2})
        t = cast(Table, DelayedMessage.__table__)
        s.execute(update(t).where(t.c.key == "a").values(headers="{not json"))
        s.execute(update(t).where(t.c.key == "b").values(headers='["a list"]'))
    with backend.Session() as s, s.begin():
        taken = q.try_poll_many(s, 10)
        assert sorted((e.key, dict(e.headers)) for e in taken) == [("a", {}), ("b", {})]


def test_a_transactional_failure_keeps_the_headers_for_the_retry(backend: Backend) -> None:
    q: DelayedQueue[Any] = DelayedQueue("mail", retry=NO_WAIT)
    with backend.Session() as s, s.begin():
        q.offer(s, "k", {"n": 1}, headers={"traceparent": "t"})

    def fails(envelope: Any, session: Any) -> None:
        raise RuntimeError("boom")

    with backend.Session() as s, s.begin():
        done = q.process_one(s, fails)
        assert done is not None and done[1] is not None
    seen: list[dict[str, str]] = []
    with backend.Session() as s, s.begin():
        q.process_one(s, lambda envelope, session: seen.append(dict(envelope.headers)))
    assert seen == [{"traceparent": "t"}]


# -- traces ------------------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def processed(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    found = [s for s in exporter.get_finished_spans() if s.name == "process mail"]
    return sorted(found, key=lambda s: int(cast(Any, s.attributes)["delayedq.attempt"]))


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_one_trace_from_the_request_to_every_attempt(
    backend: Backend,
    make_worker: Callable[..., Any],
    spans: tuple[TracerProvider, InMemorySpanExporter],
    mode: str,
) -> None:
    provider, exporter = spans
    tracer = provider.get_tracer("test")
    q: DelayedQueue[Any] = instrument_queue(DelayedQueue("mail", retry=NO_WAIT), tracer=tracer)
    request = tracer.start_span("POST /signup")
    with trace.use_span(request, end_on_exit=True), backend.Session() as s, s.begin():
        q.offer(s, "welcome/1", {"user": 1})
    attempts: list[int] = []

    def handle(envelope: Any, *session: Any) -> None:
        attempts.append(envelope.attempt)
        if envelope.attempt == 1:
            raise RuntimeError("smtp is down")

    worker = make_worker(backend, poll_interval=0.05, concurrency=2)
    worker.register(q, traced_handler(handle, tracer=tracer), mode=mode)
    with running(worker):
        wait_for(lambda: len(processed(exporter)) == 2)
    assert attempts == [1, 2]
    (send,) = [s for s in exporter.get_finished_spans() if s.name == "send mail"]
    first, second = processed(exporter)
    trace_id = request.get_span_context().trace_id
    assert send.context is not None and send.context.trace_id == trace_id
    assert send.kind is SpanKind.PRODUCER
    for attempt, span in ((1, first), (2, second)):
        assert span.context is not None and span.context.trace_id == trace_id
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is not None and span.parent.span_id == send.context.span_id
        assert [link.context.span_id for link in span.links] == [send.context.span_id]
        assert span.attributes is not None and span.attributes["delayedq.attempt"] == attempt
    assert first.status.status_code is StatusCode.ERROR
    assert second.status.status_code is not StatusCode.ERROR


def test_a_traced_batch_handler_gets_one_span_linked_to_each_messages_trace(
    backend: Backend,
    make_worker: Callable[..., Any],
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    """``traced_handler`` around a batch handler was accepted, then failed every message
    (``'list' object has no attribute 'queue'``) until it was dead. A batch is one span whose
    links point at the send span of each of its messages."""
    provider, exporter = spans
    tracer = provider.get_tracer("test")
    q: DelayedQueue[Any] = instrument_queue(DelayedQueue("mail", retry=NO_WAIT), tracer=tracer)
    for n in (1, 2):
        with tracer.start_as_current_span(f"POST /{n}"), backend.Session() as s, s.begin():
            q.offer(s, f"m{n}", {"n": n})
    handled: list[str] = []
    worker = make_worker(backend, poll_interval=0.05)
    worker.register_batch(
        q, traced_handler(lambda envs: handled.extend(e.key for e in envs), tracer=tracer)
    )
    with running(worker):
        wait_for(lambda: sorted(handled) == ["m1", "m2"])
    assert sorted(handled) == ["m1", "m2"]
    sends = {s.context.span_id for s in exporter.get_finished_spans() if s.name == "send mail"}
    batches = [s for s in exporter.get_finished_spans() if s.name == "process mail"]
    assert len(sends) == 2 and batches
    assert {link.context.span_id for b in batches for link in b.links} == sends
    for batch in batches:
        assert batch.kind is SpanKind.CONSUMER
        assert batch.status.status_code is not StatusCode.ERROR
        assert batch.attributes is not None
        assert batch.attributes["messaging.batch.message_count"] == len(batch.links)


def test_a_message_offered_without_a_trace_starts_its_own(
    backend: Backend, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    tracer = provider.get_tracer("test")
    q: DelayedQueue[Any] = DelayedQueue("mail")
    with backend.Session() as s, s.begin():
        q.offer(s, "plain", {"n": 1})
    with backend.Session() as s, s.begin():
        envelope = q.try_poll(s)
    assert envelope is not None
    traced_handler(lambda e: None, tracer=tracer)(envelope)
    (span,) = processed(exporter)
    assert span.parent is None and list(span.links) == []


PRODUCER = textwrap.dedent(
    """
    import sys
    from opentelemetry.sdk.trace import TracerProvider
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker
    from sqla_delayedq import DelayedQueue
    from sqla_delayedq.metrics import instrument_queue

    tracer = TracerProvider().get_tracer("web")
    Session = sessionmaker(create_engine(sys.argv[1]))
    queue = instrument_queue(DelayedQueue("mail"), tracer=tracer)
    with tracer.start_as_current_span("POST /orders") as request:
        with Session() as s, s.begin():
            queue.offer(s, "receipt/7", {"order": 7})
            queue.offer_batch(s, [("receipt/8", {"order": 8})])
    context = request.get_span_context()
    print(format(context.trace_id, "032x"))
    """
)


def test_the_trace_crosses_from_a_producer_process_to_the_worker(
    backend: Backend,
    make_worker: Callable[..., Any],
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    url = backend.url.render_as_string(hide_password=False)
    out = subprocess.run(
        [sys.executable, "-c", PRODUCER, url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    trace_id = int(out.stdout.strip(), 16)
    worker = make_worker(backend, poll_interval=0.05)
    q: DelayedQueue[Any] = DelayedQueue("mail")
    worker.register(q, traced_handler(lambda e: None, tracer=provider.get_tracer("worker")))
    with running(worker):
        wait_for(lambda: len(processed(exporter)) == 2)
    for span in processed(exporter):
        assert span.context is not None and span.context.trace_id == trace_id
        assert span.parent is not None and span.parent.is_remote
    assert trace.INVALID_SPAN_ID not in {s.parent.span_id for s in processed(exporter) if s.parent}


def test_an_asyncio_producer_continues_its_requests_trace(
    backend: Backend, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """An ``AsyncQueue`` over an instrumented queue (a FastAPI endpoint, say): the send span is a
    child of the request's, and the message carries the send span's context."""
    import asyncio

    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_delayedq.aio import AsyncQueue, create_async_engine
    from tests.fix_db import ASYNC_DRIVERS

    provider, exporter = spans
    tracer = provider.get_tracer("test")
    queue = AsyncQueue(instrument_queue(DelayedQueue[Any]("mail"), tracer=tracer))
    url = backend.url.set(drivername=ASYNC_DRIVERS[backend.name.split("-")[0]])

    async def request() -> int:
        engine = create_async_engine(url, poolclass=sa.NullPool)
        try:
            with tracer.start_as_current_span("POST /signup") as span:
                async with async_sessionmaker(engine)() as s, s.begin():
                    await queue.offer(s, "welcome/1", {"user": 1})
                    await queue.offer_batch(s, [("welcome/2", {"user": 2})])
            return span.get_span_context().trace_id
        finally:
            await engine.dispose()

    trace_id = asyncio.run(request())
    sends = [s for s in exporter.get_finished_spans() if s.name == "send mail"]
    assert len(sends) == 2
    with backend.Session() as s, s.begin():
        taken = {
            e.key: e.headers["traceparent"] for e in DelayedQueue[Any]("mail").try_poll_many(s, 5)
        }
    for send, key in zip(sends, ("welcome/1", "welcome/2"), strict=True):
        assert send.context is not None and send.context.trace_id == trace_id
        assert send.parent is not None
        assert taken[key].split("-")[1:3] == [
            format(trace_id, "032x"),
            format(send.context.span_id, "016x"),
        ]
