"""Fuzzing a real subscription with generated records and user actions (DLQ-4, SUB-1, SUB-3).

Hypothesis draws a profile per example (``fuzz_workload.Profile``): one topic and one subscription
(ordered or not, with a dead-letter policy of 5 attempts or without, callback or pull mode, no
backoff) and 680-800 records written by a plain confluent-kafka producer and by ``OrderedProducer``
mixed: absent, empty, non-UTF-8 and 1-2 KiB keys, null, empty and 900 KB values, many, huge, binary
and malformed ``ol-`` headers. User code follows a script per record and delivery: ack, nack,
``modify_ack_deadline`` (0 or 1..600 s), double acks, an ack after a nack, ``ack_with_response``,
a raising callback; scripts that always fail make poison messages on dead-letter subscriptions.

Each example must end with every record delivered or dead-lettered (by partition and offset) and
settled (no backlog), no key blocked, per-key order kept on ordered subscriptions, the records
delivered byte for byte, the subscriber's threads alive and nothing logged at ERROR.

Each example costs seconds against the broker, so there are few, each a large batch, and no
shrinking: a failure prints the profile, whose seed reproduces its batch exactly.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, Phase, given, settings

from ordering_layer import AckResponse, Admin, DeadLetterPolicy, Message, Subscriber
from tests.checker import wait_until
from tests.integration.conftest import NO_BACKOFF
from tests.integration.fuzz_workload import FAILING, Profile, Written, build, profiles, write

pytestmark = pytest.mark.integration

_LOGGER = logging.getLogger(__name__)

EXAMPLES = 15
RECORDS = (680, 900)
MAX_ATTEMPTS = 5
SETTLE_TIMEOUT = 90.0


class PlannedFailureError(Exception):
    """Raised by the callback when its script says so (the subscriber nacks the message)."""


class Tracker:
    """What user code saw, per record (partition, offset), and the violations found on the way."""

    def __init__(self, written: dict[tuple[int, int], Written], *, ordered: bool, callback_mode: bool) -> None:
        self.written = written
        self.ordered = ordered
        self.callback_mode = callback_mode
        self.lock = threading.Lock()
        self.deliveries: dict[tuple[int, int], list[tuple[int, str]]] = defaultdict(list)  # (attempt, action)
        self.first_seen: dict[tuple[int, int], int] = {}
        self.outstanding: dict[tuple[int, bytes], tuple[int, int]] = {}
        self.sequence = 0
        self.problems: list[str] = []
        self.failed_acks: list[tuple[tuple[int, int], AckResponse]] = []

    def handle(self, message: Message) -> None:
        """Apply the record's scripted action to this delivery."""
        where = (message.partition(), message.offset())
        written = self.written.get(where)
        if written is None:
            self._problem(f"unknown record {where} delivered")
            message.ack()
            return
        script = written.planned.script
        action = script[min(message.delivery_attempt, len(script)) - 1]
        self._delivered(where, message, written, action)
        self._apply(where, message, action, written.planned.deadline)

    def _delivered(self, where: tuple[int, int], message: Message, written: Written, action: str) -> None:
        planned = written.planned
        if message.data != (planned.value or b"") or message.key() != (planned.key or None):
            self._problem(f"{where}: delivered data or key differ from what was written")
        if planned.plain and _normalized(message.headers()) != _normalized(planned.headers):
            self._problem(f"{where}: delivered headers differ from what was written")
        with self.lock:
            self.sequence += 1
            self.deliveries[where].append((message.delivery_attempt, action))
            self.first_seen.setdefault(where, self.sequence)
            key = message.key()
            if self.ordered and self.callback_mode and key:
                held = self.outstanding.get((where[0], key))
                if held is not None:
                    self.problems.append(f"SUB-1 {where} delivered while {held} of its key is outstanding")
                self.outstanding[(where[0], key)] = where

    def _release(self, where: tuple[int, int], message: Message) -> None:
        """The delivery is about to be settled: its key's next message may come before we return."""
        key = message.key()
        if self.ordered and self.callback_mode and key:
            with self.lock:
                if self.outstanding.get((where[0], key)) == where:
                    del self.outstanding[(where[0], key)]

    def _apply(self, where: tuple[int, int], message: Message, action: str, deadline: float) -> None:
        if action == "deadline_then_ack":
            message.modify_ack_deadline(deadline)
        self._release(where, message)
        if action in ("ack", "deadline_then_ack"):
            message.ack()
        elif action == "double_ack":
            message.ack()
            message.ack()
        elif action == "ack_with_response":
            self._expect_success(where, message.ack_with_response())
        elif action == "nack":
            message.nack()
        elif action == "deadline_zero":
            message.modify_ack_deadline(0)
        elif action == "ack_after_nack":
            message.nack()
            message.ack()
        elif action == "raise":
            raise PlannedFailureError(f"scripted failure of {where}")

    def _expect_success(self, where: tuple[int, int], future: Future[AckResponse]) -> None:
        response = future.result(timeout=30)
        if response != AckResponse.SUCCESS and self.callback_mode:
            with self.lock:
                self.failed_acks.append((where, response))

    def _problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)

    def settled_by_user(self, where: tuple[int, int]) -> bool:
        """The record's last delivery was acked by its script."""
        with self.lock:
            seen = self.deliveries.get(where)
            return bool(seen) and seen[-1][1] not in FAILING

    def order_violations(self) -> list[str]:
        """SUB-1: per partition and key, first deliveries come in offset order."""
        by_key: dict[tuple[int, bytes], list[tuple[int, int]]] = defaultdict(list)
        with self.lock:
            for where, seen_at in self.first_seen.items():
                key = self.written[where].planned.key
                if key:
                    by_key[(where[0], key)].append((seen_at, where[1]))
        problems = []
        for (partition, key), firsts in by_key.items():
            offsets = [offset for _, offset in sorted(firsts)]
            if offsets != sorted(offsets):
                problems.append(f"SUB-1 partition {partition} key {key[:20]!r}: first deliveries in order {offsets}")
        return problems


def _normalized(headers: Any) -> list[tuple[str, bytes | None]]:
    return [(name, value.encode() if isinstance(value, str) else value) for name, value in headers or ()]


class _ErrorLog(logging.Handler):
    """Collects what the layer logs at ERROR (a failing engine step, a failing callback pool...)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _watched() -> Iterator[tuple[_ErrorLog, list[str]]]:
    """ERROR records of ``ordering_layer`` and exceptions that escape any thread, while in the block."""
    handler = _ErrorLog()
    logger = logging.getLogger("ordering_layer")
    logger.addHandler(handler)
    escaped: list[str] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        escaped.append(f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}")

    threading.excepthook = hook
    try:
        yield handler, escaped
    finally:
        threading.excepthook = previous
        logger.removeHandler(handler)


def _engine_threads_alive(subscription: str) -> bool:
    names = {t.name for t in threading.enumerate() if t.is_alive()}
    return {f"ordering-layer-fetch-{subscription}", f"ordering-layer-engine-{subscription}"} <= names


def _run_callback(kafka_config: dict[str, Any], redis_url: str, name: str, tracker: Tracker,
                  settled: Callable[[], bool]) -> bool:
    subscriber = Subscriber(kafka_config, redis_url=redis_url)
    with subscriber.subscribe(name, tracker.handle, max_workers=8):
        wait_until(settled, SETTLE_TIMEOUT, f"every record of {name} settled", interval=0.5)
        return _engine_threads_alive(name)


def _run_pull(kafka_config: dict[str, Any], redis_url: str, name: str, tracker: Tracker,
              settled: Callable[[], bool], batch: int) -> bool:
    stop = threading.Event()
    errors: list[BaseException] = []

    def pull_loop() -> None:
        try:
            while not stop.is_set():
                for message in subscriber.pull(name, max_messages=batch, timeout=0.2):
                    try:
                        tracker.handle(message)
                    except PlannedFailureError:
                        message.nack()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    with Subscriber(kafka_config, redis_url=redis_url) as subscriber:
        puller = threading.Thread(target=pull_loop, name=f"fuzz-pull-{name}", daemon=True)
        puller.start()
        try:
            wait_until(lambda: settled() or bool(errors), SETTLE_TIMEOUT, f"every record of {name} settled",
                       interval=0.5)
            alive = _engine_threads_alive(name)
        finally:
            stop.set()
            puller.join(30)
    assert not errors, errors
    return alive


def _check_example(profile: Profile, admin: Admin, kafka_config: dict[str, Any], redis_url: str) -> int:
    """Run one example; return the number of records it sent."""
    token = uuid.uuid4().hex[:10]
    topic, name, dlq = f"fuzz-{token}", f"fuzz-sub-{token}", f"fuzz-dlq-{token}"
    admin.create_topic(topic, partitions=profile.partitions)
    policy = DeadLetterPolicy(dlq, max_delivery_attempts=MAX_ATTEMPTS) if profile.dead_letter else None
    admin.create_subscription(name, topic=topic, enable_message_ordering=profile.ordered,
                              retry_policy=NO_BACKOFF, dead_letter_policy=policy)
    written = write(kafka_config, topic, build(profile))
    tracker = Tracker(written, ordered=profile.ordered, callback_mode=not profile.pull)

    def settled() -> bool:
        return bool(admin.describe_subscription(name).backlog == 0)

    started = time.monotonic()
    dead: dict[tuple[int, int], Any] = {}
    try:
        with _watched() as (errors, escaped):
            if profile.pull:
                alive = _run_pull(kafka_config, redis_url, name, tracker, settled, 1 + profile.seed % 100)
            else:
                alive = _run_callback(kafka_config, redis_url, name, tracker, settled)
        letters = admin.list_dead_letters(name) if policy is not None else []
        dead = {(d.source_partition, d.source_offset): d for d in letters}
        lost = [w for w in written if w not in tracker.deliveries and w not in dead]
        unsettled = [w for w in written if w not in dead and not tracker.settled_by_user(w)]
        assert alive, "a subscriber thread died"
        assert not [r.getMessage() for r in errors.records], "ERROR logged by ordering_layer"
        assert not escaped, escaped
        assert not lost, f"SUB-3: {len(lost)} records neither delivered nor dead-lettered: {lost[:10]}"
        assert not unsettled, f"SUB-3: {len(unsettled)} records settled without an ack: {unsettled[:10]}"
        assert not tracker.problems, tracker.problems[:10]
        assert not tracker.failed_acks, tracker.failed_acks[:10]
        if profile.ordered:
            assert tracker.order_violations() == []
        for where, letter in dead.items():
            planned = written[where].planned
            assert (letter.reason, letter.delivery_attempts) == ("MAX_DELIVERY_ATTEMPTS", MAX_ATTEMPTS), letter
            assert (letter.key or None, letter.value or b"") == (planned.key or None, planned.value or b""), where
    finally:
        _LOGGER.info("fuzz example %s: %d records, %d deliveries, %d dead letters in %.1f s", profile, len(written),
                     sum(len(d) for d in tracker.deliveries.values()), len(dead), time.monotonic() - started)
        admin.delete_subscription(name)
        admin.delete_topic(topic)
        if policy is not None:
            admin.delete_topic(dlq)
    return len(written)


def test_generated_records_and_actions_never_crash_lose_or_block(admin: Admin, kafka_config: dict[str, Any],
                                                                  endpoints: Any) -> None:
    """DLQ-4, SUB-1, SUB-3: >= 10,000 generated records of both producers, with scripted acks, nacks,
    deadline changes, double acks and acks after nacks, through real subscriptions of every kind:
    no subscriber crash, every record delivered or dead-lettered and settled, no key blocked,
    per-key order kept."""
    sent: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
              suppress_health_check=(HealthCheck.too_slow,))
    @given(profile=profiles(RECORDS))
    def example(profile: Profile) -> None:
        sent.append(_check_example(profile, admin, kafka_config, endpoints.redis_url))

    example()
    assert sum(sent) >= 10_000, f"only {sum(sent)} records in {len(sent)} examples"


def test_poison_record_too_large_for_a_dead_letter_still_settles(admin: Admin, kafka_config: dict[str, Any],
                                                                 endpoints: Any) -> None:
    """DLQ-4: a record near the broker's limit (any producer may write one: Java's default request
    size is 1 MiB) that always fails cannot fit, with its dead-letter metadata, in a dead letter;
    it must still be dead-lettered with the reason (or retried and reported) without an ERROR,
    and its key's next message must come."""
    token = uuid.uuid4().hex[:10]
    topic, name, dlq = f"fuzz-big-{token}", f"fuzz-big-sub-{token}", f"fuzz-big-dlq-{token}"
    admin.create_topic(topic, partitions=1)
    admin.create_subscription(name, topic=topic, retry_policy=NO_BACKOFF,
                              dead_letter_policy=DeadLetterPolicy(dlq, max_delivery_attempts=MAX_ATTEMPTS))
    producer = Producer({**kafka_config, "message.max.bytes": 1_048_000})
    producer.produce(topic, b"v" * 1_030_000, b"k", headers=[("h", b"x" * 300)])
    producer.produce(topic, b"next", b"k")
    assert producer.flush(30) == 0
    acked: list[int] = []

    def callback(message: Message) -> None:
        if message.offset() == 0:
            message.nack()
        else:
            acked.append(message.offset())
            message.ack()

    with _watched() as (errors, escaped):
        handle = Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(name, callback)
        try:
            wait_until(lambda: acked == [1], 40, "the poison's key to go on")
        finally:
            handle.cancel(timeout=1)
    assert not [r.getMessage() for r in errors.records] and not escaped
    assert [(d.source_offset, d.reason) for d in admin.list_dead_letters(name)] == [(0, "MAX_DELIVERY_ATTEMPTS")]
