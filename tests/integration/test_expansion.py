"""Per-key order across a partition expansion while subscribers run (SUB-8)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewPartitions  # type: ignore[attr-defined]

from ordering_layer import Admin, DeadLetterPolicy, Message, OrderedProducer, RetryPolicy, Subscriber
from ordering_layer.kafka.partitioner import partition_for
from ordering_layer.record import sequence_number
from ordering_layer.state.client import redis_client
from tests.checker import DeliveryChecker, wait_until
from tests.integration.conftest import recording_callback as declared_callback
from tests.integration.test_chaos import WorkerProcess, read_events, settled_ids
from tests.kafka_helpers import read_topic

pytestmark = pytest.mark.integration


def publish_round(kafka_config: dict[str, Any], topic: str, keys: list[str], per_key: int, round_: int,
                  ids: dict[str, list[str]]) -> None:
    """Publish ``per_key`` messages of every key, interleaved, with a producer of its own (which
    reads the topic's partition count when it starts); their ids join ``ids`` in publish order."""
    with OrderedProducer(kafka_config) as producer:
        futures = [(key, producer.publish(topic, f"{key}:{round_}:{n}".encode(), ordering_key=key))
                   for n in range(per_key) for key in keys]
        for key, future in futures:
            ids[key].append(future.result(timeout=60).message_id)


def recording(checker: DeliveryChecker, subscriber: str,
              handler: Callable[[Message], str] | None = None) -> Callable[[Message], None]:
    """``recording_callback`` for messages published while the subscriber runs: a message whose id
    is not declared yet (its publish has not returned) waits in its handler until it is."""
    record = declared_callback(checker, subscriber, handler)

    def callback(message: Message) -> None:
        wait_until(lambda: checker.knows(message.message_id), 60, f"{message.message_id} declared")
        record(message)

    return callback


def slow_ack(delay: float) -> Callable[[Message], str]:
    def handler(message: Message) -> str:
        time.sleep(delay)  # the handler's work, not a synchronisation
        return "ack"

    return handler


def test_order_holds_when_the_topic_grows_under_a_running_subscriber(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8: 100 keys x 40 messages on 2 partitions, a subscriber working through them with a 40 ms
    handler; the topic grows to 6, a fresh producer sends 40 more per key (most keys move to another
    partition), a second subscriber joins. Every key is still delivered in order, one message
    outstanding at a time, across both subscribers."""
    topic, name = subscription(partitions=2)
    keys = [f"key-{k}" for k in range(100)]
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 40, 0, ids)
    checker = DeliveryChecker()
    for key in keys:
        checker.expect(key, ids[key])
    first = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    second = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with first.subscribe(name, recording(checker, "s1", slow_ack(0.04)), max_workers=10):
        wait_until(lambda: checker.acked_count() >= 400, 60, "the first subscriber under way")
        admin.add_partitions(topic, 6)
        publish_round(kafka_config, topic, keys, 40, 1, ids)
        for key in keys:
            checker.expect(key, ids[key])
        with second.subscribe(name, recording(checker, "s2", slow_ack(0.04)), max_workers=10):
            wait_until(lambda: checker.acked_count() == checker.total(), 240, "every message acked")
    assert checker.verify() == []


def moved(key: str, before: int, after: int) -> bool:
    return partition_for(key.encode(), before) != partition_for(key.encode(), after)


def waiting_free(keys: list[str], stuck: str) -> list[str]:
    """The keys that do not wait while ``stuck``'s first old record is unsettled: the unmoved ones
    and those that moved from another old partition (2 -> 4 partitions)."""
    home = partition_for(stuck.encode(), 2)
    return [key for key in keys if not moved(key, 2, 4) or partition_for(key.encode(), 2) != home]


def acked(checker: DeliveryChecker, ids: dict[str, list[str]], some: list[str]) -> int:
    """Messages of the keys ``some`` acked so far."""
    wanted = {message_id for key in some for message_id in ids[key]}
    return len({e.message_id for e in list(checker.events) if e.action == "ack" and e.message_id in wanted})


def grow_and_publish(admin: Admin, kafka_config: dict[str, Any], topic: str, keys: list[str], per_key: int,
                     ids: dict[str, list[str]], checker: DeliveryChecker) -> None:
    """Grow the topic from 2 to 4 partitions, publish round 1 (``per_key`` per key, from a fresh
    producer that routes by 4) and declare it to the checker."""
    admin.add_partitions(topic, 4)
    publish_round(kafka_config, topic, keys, per_key, 1, ids)
    expect_all(checker, ids)


def expect_all(checker: DeliveryChecker, ids: dict[str, list[str]]) -> None:
    for key, message_ids in ids.items():
        checker.expect(key, message_ids)


def recorded(checker: DeliveryChecker, *logs: Path) -> list[dict[str, Any]]:
    """The worker processes' events (``read_events``), each recorded in ``checker``."""
    events = read_events(*logs)
    for event in events:
        checker.record(event["id"], event["sub"], event["attempt"], event["action"], at=event["at"])
    return events


def test_a_moved_key_waits_for_its_old_partitions_commit_point_and_no_other_key_waits_for_it(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8, SUB-2: while a moved key's first old record is held by its handler, that key's records
    under the new count wait; unmoved keys and keys that moved from the other partition go on; once
    the record is acked the key follows, in order. ``describe`` shows the key held."""
    topic, name = subscription(partitions=2)
    keys = [f"key-{k}" for k in range(40)]
    stuck = next(key for key in keys if moved(key, 2, 4))
    free = waiting_free(keys, stuck)
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 5, 0, ids)
    checker = DeliveryChecker()
    expect_all(checker, ids)
    release = threading.Event()
    first_of_stuck = ids[stuck][0]

    def handler(message: Message) -> str:
        if message.message_id == first_of_stuck:
            release.wait(120)
        return "ack"

    with Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(
            name, recording(checker, "s1", handler), max_workers=4):
        wait_until(lambda: checker.acked_count() == len(keys) * 5 - 5, 60, "every other old message acked")
        grow_and_publish(admin, kafka_config, topic, keys, 5, ids, checker)
        wait_until(lambda: acked(checker, ids, free) == len(free) * 10, 60, "the keys that do not wait acked")
        assert [e.index for e in checker.deliveries(stuck)] == [0], "the stuck key's new records wait"
        assert any(moved(key, 2, 4) for key in free), "keys that moved from the other partition went on"
        home = partition_for(stuck.encode(), 4)
        wait_until(lambda: next(row.moved_keys_held for row in admin.describe_subscription(name).partitions
                            if row.partition == home) >= 1, 30, "describe shows the moved key held")
        release.set()
        wait_until(lambda: checker.acked_count() == checker.total(), 60, "the waiting keys finished")
    assert checker.verify() == []


def test_a_growth_made_with_kafkas_own_tools_is_consumed_within_15_s(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8: partitions added behind the layer's back (a plain AdminClient, as kafka-topics.sh does)
    are consumed by a running subscriber within 15 s, and keys keep their order across the growth."""
    topic, name = subscription(partitions=2)
    keys = [f"key-{k}" for k in range(30)]
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 3, 0, ids)
    checker = DeliveryChecker()
    expect_all(checker, ids)
    with Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(
            name, recording(checker, "s1"), max_workers=4):
        wait_until(lambda: checker.acked_count() == checker.total(), 60, "the old messages acked")
        plain = AdminClient({**kafka_config})
        plain.create_partitions([NewPartitions(topic, 6)])[topic].result(30)
        grown = time.time()
        publish_round(kafka_config, topic, keys, 3, 1, ids)
        expect_all(checker, ids)
        wait_until(lambda: checker.acked_count() == checker.total(), 60, "the new messages acked")
    assert checker.verify() == []
    in_new = [e.at for e in checker.deliveries() if int(e.message_id) >> 48 >= 2]
    assert in_new, "records in the new partitions"
    assert min(in_new) - grown <= 15.0, f"new partitions consumed {min(in_new) - grown:.1f} s after the growth"


def test_two_growths_in_a_row(admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
                              subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8: 2 -> 3 -> 6 partitions while a slow subscriber works: a key can have records in three
    partitions, and each record waits for those of every earlier count."""
    topic, name = subscription(partitions=2)
    keys = [f"key-{k}" for k in range(40)]
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 10, 0, ids)
    checker = DeliveryChecker()
    expect_all(checker, ids)
    with Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(
            name, recording(checker, "s1", slow_ack(0.02)), max_workers=4):
        admin.add_partitions(topic, 3)
        publish_round(kafka_config, topic, keys, 5, 1, ids)
        admin.add_partitions(topic, 6)
        publish_round(kafka_config, topic, keys, 5, 2, ids)
        expect_all(checker, ids)
        wait_until(lambda: checker.acked_count() == checker.total(), 120, "every message acked")
    assert checker.verify() == []
    assert admin.partition_counts(topic)[-2:][0][0] == 3 and admin.partition_counts(topic)[-1][0] == 6


def test_a_moved_key_backed_off_in_its_old_partition_waits_for_its_redelivery(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8, DLQ-1, SUB-4: a moved key whose old record is nacked and backed off (1 s), twice,
    has its new records held until the redelivery is acked; the cascade stays in the old partition."""
    topic, name = subscription(partitions=2, retry_policy=RetryPolicy(minimum_backoff=1, maximum_backoff=1))
    keys = [f"key-{k}" for k in range(20)]
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 3, 0, ids)
    nacked = {key: ids[key][-1] for key in keys if moved(key, 2, 4)}
    checker = DeliveryChecker()
    expect_all(checker, ids)
    growth_done = threading.Event()

    def handler(message: Message) -> str:
        if message.message_id in nacked.values() and message.delivery_attempt < 3:
            growth_done.wait(60)
            return "nack"
        return "ack"

    with Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(
            name, recording(checker, "s1", handler), max_workers=4):
        grow_and_publish(admin, kafka_config, topic, keys, 3, ids, checker)
        growth_done.set()
        wait_until(lambda: checker.acked_count() == checker.total(), 90, "every message acked")
    assert checker.verify() == []
    for key, message_id in nacked.items():
        attempts = [e.attempt for e in checker.deliveries(key) if e.message_id == message_id]
        assert attempts == [1, 2, 3]


def test_a_flushall_while_a_moved_key_is_held_loses_no_order(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Any, restartable: Any,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8, SUB-3: Redis loses everything (FLUSHALL) while a moved key's new records wait: the
    history comes back from its durable copy, the old records are redelivered, and the key's new
    records still come after them."""
    topic, name = subscription(partitions=2)
    keys = [f"key-{k}" for k in range(20)]
    stuck = next(key for key in keys if moved(key, 2, 4))
    free = waiting_free(keys, stuck)
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 3, 0, ids)
    checker = DeliveryChecker()
    expect_all(checker, ids)
    release = threading.Event()

    def handler(message: Message) -> str:
        if message.message_id == ids[stuck][0] and message.delivery_attempt == 1:
            release.wait(60)
        return "ack"

    with Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(
            name, recording(checker, "s1", handler), max_workers=4):
        wait_until(lambda: checker.acked_count() == checker.total() - 3, 60, "every other old message acked")
        grow_and_publish(admin, kafka_config, topic, keys, 3, ids, checker)
        wait_until(lambda: acked(checker, ids, free) == len(free) * 6, 60, "the keys that do not wait acked")
        redis_client(endpoints.redis_url).flushall()
        release.set()
        wait_until(lambda: checker.acked_count() == checker.total(), 90, "every message acked")
    assert checker.verify(one_outstanding=False) == []
    assert admin.partition_counts(topic)[-1][0] == 4


def test_a_new_owner_after_a_flushall_does_not_replay_moved_keys_old_records(
        tmp_path: Path, admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8, SUB-4: in subscriber process A, a key that stays holds its old partition's commit point
    (its first message is in a handler that never returns); the keys that moved out of that partition
    are settled there (in Redis only), cleared, and their new records acked in their new partitions.
    Then Redis loses everything (FLUSHALL), A is killed with SIGKILL, and B takes over: it replays
    the old partition from its commit point, but the moved keys' old records there, settled before
    their new ones went out, are not handed out again after them (B reads their departure marks back
    from the durable copy)."""
    topic, name = subscription(partitions=2)
    keys = [f"key-{k}" for k in range(30)]
    blocker = next(key for key in keys if not moved(key, 2, 4))
    home = partition_for(blocker.encode(), 2)
    departed = [key for key in keys if moved(key, 2, 4) and partition_for(key.encode(), 2) == home]
    assert departed, "keys that left the blocker's partition"
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 3, 0, ids)
    checker = DeliveryChecker()
    expect_all(checker, ids)
    log_a, log_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = WorkerProcess("A", endpoints, name, log_a, "--hold-data", f"{blocker}:0:0")
    b: WorkerProcess | None = None
    try:
        wait_until(lambda: len(settled_ids(read_events(log_a), "A")) == checker.total() - 3, 60,
                   "every old message but the blocker's acked")
        grow_and_publish(admin, kafka_config, topic, keys, 3, ids, checker)
        others = {message_id for key in keys if key != blocker for message_id in ids[key]}
        wait_until(lambda: others <= settled_ids(read_events(log_a), "A"), 60,
                   "the moved keys cleared and every message but the blocker's acked")
        wait_until(lambda: all(row.committed == row.log_end for row in admin.describe_subscription(name).partitions
                               if row.partition != home), 60, "A's commits of the other partitions in Kafka")
        redis_client(endpoints.redis_url).flushall()
        killed_at = a.kill()
        checker.subscriber_died("A", killed_at)
        b = WorkerProcess("B", endpoints, name, log_b)
        wait_until(lambda: len(settled_ids(read_events(log_a, log_b), "A")) == checker.total(), 120,
                   "every message acked")
        # B also replays what Redis lost (acked by A above the old partition's commit point): its
        # cascades are over once every partition is committed to its end.
        wait_until(lambda: all(row.committed == row.log_end for row in admin.describe_subscription(name).partitions),
                   120, "B's replay acked and committed")
    finally:
        a.stop()
        if b is not None:
            b.stop()
    recorded(checker, log_a, log_b)
    assert checker.verify() == []
    claims = [line for line in Path(f"{log_b}.B.log").read_text().splitlines()
              if f"claimed partition {home} " in line]
    assert any(f", {len(departed)} departed keys" in claim for claim in claims), \
        f"B claimed the old partition with its departed keys: {claims}"


def test_records_of_another_producer_on_both_sides_of_a_growth(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8, PUB-7: records kcat writes (murmur2 partitioner, no layer headers) before and after a
    growth are held by their append times: each key's records after the growth are delivered after
    its records before it, by a subscriber that starts once both are written."""
    topic, name = subscription(partitions=2)
    kcat = shutil.which("kcat")
    assert kcat is not None, "make setup installs Debian's kcat"
    keys = [f"key-{k}" for k in range(30)]

    def write(round_: int) -> None:
        lines = "".join(f"{key}:{key}:{round_}:{n}\n" for n in range(4) for key in keys)
        subprocess.run([kcat, "-P", "-b", kafka_config["bootstrap.servers"], "-t", topic, "-K:", "-z", "none",
                        "-X", "partitioner=murmur2_random"], input=lines, text=True, check=True, timeout=60)

    write(0)
    admin.add_partitions(topic, 4)
    write(1)
    records = sorted(read_topic(kafka_config, topic, len(keys) * 8), key=lambda r: r.timestamp()[1])
    ids: dict[str, list[str]] = {key: [] for key in keys}
    for record in sorted(records, key=lambda r: (r.value().split(b":")[1], r.value().split(b":")[2])):
        ids[record.key().decode()].append(str(sequence_number(record.partition(), record.offset())))
    checker = DeliveryChecker()
    expect_all(checker, ids)
    with Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(
            name, recording(checker, "s1", slow_ack(0.005)), max_workers=8):
        wait_until(lambda: checker.acked_count() == checker.total(), 60, "every message acked")
    assert checker.verify() == []


def test_kill_9_of_the_old_partitions_owner_while_moved_keys_wait(
        tmp_path: Path, admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8, SUB-3, SUB-5: subscriber process A holds the first message of every key (its handlers
    do not return) when the topic grows and more is published; B joins and gets some partitions, so
    moved keys wait at B for their old records held at A; A is killed with SIGKILL. B takes over, the
    old records go out again, and each key's new records come after them: nothing lost, no key out
    of order."""
    topic, name = subscription(partitions=2)
    keys = [f"key-{k}" for k in range(20)]
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 3, 0, ids)
    checker = DeliveryChecker()
    expect_all(checker, ids)
    log_a, log_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = WorkerProcess("A", endpoints, name, log_a, "--hold-unless-key", "none", "--workers", "32")
    b: WorkerProcess | None = None
    try:
        wait_until(lambda: len({e["key"] for e in read_events(log_a) if e["action"] == "deliver"}) == len(keys), 60,
                   "A to hold the first message of every key")
        grow_and_publish(admin, kafka_config, topic, keys, 3, ids, checker)
        b = WorkerProcess("B", endpoints, name, log_b, "--delay-ms", "2")
        wait_until(lambda: admin.describe_subscription(name).group_state == "STABLE"
                   and len({row.owner for row in admin.describe_subscription(name).partitions}) == 2, 60,
                   "A and B to share the partitions")
        killed_at = a.kill()
        checker.subscriber_died("A", killed_at)
        wait_until(lambda: len(settled_ids(read_events(log_a, log_b), "A")) == checker.total(), 120,
                   "every message acked")
    finally:
        a.stop()
        if b is not None:
            b.stop()
    events = recorded(checker, log_a, log_b)
    assert checker.verify() == []
    assert any(e["sub"] == "B" and e["attempt"] > 1 for e in events), "B delivered A's held records again"


def test_a_seek_back_across_the_growth_replays_each_moved_key_in_order(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8, GRP-3: a running subscriber is sought back to before a growth: every message counts as
    unacked again, and each moved key's replay goes out in publish order, its messages of before the
    growth (in the old partition) before those of after (in the new one)."""
    topic, name = subscription(partitions=2)
    keys = [f"key-{k}" for k in range(20)]
    before = datetime.now(UTC) - timedelta(seconds=1)
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 3, 0, ids)
    admin.add_partitions(topic, 4)
    publish_round(kafka_config, topic, keys, 3, 1, ids)
    lock = threading.Lock()
    deliveries: list[tuple[str, int]] = []  # ordering key, position in the key's publish order

    def callback(message: Message) -> None:
        _, round_, n = message.data.decode().split(":")
        with lock:
            deliveries.append((message.ordering_key or "", int(round_) * 3 + int(n)))
        message.ack()

    with Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(name, callback, max_workers=4):
        wait_until(lambda: len(deliveries) == len(keys) * 6, 60, "every message delivered once")
        admin.seek(name, time=before)
        wait_until(lambda: len(deliveries) == len(keys) * 12, 60, "every message replayed")
    for key in keys:
        positions = [position for delivered_key, position in deliveries if delivered_key == key]
        assert positions == list(range(6)) * 2, (key, moved(key, 2, 4), positions)


def test_a_parked_moved_key_follows_its_dead_letter_in_order(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]], unique_name: Callable[[str], str]) -> None:
    """SUB-8, DLQ-2 park_key: a moved key's old message is dead-lettered and the key parked; its
    later messages of both sides of the growth follow it into the dead-letter topic in publish order
    (the new ones only after the old ones are settled there), while every other key flows."""
    dlq = unique_name("dlq")
    topic, name = subscription(partitions=2, dead_letter_policy=DeadLetterPolicy(
        dlq, max_delivery_attempts=5, mode="park_key"))
    keys = [f"key-{k}" for k in range(12)]
    poisoned = next(key for key in keys if moved(key, 2, 4))
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 3, 0, ids)
    checker = DeliveryChecker()
    expect_all(checker, ids)
    grown = threading.Event()

    def handler(message: Message) -> str:
        if message.message_id == ids[poisoned][0]:
            grown.wait(60)
            return "nack"
        return "ack"

    with Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(
            name, recording(checker, "s1", handler), max_workers=4):
        grow_and_publish(admin, kafka_config, topic, keys, 3, ids, checker)
        grown.set()
        wait_until(lambda: len(admin.list_dead_letters(name)) == 6, 60, "the poisoned key's messages dead-lettered")
        wait_until(lambda: checker.acked_count() == (len(keys) - 1) * 6, 60, "every other key acked")
    letters = admin.list_dead_letters(name)
    assert [d.message_id for d in letters] == ids[poisoned]
    assert [d.reason for d in letters] == ["MAX_DELIVERY_ATTEMPTS"] + ["PARKED_KEY"] * 5
    assert checker.verify(require_all_settled=False) == []
