"""The ordered subscriber against the real broker and Redis (SUB-1..SUB-7, ACK-4, ACK-5, GRP-1, GRP-2)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from ordering_layer import (
    AckResponse,
    Admin,
    FlowControl,
    Message,
    OrderedConsumer,
    OrderedProducer,
    StartPosition,
    Subscriber,
)
from ordering_layer.errors import ConfigError, SubscriptionExistsError, SubscriptionNotFoundError
from ordering_layer.kafka.partitioner import partition_for
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.client import redis_client
from ordering_layer.state.store import (
    KEEP_FIELD,
    Op,
    OpKind,
    OpLetter,
    cascades_key,
    offset_fields,
    partition_keys,
)
from tests.checker import DeliveryChecker, wait_until
from tests.integration.conftest import publish_keys, pull_until, recording_callback

pytestmark = pytest.mark.integration


def offset_values(fields: dict[bytes, bytes]) -> dict[int, int]:
    """An attempts or leases hash as offset -> value (its keeping field left out)."""
    return {int(k): int(v) for k, v in fields.items() if k != KEEP_FIELD.encode()}

def test_in_key_order_many_keys_and_partitions(kafka_config: dict[str, Any], endpoints: Any,
                                               subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-1, SUB-3, SUB-4, SUB-5: 4,000 messages over 200 keys and 4 partitions arrive in per-key
    order, one outstanding message per key, each acked exactly once, no redelivery without a nack."""
    topic, name = subscription(partitions=4)
    checker = publish_keys(kafka_config, topic, keys=200, per_key=20)
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1"), max_workers=8):
        wait_until(lambda: checker.acked_count() == checker.total(), 120, "all messages acked")
    assert checker.verify() == []
    assert len(checker.deliveries()) == checker.total()


def test_slow_key_does_not_block_other_keys(kafka_config: dict[str, Any], endpoints: Any,
                                            subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-2: one slow key in the same (single) partition does not delay the other keys."""
    topic, name = subscription(partitions=1)
    checker = publish_keys(kafka_config, topic, keys=20, per_key=10)
    release = threading.Event()

    def handler(message: Message) -> str:
        if message.ordering_key == "key-0":
            release.wait(60)
        return "ack"

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1", handler), max_workers=4):
        others = checker.total() - 10
        wait_until(lambda: checker.acked_count() >= others, 60, "every other key done while key-0 is stuck")
        assert {e.key for e in checker.deliveries()} >= {f"key-{k}" for k in range(20)}
        assert [e.index for e in checker.deliveries("key-0")] == [0]
        release.set()
        wait_until(lambda: checker.acked_count() == checker.total(), 60, "key-0 finished")
    assert checker.verify() == []


def test_a_backlog_over_partitions_keeps_every_key_going(kafka_config: dict[str, Any], endpoints: Any,
                                                        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-2 with a backlog: 100 keys over 6 partitions, 100,000 small messages published before
    the subscriber starts, a 5 ms coroutine per message, so every key goes at the same pace.
    - Every key gets its first message before any key has had 50 acked: the fetch does not fill
      the subscriber's buffer with the first partitions' records while the later partitions' keys
      wait (with 1 MiB per partition and fetch they started in waves, after the first keys' 110th
      to 300th message).
    - When the first key has all its 1,000 acked, every key has at least 770: the keys of a
      partition drained first do not wait long while the buffer is full of the other partitions'
      records (with a buffer of 20,000 records, 20 keys ended 2 s after the others, at 661-695;
      with 40,000, 846-978)."""
    topic, name = subscription(partitions=6)
    keys = [f"key-{k}" for k in range(100)]
    per_key = 1000
    with OrderedProducer(kafka_config) as producer:
        for n in range(per_key * len(keys)):
            producer.produce(topic, b"x" * 100, key=keys[n % len(keys)])
    acked: dict[str, int] = dict.fromkeys(keys, 0)
    most_acked_at_first: dict[str, int] = {}  # key: the most any key had acked at its first delivery
    least_at_first_done: list[int] = []  # the fewest any key had acked when the first key was done

    async def callback(message: Message) -> None:
        key = message.ordering_key
        if key not in most_acked_at_first:
            most_acked_at_first[key] = max(acked.values())
        await asyncio.sleep(0.005)
        acked[key] += 1
        message.ack()
        if acked[key] == per_key and not least_at_first_done:
            least_at_first_done.append(min(acked.values()))

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, callback, flow_control=FlowControl(max_messages=1000)):
        wait_until(lambda: sum(acked.values()) >= per_key * len(keys), 180, "every message acked")
    late = {key: most for key, most in most_acked_at_first.items() if most >= 50}
    assert late == {}, f"keys first delivered after another key had 50 or more acked: {late}"
    assert least_at_first_done[0] >= 770, f"a key had {least_at_first_done[0]} acked when the first was done"


def test_a_partition_behind_a_backlog_of_another_gets_its_records_at_once(kafka_config: dict[str, Any],
                                                                          endpoints: Any,
                                                                          subscription: Callable[..., tuple[str, str]]
                                                                          ) -> None:
    """SUB-2 across partitions: partition 0 holds a backlog larger than the subscriber's buffer, its 7
    keys slow (20 ms a message, ~350 msg/s in all), so the buffer stays full and the fetch held;
    messages then published to partition 1 are delivered within seconds, not after the buffer drained
    under its resume mark (8,000 records: ~23 s here). With one queue for all partitions they came
    behind the backlog's prefetched records; now partition 1 is short of records and takes its share
    while the others' buffer holds the fetch."""
    topic, name = subscription(partitions=2)
    slow_keys = [key for key in (f"slow-{k}" for k in range(200)) if partition_for(key.encode(), 2) == 0][:7]
    late_keys = [key for key in (f"late-{k}" for k in range(200)) if partition_for(key.encode(), 2) == 1][:5]
    with OrderedProducer(kafka_config) as producer:
        for n in range(60_000):
            producer.produce(topic, b"x" * 100, key=slow_keys[n % len(slow_keys)])
    delivered: dict[str, float] = {}

    async def callback(message: Message) -> None:
        key = message.ordering_key or ""
        if key.startswith("late"):
            delivered.setdefault(f"{key}:{message.data.decode()}", time.monotonic())
        else:
            await asyncio.sleep(0.02)
        message.ack()

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, callback) as handle:
        engine = handle.engine
        wait_until(lambda: engine.stats()["fetch_held"] == 1 and engine.stats()["buffered"] >= 32_000, 60,
                   "the buffer full of partition 0's backlog")
        published = time.monotonic()
        with OrderedProducer(kafka_config) as producer:
            for n in range(20):
                producer.produce(topic, str(n).encode(), key=late_keys[n % len(late_keys)])
        wait_until(lambda: len(delivered) == 20, 60, "partition 1's messages delivered")
        waited = max(delivered.values()) - published
        backlog_left = engine.stats()["buffered"]
    assert waited < 5.0, f"partition 1's messages waited {waited:.1f} s behind partition 0's backlog"
    assert backlog_left >= 20_000  # the backlog was still there: they did not just come after it


def test_a_new_owner_skips_what_the_floor_in_redis_says_was_acked(kafka_config: dict[str, Any], endpoints: Any,
                                                                 admin: Admin,
                                                                 subscription: Callable[..., tuple[str, str]]) -> None:
    """ACK-4, SUB-3: each flush writes the partition's commit point to Redis as its floor, and the
    settled set keeps only what is settled above it. A new owner whose Kafka commit lags the floor
    (its predecessor crashed after a flush and before its next commit) skips the records below the
    floor instead of delivering them again, and commits past them."""
    topic, name = subscription(partitions=1)
    checker = publish_keys(kafka_config, topic, keys=10, per_key=5)
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    settled_key = partition_keys(name, 0)[1]
    client = redis_client(endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1"), max_workers=4):
        wait_until(lambda: checker.acked_count() == checker.total(), 60, "all messages acked")
        wait_until(lambda: client.zscore(settled_key, "_") == checker.total(), 30, "the floor in Redis")
        assert offset_fields(client.zrange(settled_key, 0, -1)) == []  # nothing settled above it
    assert checker.verify() == []
    # The predecessor's last commits are lost: Kafka's committed offset goes back to the start.
    kafka_admin = AdminClient(dict(kafka_config))
    [future] = kafka_admin.alter_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(name, [TopicPartition(topic, 0, 0)])]).values()
    future.result(30)
    assert admin.describe_subscription(name).partitions[0].committed == 0
    delivered: list[int] = []

    def record_offset(message: Message) -> None:
        delivered.append(message.offset())
        message.ack()

    with subscriber.subscribe(name, record_offset, max_workers=4):
        wait_until(lambda: admin.describe_subscription(name).partitions[0].committed == checker.total(), 60,
                   "the new owner commits past the floor")
    assert delivered == []


def test_nack_cascades_and_other_keys_are_not_redelivered(kafka_config: dict[str, Any], endpoints: Any,
                                                          subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-4: pulled batches of a key acked after a nack of an earlier message come again, in order;
    other keys are not redelivered (pull mode: one outstanding batch per key)."""
    topic, name = subscription(partitions=1)
    checker = publish_keys(kafka_config, topic, keys=3, per_key=5)
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        batch = pull_until(subscriber, name, 15)
        by_key: dict[str, list[Message]] = {}
        for message in batch:
            by_key.setdefault(message.ordering_key, []).append(message)
            checker.record(message.message_id, "s1", message.delivery_attempt, "deliver")
        assert all([int(m.data.split(b":")[1]) for m in ms] == list(range(5)) for ms in by_key.values())
        # key-0: ack 2, 3, 4, nack 1, ack 0 -> 1..4 come again in order, acked ones included.
        k0 = by_key["key-0"]
        for index in (2, 3, 4):
            assert k0[index].ack_with_response().result(10) == AckResponse.SUCCESS
            checker.record(k0[index].message_id, "s1", 1, "ack")
        k0[1].nack()
        checker.record(k0[1].message_id, "s1", 1, "nack")
        k0[0].ack()
        checker.record(k0[0].message_id, "s1", 1, "ack")
        for key in ("key-1", "key-2"):
            for message in by_key[key]:
                message.ack()
                checker.record(message.message_id, "s1", 1, "ack")
        again = pull_until(subscriber, name, 4)
        assert [(m.ordering_key, int(m.data.split(b":")[1]), m.delivery_attempt) for m in again] == [
            ("key-0", 1, 2), ("key-0", 2, 2), ("key-0", 3, 2), ("key-0", 4, 2)]
        stale = k0[3].ack_with_response().result(10)
        assert stale == AckResponse.INVALID_ACK_ID
        for message in again:
            checker.record(message.message_id, "s1", message.delivery_attempt, "deliver")
            message.ack()
            checker.record(message.message_id, "s1", message.delivery_attempt, "ack")
        assert subscriber.pull(name, max_messages=100, timeout=1.0) == []
    assert checker.verify(one_outstanding=False) == []


def test_unordered_subscription_flows_in_parallel(kafka_config: dict[str, Any], endpoints: Any,
                                                  subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-6: with ordering disabled a key's messages are outstanding together; all are acked."""
    topic, name = subscription(partitions=2, enable_message_ordering=False)
    checker = publish_keys(kafka_config, topic, keys=2, per_key=30)
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        pulled = pull_until(subscriber, name, 60)
        per_key = {m.ordering_key for m in pulled}
        assert per_key == {"key-0", "key-1"}
        for message in pulled:
            message.ack()
            checker.record(message.message_id, "s1", 1, "deliver")
            checker.record(message.message_id, "s1", 1, "ack")
    assert checker.verify(one_outstanding=False) == []


def test_flow_control_bounds_outstanding(kafka_config: dict[str, Any], endpoints: Any,
                                         subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-7: never more than max_messages outstanding; everything still arrives."""
    topic, name = subscription(partitions=2, enable_message_ordering=False)
    checker = publish_keys(kafka_config, topic, keys=50, per_key=20)
    outstanding = 0
    peak = 0
    lock = threading.Lock()
    release = threading.Semaphore(0)

    def callback(message: Message) -> None:
        nonlocal outstanding, peak
        with lock:
            outstanding += 1
            peak = max(peak, outstanding)
        release.acquire(timeout=10)
        checker.record(message.message_id, "s1", 1, "deliver")
        with lock:
            outstanding -= 1
        checker.record(message.message_id, "s1", 1, "ack")
        message.ack()

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, callback, flow_control=FlowControl(max_messages=7), max_workers=20) as handle:
        wait_until(lambda: handle.engine.stats()["outstanding"] == 7, 30, "7 outstanding")
        for _ in range(checker.total()):
            release.release()
        wait_until(lambda: checker.acked_count() == checker.total(), 60, "all acked")
    assert peak <= 7


def test_partitions_assigned_while_the_fetch_is_paused_join_the_pause(kafka_config: dict[str, Any], endpoints: Any,
                                                                    subscription: Callable[..., tuple[str, str]]
                                                                    ) -> None:
    """SUB-7: partitions assigned to a subscriber whose fetch is paused (over its flow-control limit)
    join the pause from their assignment on: no record of them is taken while over the limit (paused
    in the consumer through consume(); with the native fetch, left in librdkafka's queues); and when
    the limit clears they are taken with the rest, so every message is delivered, each key in order."""
    topic, name = subscription(partitions=4)
    fast = {**kafka_config, "session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
    unblock = threading.Event()
    declared = threading.Event()  # messages come while publish_keys runs; it declares them at its end
    checker = DeliveryChecker()

    def blocked(message: Message) -> str:
        unblock.wait(120)
        return "ack"

    def recording(subscriber: str, handler: Callable[[Message], str] | None = None) -> Callable[[Message], None]:
        callback = recording_callback(checker, subscriber, handler)

        def once_declared(message: Message) -> None:
            declared.wait(60)
            callback(message)

        return once_declared

    other = Subscriber(fast, redis_url=endpoints.redis_url).subscribe(name, recording("s2"), max_workers=4)
    first = None
    try:
        wait_until(lambda: len(other.engine.assigned_partitions()) == 4, 60, "the other subscriber's assignment")
        first = Subscriber(fast, redis_url=endpoints.redis_url).subscribe(
            name, recording("s1", blocked), flow_control=FlowControl(max_messages=5), max_workers=5)
        wait_until(lambda: len(first.engine.assigned_partitions()) == 2, 60, "a 2/2 split")
        publish_keys(kafka_config, topic, keys=40, per_key=5, checker=checker, prefix="before")
        declared.set()
        wait_until(lambda: first.engine.stats()["fetch_paused"] == 1, 60, "the first subscriber's fetch paused")
        other.cancel()
        wait_until(lambda: len(first.engine.assigned_partitions()) == 4, 60, "all partitions at the first")
        buffered = first.engine.stats()["buffered"]
        publish_keys(kafka_config, topic, keys=40, per_key=5, checker=checker, prefix="after")
        watch_until = time.monotonic() + 3.0  # a window to see that nothing is fetched, not a wait
        while time.monotonic() < watch_until:
            stats = first.engine.stats()
            assert (stats["fetch_paused"], stats["buffered"]) == (1, buffered)
            time.sleep(0.05)
        unblock.set()
        wait_until(lambda: checker.acked_count() == checker.total(), 120, "every message acked")
    finally:
        declared.set()
        unblock.set()
        other.cancel()
        if first is not None:
            first.cancel()
    assert checker.verify() == []
    assert checker.verify(one_outstanding=False) == []


def test_ordered_consumer_drop_in(kafka_config: dict[str, Any], endpoints: Any, topic_factory: Callable[..., str],
                                  unique_name: Callable[[str], str]) -> None:
    """SUB-1, DRP-2: the confluent-kafka shaped OrderedConsumer polls per-key ordered messages with acks;
    a new group starts where ``auto.offset.reset`` says (earliest here; confluent's default is latest).
    Acked one by one and never committed, the messages are not kept by the consumer."""
    topic = topic_factory(partitions=2)
    checker = publish_keys(kafka_config, topic, keys=5, per_key=8)
    consumer = OrderedConsumer({**kafka_config, "group.id": unique_name("group"), "auto.offset.reset": "earliest",
                                "enable.auto.commit": False}, redis_url=endpoints.redis_url)
    consumer.subscribe([topic])
    try:
        deadline = time.monotonic() + 60
        while checker.acked_count() < checker.total() and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None and msg.topic() == topic and msg.key() == msg.ordering_key.encode()
            checker.record(msg.message_id, "c1", msg.delivery_attempt, "deliver")
            checker.record(msg.message_id, "c1", msg.delivery_attempt, "ack")
            msg.ack()
            assert len(consumer._returned) <= 1  # the message just polled: the acked ones are let go
    finally:
        consumer.close()
    assert checker.verify() == []


def test_redis_flushed_mid_stream_loses_nothing(restartable: Any, kafka_config: dict[str, Any], endpoints: Any,
                                                subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-3, ACK-4: total loss of Redis state mid-stream loses no message and keeps per-key order."""
    topic, name = subscription(partitions=3)
    checker = publish_keys(kafka_config, topic, keys=50, per_key=40)
    flushed = threading.Event()

    def handler(message: Message) -> str:
        if checker.acked_count() > checker.total() // 3 and not flushed.is_set():
            flushed.set()
            redis_client(endpoints.redis_url).flushall()
        return "ack"

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1", handler), max_workers=4):
        wait_until(lambda: checker.acked_count() == checker.total(), 120, "all messages acked after the flush")
    assert flushed.is_set()
    assert checker.verify() == []


def test_subscription_settings_and_start_positions(admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
                                                   topic_factory: Callable[..., str],
                                                   unique_name: Callable[[str], str]) -> None:
    """GRP-1, SUB-6: start at TRIM_HORIZON or LATEST; settings validated; ordering fixed at creation."""
    topic = topic_factory(partitions=2)
    publish_keys(kafka_config, topic, keys=4, per_key=5, prefix="old")
    oldest, latest = unique_name("oldest"), unique_name("latest")
    admin.create_subscription(oldest, topic=topic, start=StartPosition.TRIM_HORIZON)
    admin.create_subscription(latest, topic=topic, start=StartPosition.LATEST)
    assert admin.create_subscription(oldest, topic=topic).enable_message_ordering
    with pytest.raises(SubscriptionExistsError):
        admin.create_subscription(oldest, topic=topic, enable_message_ordering=False)
    for bad in ({"ack_deadline": 5}, {"ack_deadline": 601}):
        bad_settings: dict[str, Any] = bad
        with pytest.raises(ConfigError):
            admin.create_subscription(unique_name("bad"), topic=topic, **bad_settings)
    checker = publish_keys(kafka_config, topic, keys=4, per_key=5, prefix="new")
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        got: dict[str, list[Message]] = {oldest: [], latest: []}
        for name, want in ((oldest, 40), (latest, 20)):
            def step(name: str = name, want: int = want) -> bool:
                batch = subscriber.pull(name, 100, 0.5)
                got[name].extend(batch)
                Subscriber.acknowledge(batch)
                return len(got[name]) >= want
            wait_until(step, 60, f"{name} messages")
    assert {m.ordering_key.split("-")[0] for m in got[latest]} == {"new"}
    assert len(got[oldest]) == 40
    assert checker.total() == 20
    described = admin.describe_subscription(oldest)
    assert described.settings.topic == topic
    admin.delete_subscription(latest)
    with pytest.raises(SubscriptionNotFoundError):
        Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(latest, lambda m: None)


def test_commit_on_get_and_batch_ack(admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
                                     subscription: Callable[..., tuple[str, str]]) -> None:
    """GRP-4, GRP-5: with commit_on_get a pull acks what the previous pull returned; a batch can be
    acked explicitly without fetching more."""
    topic, name = subscription(partitions=1)
    publish_keys(kafka_config, topic, keys=2, per_key=2)
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        first: list[Message] = []
        deadline = time.monotonic() + 30
        while not first and time.monotonic() < deadline:
            first = subscriber.pull(name, max_messages=100, timeout=0.5, commit_on_get=True)
        assert len(first) == 4
        assert subscriber.pull(name, max_messages=100, timeout=0.5, commit_on_get=True) == []
        wait_until(lambda: admin.describe_subscription(name).backlog == 0, 30, "first pull committed")
        publish_keys(kafka_config, topic, keys=1, per_key=3, prefix="more")
        batch = pull_until(subscriber, name, 3)
        Subscriber.acknowledge(batch)
        wait_until(lambda: admin.describe_subscription(name).backlog == 0, 30, "batch ack committed")


def test_pullers_sharing_a_subscription_through_rebalances_keep_key_order(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-1, SUB-3, SUB-4, SUB-5, GRP-2, GRP-5 (pull mode): two pullers share a subscription while a
    third joins (it has pulled something: partitions moved) and leaves, twice. Each pulled batch is
    handled for 10 ms and acked, except one first delivery in 40, nacked (with the rest of its key's
    batch, which its nack cascades over). Between pulls each puller has the next pull's messages
    released ahead; when its partitions move they are given back unseen. Every message is acked,
    each key's in order, never held by two pullers at once. The steady pullers wait at a third (then
    two thirds) of the messages acked until the joiner has pulled, so every join finds work left."""
    topic, name = subscription(partitions=6)
    checker = publish_keys(kafka_config, topic, keys=200, per_key=50)
    errors: list[BaseException] = []
    pulled: dict[str, int] = {}
    acked: dict[str, int] = {}  # acks per puller (each entry written by its puller only)
    steady = ("p1", "p2")
    share = [checker.total() // 3]  # how many acks the two steady pullers may reach before the next join

    def puller(tag: str, stop: threading.Event) -> None:
        rng = random.Random(tag)
        try:
            with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
                while not stop.is_set():
                    if tag in steady and sum(acked.values()) >= share[0]:
                        stop.wait(0.01)  # work is left for the joiner: it gets partitions with messages
                        continue
                    batch = subscriber.pull(name, max_messages=25, timeout=0.2)
                    pulled[tag] = pulled.get(tag, 0) + len(batch)
                    for message in batch:
                        checker.record(message.message_id, tag, message.delivery_attempt, "deliver")
                    if batch:
                        stop.wait(0.01)  # the batch's handling
                    nacked: set[str] = set()
                    for message in batch:
                        key = message.ordering_key
                        if key in nacked or (message.delivery_attempt == 1 and rng.random() < 1 / 40):
                            nacked.add(key)
                            checker.record(message.message_id, tag, message.delivery_attempt, "nack")
                            message.nack()
                        else:
                            checker.record(message.message_id, tag, message.delivery_attempt, "ack")
                            message.ack()
                            acked[tag] = acked.get(tag, 0) + 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            errors.append(exc)

    running: list[tuple[threading.Thread, threading.Event]] = []

    def start(tag: str) -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        thread = threading.Thread(target=puller, args=(tag, stop), name=tag, daemon=True)
        thread.start()
        running.append((thread, stop))
        return thread, stop

    def has_pulled(tag: str) -> Callable[[], bool]:
        return lambda: pulled.get(tag, 0) > 0

    total = checker.total()
    try:
        for tag in steady:
            start(tag)
        for turn, joiner_tag in enumerate(("p3", "p4"), start=1):
            wait_until(lambda: checker.acked_count() > 0, 120, "acks before a join")
            joiner, leave = start(joiner_tag)
            wait_until(has_pulled(joiner_tag), 120, f"{joiner_tag} pulled messages")
            share[0] = total * (turn + 1) // 3
            leave.set()
            joiner.join(60)
        wait_until(lambda: checker.acked_count() == total, 120, "all messages acked")
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}: pulled {pulled}, {checker.acked_count()} of {total} acked, "
                             f"errors {errors}") from None
    finally:  # a failed wait stops the pullers too: none outlives the test
        for _, stop in running:
            stop.set()
        for thread, _ in running:
            thread.join(60)
    assert errors == [] and not joiner.is_alive()
    assert checker.verify(one_outstanding=False) == []
    assert checker.acked_count() == total and pulled["p1"] + pulled["p2"] < len(checker.deliveries())


def test_batched_redis_writes_equal_one_by_one(endpoints: Any, unique_name: Callable[[str], str]) -> None:
    """ACK-4, ACK-5, ACK-6: apply.lua sends runs of one command as one call; the state equals applying
    the ops one by one (random op streams, long runs that need several calls, and the epoch fence),
    and a claim reads attempts back with those never seen started apart."""
    store = StateStore(endpoints.redis_url)
    rng = random.Random(3)
    common: list[OpLetter] = [OpKind.DELIVERED, OpKind.LEASE, OpKind.SETTLED, OpKind.NACKED,
                              OpKind.BATCH_DELIVERED, OpKind.BATCH_DELIVERED, OpKind.BATCH_LEASE,
                              OpKind.BATCH_RELEASED, OpKind.STARTED, OpKind.UNSETTLED, OpKind.CASCADE_FROM,
                              OpKind.CASCADE_DONE]
    rare: list[OpLetter] = [OpKind.DELIVERED, OpKind.LEASE, OpKind.SETTLED, OpKind.NACKED, OpKind.FLOOR,
                            OpKind.RELEASED]
    for trial in range(40):
        name = unique_name(f"lua{trial}")
        epoch = store.claim(name, 0).epoch
        settled: set[int] = set()
        floor = -1
        attempts: dict[int, int] = {}
        leases: dict[int, int] = {}
        cascades: set[int] = set()
        for size in (rng.choice([1, 40, 3000]), 2500):
            batch_lease = rng.randrange(1, 10**6)
            ops: list[Op] = [(OpKind.BATCH_LEASE, 0, batch_lease)]
            for _ in range(size):
                kind = rng.choice(rare if rng.random() < 0.05 else common)
                offset, value = rng.randrange(40), rng.randrange(1, 10**6)
                if kind == OpKind.NACKED and rng.random() < 0.5:
                    value = 0  # a lapsed lease: the attempt is not marked started
                if kind == OpKind.SETTLED:
                    value = rng.choice((0, 1))  # 1: the delivery's lease was never written
                if kind == OpKind.BATCH_LEASE:
                    batch_lease = value
                ops.append((kind, offset, value))
                if kind in (OpKind.DELIVERED, OpKind.STARTED):
                    attempts[offset] = value
                elif kind == OpKind.RELEASED:
                    attempts[offset] = -value
                elif kind == OpKind.BATCH_DELIVERED:
                    attempts[offset] = value
                    leases[offset] = batch_lease
                elif kind == OpKind.BATCH_RELEASED:
                    attempts[offset] = -value
                    leases[offset] = batch_lease
                elif kind == OpKind.LEASE:
                    leases[offset] = value
                elif kind == OpKind.SETTLED:
                    settled.add(offset)
                    attempts.pop(offset, None)
                    if value != 1:
                        leases.pop(offset, None)
                elif kind == OpKind.NACKED:
                    leases.pop(offset, None)
                    if value:
                        attempts[offset] = value
                elif kind == OpKind.UNSETTLED:
                    settled.discard(offset)
                elif kind == OpKind.CASCADE_FROM:
                    cascades.add(offset)
                elif kind == OpKind.CASCADE_DONE:
                    cascades.discard(offset)
                elif kind == OpKind.FLOOR:
                    floor = max(floor, value)
            assert store.apply_many([(name, 0, epoch, ops)]) == [ApplyResult.APPLIED]
        keys = partition_keys(name, 0)
        # Below the floor everything counts as settled: the set holds what is settled above it.
        assert {o for o in offset_fields(store.client.zrange(keys[1], 0, -1)) if o >= floor} == {
            o for o in settled if o >= floor}
        stored_floor = store.client.zscore(keys[1], "_")
        assert (-1 if stored_floor is None else int(stored_floor)) == floor
        assert offset_values(store.client.hgetall(keys[2])) == attempts
        assert offset_values(store.client.hgetall(keys[3])) == leases
        # The hashes outlive their last offset (KEEP_FIELD): Redis does not recreate them at each write.
        assert store.client.exists(keys[2], keys[3]) == 2
        assert {int(o) for o in store.client.smembers(cascades_key(name, 0))} == cascades
        claimed = store.claim(name, 0)  # ACK-6: a negative count is an attempt never seen started
        assert claimed.attempts == {o: abs(n) for o, n in attempts.items()}
        assert claimed.unstarted == {o for o, n in attempts.items() if n < 0}
        assert claimed.cascades == cascades  # SUB-4: the marks of a walk ended early reach the successor
        assert claimed.floor == (None if floor < 0 else floor)
    name = unique_name("lua-run")
    epoch = store.claim(name, 0).epoch
    run: list[Op] = [(OpKind.DELIVERED, o, 1) for o in range(5001)] + [(OpKind.LEASE, o, 7) for o in range(5001)]
    run += [(OpKind.SETTLED, o, 0) for o in range(0, 5001, 2)]
    assert store.apply_many([(name, 0, epoch, run)]) == [ApplyResult.APPLIED]
    keys = partition_keys(name, 0)
    assert (len(offset_fields(store.client.hkeys(keys[2]))), len(offset_fields(store.client.hkeys(keys[3]))),
            store.client.zcard(keys[1])) == (2500, 2500, 2501)
    assert store.apply_many([(name, 0, epoch - 1, run)]) == [ApplyResult.FENCED]
