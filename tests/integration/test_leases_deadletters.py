"""Leases, retries and dead letters against the real broker and Redis (ACK-1..3, ACK-6, DLQ-1..5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest

from ordering_layer import Admin, DeadLetterPolicy, Message, RetryPolicy, Subscriber
from ordering_layer.state import StateStore
from ordering_layer.state.store import firsts_key, offset_fields, partition_keys
from tests.checker import wait_until
from tests.integration.conftest import publish_keys, pull_until, recording_callback
from tests.kafka_helpers import headers_of, read_topic

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_lease_extended_while_handler_runs_past_deadline(kafka_config: dict[str, Any], endpoints: Any,
                                                         subscription: Callable[..., tuple[str, str]]) -> None:
    """ACK-2: a handler slower than the 10 s ack deadline is not redelivered while its lease is extended."""
    topic, name = subscription(partitions=1, ack_deadline=10)
    checker = publish_keys(kafka_config, topic, keys=2, per_key=1)

    def handler(message: Message) -> str:
        if message.ordering_key == "key-0":
            time.sleep(13)
        return "ack"

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1", handler)):
        wait_until(lambda: checker.acked_count() == 2, 60, "both acked")
    assert [e.attempt for e in checker.deliveries("key-0")] == [1]
    assert checker.verify() == []


def test_a_held_delivery_has_its_lease_in_redis_until_its_ack(kafka_config: dict[str, Any], endpoints: Any,
                                                               subscription: Callable[..., tuple[str, str]]) -> None:
    """ACK-4: a delivery that user code holds beyond the flush after its release has its lease in Redis
    (written by that flush), as have the later records of its key released with it (its run, waiting
    for it on the same worker); deliveries acked at once leave no lease behind, and the acks delete
    the leases."""
    topic, name = subscription(partitions=1)
    publish_keys(kafka_config, topic, keys=20, per_key=5)
    store = StateStore(endpoints.redis_url)
    leases_key = partition_keys(name, 0)[3]
    hold = threading.Event()
    held: list[Message] = []
    acked = threading.Semaphore(0)

    def callback(message: Message) -> None:
        if message.ordering_key == "key-0" and not held:
            held.append(message)
            hold.wait(60)
        message.ack()
        acked.release()

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, callback):
        wait_until(lambda: bool(held), 60, "key-0's first message held")
        offset = held[0].offset()
        key_0 = {offset + 20 * n for n in range(5)}  # 20 keys interleaved in one partition

        def held_leases() -> bool:
            fields = set(offset_fields(store.client.hkeys(leases_key)))
            return offset in fields and fields <= key_0

        wait_until(held_leases, 30, "the held delivery's lease in Redis, with its key's run's only")
        hold.set()
        for _ in range(100):
            assert acked.acquire(timeout=60)
        wait_until(lambda: offset_fields(store.client.hkeys(leases_key)) == [], 30, "no lease left in Redis")


def test_lapsed_lease_redelivers_with_cascade(kafka_config: dict[str, Any], endpoints: Any,
                                              subscription: Callable[..., tuple[str, str]]) -> None:
    """ACK-1, SUB-4, ACK-6: past max_lease_duration the lease is not extended; at the deadline the
    held batch of a key comes again, in order, with the next delivery attempt."""
    topic, name = subscription(partitions=1, ack_deadline=10, max_lease_duration=1)
    publish_keys(kafka_config, topic, keys=1, per_key=3)
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        first = pull_until(subscriber, name, 3)
        started = time.monotonic()
        again = pull_until(subscriber, name, 3, timeout=30)
        waited = time.monotonic() - started
        assert [m.message_id for m in again] == [m.message_id for m in first]
        assert [m.delivery_attempt for m in again] == [2, 2, 2]
        assert 8 <= waited <= 20
        Subscriber.acknowledge(again)


def test_modify_ack_deadline_zero_nacks(kafka_config: dict[str, Any], endpoints: Any,
                                        subscription: Callable[..., tuple[str, str]]) -> None:
    """ACK-3: modify_ack_deadline(0) gives the message back at once; a longer deadline keeps it."""
    topic, name = subscription(partitions=1)
    publish_keys(kafka_config, topic, keys=2, per_key=1)
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        held = {m.ordering_key: m for m in pull_until(subscriber, name, 2)}
        held["key-1"].modify_ack_deadline(60)
        held["key-0"].modify_ack_deadline(0)
        again = pull_until(subscriber, name, 1)
        assert [(m.ordering_key, m.delivery_attempt) for m in again] == [("key-0", 2)]
        assert subscriber.pull(name, 10, 1.0) == []
        Subscriber.acknowledge([*again, held["key-1"]])


def test_backoff_delays_only_its_key(kafka_config: dict[str, Any], endpoints: Any,
                                     subscription: Callable[..., tuple[str, str]]) -> None:
    """DLQ-1: after a nack the key waits its backoff (here 3 s); another key in the same partition flows."""
    topic, name = subscription(partitions=1, retry_policy=RetryPolicy(minimum_backoff=3, maximum_backoff=3))
    checker = publish_keys(kafka_config, topic, keys=2, per_key=20)
    nacked_at: list[float] = []
    redelivered_at: list[float] = []
    others_done = threading.Event()

    def handler(message: Message) -> str:
        if message.ordering_key == "key-0" and message.message_id == checker.published["key-0"][0]:
            if message.delivery_attempt == 1:
                nacked_at.append(time.monotonic())
                return "nack"
            redelivered_at.append(time.monotonic())
        return "ack"

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1", handler)):
        wait_until(lambda: len([e for e in checker.events if e.key == "key-1" and e.action == "ack"]) == 20,
                   30, "key-1 done")
        others_done.set()
        key1_done = time.monotonic()
        wait_until(lambda: checker.acked_count() == checker.total(), 30, "key-0 done after its backoff")
    assert key1_done - nacked_at[0] < 2.5, "key-1 was not held by key-0's backoff"
    assert redelivered_at[0] - nacked_at[0] >= 2.9
    assert checker.verify() == []


def test_nacked_every_time_goes_to_dead_letters_after_max_attempts(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]], unique_name: Callable[[str], str]) -> None:
    """DLQ-2, ACK-6: a message nacked on every delivery reaches the dead-letter topic after exactly
    max_delivery_attempts deliveries (attempts 1..5), with the DLQ-2 headers, then counts as acked;
    its key goes on with the next message (forward mode)."""
    dlq = unique_name("dlq")
    topic, name = subscription(partitions=2, dead_letter_policy=DeadLetterPolicy(dlq, max_delivery_attempts=5))
    checker = publish_keys(kafka_config, topic, keys=3, per_key=4)
    poison = checker.published["key-1"][1]

    def handler(message: Message) -> str:
        return "nack" if message.message_id == poison else "ack"

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1", handler)):
        wait_until(lambda: checker.acked_count() == checker.total() - 1, 60, "all but the poison acked")
    attempts = [e.attempt for e in checker.deliveries() if e.message_id == poison]
    assert attempts == [1, 2, 3, 4, 5]
    records = read_topic(kafka_config, dlq, 1)
    assert len(records) == 1
    headers = headers_of(records[0])
    assert headers["ol-dlq-source-topic"] == topic.encode()
    assert headers["ol-dlq-attempts"] == b"5"
    assert headers["ol-dlq-key"] == b"key-1"
    assert headers["ol-dlq-subscription"] == name.encode()
    assert headers["ol-dlq-reason"] == b"MAX_DELIVERY_ATTEMPTS"
    assert int(headers["ol-dlq-sequence-number"]) >> 48 == int(headers["ol-dlq-source-partition"])
    letters = admin.list_dead_letters(name)
    assert [(d.ordering_key, d.delivery_attempts, d.reason) for d in letters] == [
        ("key-1", 5, "MAX_DELIVERY_ATTEMPTS")]
    checker.record(poison, "s1", 5, "dead")
    assert checker.verify(one_outstanding=True, max_delivery_attempts=5) == []
    assert admin.describe_subscription(name).backlog == 0


def _events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]


def _acked(log: Path, ids: Collection[str]) -> bool:
    return set(ids) <= {e["id"] for e in _events(log) if e["action"] == "ack"}


def _crash_rounds(tmp_path: Path, admin: Admin, endpoints: Any, name: str, log: Path, others: Collection[str],
                  worker_args: list[str], after_crash: Callable[[str], None] | None = None) -> dict[str, int | None]:
    """Start up to six subscriber processes in turn, each until it exits (the poison killed it: exit
    3) or until the poison is dead-lettered and ``others`` are acked (or more than the poison is
    dead-lettered); returns each worker's exit code (None: stopped when settled)."""
    exits: dict[str, int | None] = {}

    def settled() -> bool:
        letters = len(admin.list_dead_letters(name))
        return letters > 1 or (letters == 1 and _acked(log, others))
    for n in range(6):
        worker = f"w{n}"
        exits[worker] = _run_worker(
            ["--bootstrap", endpoints.bootstrap, "--kafka-config", endpoints.kafka_config_file,
             "--redis-url", endpoints.redis_url, "--subscription", name, "--name", worker, "--log", str(log),
             "--crash-on", "key-0:0", "--session-ms", "2000", "--seconds", "120", *worker_args],
            tmp_path / f"{worker}.stderr", settled, 120)
        if exits[worker] != 3:
            break
        if after_crash is not None:
            after_crash(worker)
    return exits


def _run_worker(args: list[str], err: Path, done: Callable[[], bool], budget: float) -> int | None:
    """Run one subscriber process until it exits (its exit code) or until ``done()``, which holds
    only after the poison message is settled (then None)."""
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tests.integration.subscriber_worker", *args],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + budget
        try:
            while time.monotonic() < deadline:
                try:
                    return proc.wait(0.2)
                except subprocess.TimeoutExpired:
                    if done():
                        return None
            return None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_poison_message_crashing_the_process_is_dead_lettered(
        tmp_path: Path, admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]], unique_name: Callable[[str], str]) -> None:
    """DLQ-3, ACK-6: a message that kills its subscriber process (os._exit) on every delivery reaches
    the dead-letter topic after exactly max_delivery_attempts deliveries, each of which crashed a
    process: attempts 1..5 in five processes that each exited with the crash code, then the dead letter.

    Deliveries are counted from the processes' own log, not from exit codes: a process can end for
    another reason (a failed start, no partition within its budget), which is not a delivery."""
    dlq = unique_name("dlq")
    topic, name = subscription(partitions=1, dead_letter_policy=DeadLetterPolicy(dlq, max_delivery_attempts=5))
    published = publish_keys(kafka_config, topic, keys=1, per_key=3).published["key-0"]
    poison, after = published[1], published[2]
    log = tmp_path / "events.jsonl"
    exits: dict[str, int | None] = {}
    for n in range(6):
        worker = f"w{n}"
        exits[worker] = _run_worker(
            ["--bootstrap", endpoints.bootstrap, "--kafka-config", endpoints.kafka_config_file,
             "--redis-url", endpoints.redis_url, "--subscription", name,
             "--name", worker, "--log", str(log), "--crash-on", "key-0:1", "--session-ms", "2000",
             "--seconds", "120"], tmp_path / f"{worker}.stderr", lambda: _acked(log, {after}), 120)
        if exits[worker] != 3:
            break
    stderr = {w: (tmp_path / f"{w}.stderr").read_text()[-2000:] for w in exits}
    deliveries = [(e["sub"], e["attempt"]) for e in _events(log) if e["id"] == poison and e["action"] == "deliver"]
    assert deliveries == [(f"w{n}", n + 1) for n in range(5)], (exits, stderr)
    assert exits == {**{f"w{n}": 3 for n in range(5)}, "w5": None}, (exits, stderr)
    letters = admin.list_dead_letters(name)
    assert [(d.reason, d.delivery_attempts, d.message_id) for d in letters] == [
        ("MAX_DELIVERY_ATTEMPTS", 5, poison)]
    assert letters[0].value == b"key-0:1"


def test_crashes_of_a_poison_dead_letter_no_message_that_waited_beside_it(
        tmp_path: Path, admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]], unique_name: Callable[[str], str]) -> None:
    """DLQ-3, ACK-6: a poison message (offset 0) kills its process (os._exit) on every delivery; the
    first messages of 39 other keys on its partition are released with it to a single callback
    worker, which takes the poison first, so they wait in the pool, never started, each time a
    process dies. Exactly the poison is dead-lettered, after exactly max_delivery_attempts (5)
    crashing deliveries; every other message reaches the handler and is acked, at attempt 5 at most:
    an attempt never seen started is charged only below the dead-letter limit."""
    dlq = unique_name("dlq")
    topic, name = subscription(partitions=1, dead_letter_policy=DeadLetterPolicy(dlq, max_delivery_attempts=5))
    published = publish_keys(kafka_config, topic, keys=40, per_key=1).published
    poison = published["key-0"][0]
    others = {published[f"key-{k}"][0] for k in range(1, 40)}
    attempts_key = partition_keys(name, 0)[2]
    redis_client = StateStore(endpoints.redis_url).client
    log = tmp_path / "events.jsonl"
    waiting: dict[str, int] = {}

    def count_waiting(worker: str) -> None:  # offsets 1..39 were released with the poison, unsettled
        recorded = set(offset_fields(redis_client.hkeys(attempts_key)))  # attempts after the first
        for run in redis_client.zrange(firsts_key(name, 0), 0, -1):  # first attempts
            *bounds, _ = (int(part) for part in run.split(b","))
            for first, last in zip(bounds[::2], bounds[1::2], strict=True):
                recorded.update(range(first, last + 1))
        waiting[worker] = len(recorded - {0})
    exits = _crash_rounds(tmp_path, admin, endpoints, name, log, others, ["--workers", "1"], count_waiting)
    stderr = {w: (tmp_path / f"{w}.stderr").read_text()[-2000:] for w in exits}
    events = _events(log)
    deliveries = [(e["sub"], e["attempt"]) for e in events if e["id"] == poison and e["action"] == "deliver"]
    assert deliveries == [(f"w{n}", n + 1) for n in range(5)], (exits, stderr)
    assert exits == {**{f"w{n}": 3 for n in range(5)}, "w5": None}, (exits, stderr)
    letters = admin.list_dead_letters(name)
    assert [(d.reason, d.delivery_attempts, d.message_id) for d in letters] == [
        ("MAX_DELIVERY_ATTEMPTS", 5, poison)], f"{len(letters)} dead letters"
    assert {e["id"] for e in events if e["action"] == "ack"} == others
    assert waiting == {f"w{n}": 39 for n in range(5)}
    handled = [e for e in events if e["id"] in others and e["action"] == "deliver"]
    assert {e["sub"] for e in handled} == {"w5"} and max(e["attempt"] for e in handled) <= 5


def test_crashes_of_a_poison_dead_letter_no_message_that_ran_beside_it(
        tmp_path: Path, admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]], unique_name: Callable[[str], str]) -> None:
    """DLQ-3, ACK-6: a poison message (offset 0) kills its process (os._exit) on every delivery, once
    at least 2 messages of other keys of its partition have started beside it in that process (8
    callback workers; the others' handlers take 0.5 s). The first crash charges the 6 others an
    attempt and makes them suspects, as the poison is; the suspects of one crash go out together,
    so the poison crashes the second process beside them too; charged two attempts, they are
    quarantined, one out at a time per partition, so the poison crashes alone in the next three
    processes and is dead-lettered after exactly max_delivery_attempts (5) crashing deliveries, and
    every other message is acked, at attempt 3 at most."""
    dlq = unique_name("dlq")
    topic, name = subscription(partitions=1, dead_letter_policy=DeadLetterPolicy(dlq, max_delivery_attempts=5))
    published = publish_keys(kafka_config, topic, keys=7, per_key=1).published
    poison = published["key-0"][0]
    others = {published[f"key-{k}"][0] for k in range(1, 7)}
    log = tmp_path / "events.jsonl"
    exits = _crash_rounds(tmp_path, admin, endpoints, name, log, others,
                          ["--workers", "8", "--crash-with", "2", "--delay-ms", "500"])
    stderr = {w: (tmp_path / f"{w}.stderr").read_text()[-2000:] for w in exits}
    events = _events(log)
    deliveries = [(e["sub"], e["attempt"]) for e in events if e["id"] == poison and e["action"] == "deliver"]
    assert deliveries == [(f"w{n}", n + 1) for n in range(5)], (exits, stderr)
    assert exits == {**{f"w{n}": 3 for n in range(5)}, "w5": None}, (exits, stderr)
    def ran_beside(worker: str) -> set[str]:
        return {e["id"] for e in events if e["sub"] == worker and e["action"] == "deliver"} & others
    assert len(ran_beside("w0")) >= 2, "the others ran beside the poison when it first crashed"
    assert len(ran_beside("w1")) >= 2, "one crash's suspects went out together"
    assert not ran_beside("w2") | ran_beside("w3") | ran_beside("w4"), "quarantined from the second crash"
    letters = admin.list_dead_letters(name)
    assert [(d.reason, d.delivery_attempts, d.message_id) for d in letters] == [
        ("MAX_DELIVERY_ATTEMPTS", 5, poison)], [(d.message_id, d.delivery_attempts) for d in letters]
    assert {e["id"] for e in events if e["action"] == "ack"} == others
    assert max(e["attempt"] for e in events if e["id"] in others and e["action"] == "deliver") <= 3


def test_park_key_keeps_order_and_redrive_restores_it(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]], unique_name: Callable[[str], str]) -> None:
    """DLQ-2 park_key, DLQ-5: the key's later messages follow its dead letter in order; other keys flow;
    after release a redrive republishes them per key in the original order, with their message ids."""
    dlq = unique_name("dlq")
    topic, name = subscription(partitions=2, dead_letter_policy=DeadLetterPolicy(
        dlq, max_delivery_attempts=5, mode="park_key"))
    checker = publish_keys(kafka_config, topic, keys=3, per_key=4)
    poison = checker.published["key-2"][1]
    redriven_seen: list[str] = []

    def handler(message: Message) -> str:
        if message.message_id == poison and message.delivery_attempt <= 5 and not redriven_seen:
            return "nack"
        return "ack"

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1", handler)):
        wait_until(lambda: len(admin.list_dead_letters(name)) == 3, 60, "poison and its followers dead-lettered")
        wait_until(lambda: checker.acked_count() == 9, 30, "other keys and key-2's first message acked")
    letters = admin.list_dead_letters(name)
    assert [d.reason for d in letters] == ["MAX_DELIVERY_ATTEMPTS", "PARKED_KEY", "PARKED_KEY"]
    assert [d.message_id for d in letters] == checker.published["key-2"][1:]

    assert admin.release_key(name, "key-2")
    republished = admin.redrive_dead_letters(name)
    assert len(republished) == 3
    assert admin.redrive_dead_letters(name) == [], "a second redrive republishes nothing"
    redriven_seen.append("yes")
    got: list[Message] = []
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as puller:
        got = pull_until(puller, name, 3, ack=True)
    assert [m.message_id for m in got] == checker.published["key-2"][1:]


def test_a_hot_keys_runs_keep_order_and_exact_attempts_with_nacks_and_poisons(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]],
        unique_name: Callable[[str], str]) -> None:
    """SUB-1, SUB-4, DLQ-2, DLQ-3 (callback mode, one hot key: its records go to one worker in runs):
    never two of the key in user code at once, each nack redelivers the key from the nacked message
    in order, the records of a run after a nack keep their attempt counts (they never started), and
    each poison is dead-lettered after exactly ``max_delivery_attempts`` deliveries."""
    dlq = unique_name("dlq")
    topic, name = subscription(partitions=1, retry_policy=RetryPolicy(0, 0),
                               dead_letter_policy=DeadLetterPolicy(dlq, max_delivery_attempts=5))
    checker = publish_keys(kafka_config, topic, keys=1, per_key=2000)
    ids = checker.published["key-0"]
    poisons = {ids[100], ids[777], ids[1500]}
    flaky = set(ids[5::37]) - poisons  # nacked on their first delivery only

    def handler(message: Message) -> str:
        if message.message_id in poisons or (message.message_id in flaky and message.delivery_attempt == 1):
            return "nack"
        return "ack"

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1", handler), max_workers=8):
        wait_until(lambda: checker.acked_count() == checker.total() - len(poisons), 120,
                   "all but the poisons acked")
        wait_until(lambda: len(read_topic(kafka_config, dlq, len(poisons))) == len(poisons), 60,
                   "the poisons dead-lettered")
    for poison in poisons:
        assert [e.attempt for e in checker.deliveries() if e.message_id == poison] == [1, 2, 3, 4, 5]
        checker.record(poison, "s1", 5, "dead")
    assert checker.verify(one_outstanding=True, max_delivery_attempts=5) == []
