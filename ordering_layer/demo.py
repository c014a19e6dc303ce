"""The demo job (``ordering-layer demo``, ``make demo``): publish over many keys and prove the order.

It publishes a per-key numbered workload with ``OrderedProducer``, reads the topic back with a
plain confluent-kafka consumer (plain Kafka records: key = ordering key, value = payload, headers =
attributes; every key in one partition, in publish order, sequence numbers
``partition << 48 | offset``), consumes it through an ordered subscription that nacks some
messages (per-key order with cascade redelivery, nothing lost), and lets Spark restore the
per-key order from the same topic.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from ordering_layer.admin import Admin
from ordering_layer.config import DeadLetterPolicy, RetryPolicy
from ordering_layer.publisher import OrderedProducer, PublishResult
from ordering_layer.record import attributes_of
from ordering_layer.stack import Endpoints
from ordering_layer.state.client import mask_url
from ordering_layer.subscriber import Message, Subscriber


def run(endpoints: Endpoints, *, messages: int, keys: int, partitions: int,
        out: Callable[[str], None] = print, spark: bool = True) -> bool:
    """Run the demo against ``endpoints``; print as it goes; return True when every check held."""
    kafka = {"bootstrap.servers": endpoints.bootstrap}
    topic = f"demo-orders-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    Admin(kafka).create_topic(topic, partitions=partitions)
    out(f"== ordering-layer demo on Kafka {endpoints.bootstrap}, Redis {mask_url(endpoints.redis_url)}")
    out(f"topic {topic}: {partitions} partitions, broker append time")

    start = time.perf_counter()
    futures: list[tuple[str, int, Future[PublishResult]]] = []
    with OrderedProducer(kafka) as producer:
        for n in range(messages):
            key = f"customer-{n % keys}"
            number = n // keys
            futures.append((key, number, producer.publish(topic, f"{key} event {number}".encode(),
                                                         ordering_key=key, attributes={"n": str(number)})))
    results = [(key, number, future.result()) for key, number, future in futures]
    elapsed = time.perf_counter() - start
    out(f"published {messages} messages over {keys} ordering keys in {elapsed:.2f} s "
        f"({messages / elapsed:,.0f} msg/s, idempotent, acks=all)")

    received, sample = _read_back(endpoints.bootstrap, topic, messages)
    out("a record as any Kafka client reads it (key = ordering key, value = payload, headers = attributes):")
    out(f"  {sample}")
    out(f"  see them with kcat: kcat -C -b {endpoints.bootstrap} -t {topic} -c 3 -e "
        "-f 'partition %p offset %o key %k value %s headers %h\\n'")
    per_key: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for partition, offset, key, number in received:
        per_key[key].append((partition, offset, number))
    in_order = sum(1 for rows in per_key.values() if [r[2] for r in rows] == list(range(len(rows))))
    one_partition = sum(1 for rows in per_key.values() if len({r[0] for r in rows}) == 1)
    expected = {key: number for key, number, _ in results}
    complete = all(len(per_key[key]) == last + 1 for key, last in expected.items())
    sequence_ok = all(r.sequence_number == (r.partition << 48) | r.offset for _, _, r in results)

    load = Counter(partition for partition, _, _, _ in received)
    out("records per partition: " + ", ".join(f"p{p}={load[p]}" for p in sorted(load)))
    out("sample keys (message number @ sequence number = partition << 48 | offset):")
    for key in sorted(per_key)[:4]:
        rows = per_key[key][:4]
        shown = "  ".join(f"#{n}@{(p << 48) | o}(p{p}:{o})" for p, o, n in rows)
        out(f"  {key:<14} {shown} ...")
    checks = [
        (f"read back {len(received)}/{messages} messages with a plain Kafka consumer", len(received) == messages
         and complete),
        (f"PUB-1 each key in one partition: {one_partition}/{len(per_key)} keys", one_partition == len(per_key)),
        (f"PUB-1 per-key publish order held: {in_order}/{len(per_key)} keys", in_order == len(per_key)),
        ("PUB-3 sequence number = partition << 48 | offset for every publish", sequence_ok),
    ]
    checks.extend(_subscribe(endpoints, topic, expected, out))
    for text, ok in checks:
        out(f"[{'ok' if ok else 'FAILED'}] {text}")
    if spark:
        checks.append(_spark_step(endpoints, topic, out))
    return all(ok for _, ok in checks)


def _subscribe(endpoints: Endpoints, topic: str, last_number: dict[str, int],
               out: Callable[[str], None]) -> list[tuple[str, bool]]:
    """An ordered subscription with random nacks: per-key order, cascades, nothing lost."""
    name = f"{topic}-billing"
    admin = Admin({"bootstrap.servers": endpoints.bootstrap}, redis_url=endpoints.redis_url)
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0),
                              dead_letter_policy=DeadLetterPolicy(f"{name}.dlq", max_delivery_attempts=5))
    total = sum(last + 1 for last in last_number.values())
    lock = threading.Lock()
    delivered: dict[str, list[int]] = defaultdict(list)
    acked: set[tuple[str, int]] = set()
    nacks = 0
    done = threading.Event()
    chooser = random.Random(7)

    def callback(message: Message) -> None:
        nonlocal nacks
        number = int(message.attributes["n"])
        with lock:
            delivered[message.ordering_key].append(number)
            nack = message.delivery_attempt == 1 and chooser.random() < 0.01
            nacks += nack
        if nack:
            message.nack()
            return
        message.ack()
        with lock:
            acked.add((message.ordering_key, number))
            if len(acked) == total:
                done.set()

    out(f"subscribing to {name}: ordering on, 1 % of first deliveries nacked (cascade redelivery)")
    start = time.perf_counter()
    with Subscriber({"bootstrap.servers": endpoints.bootstrap}, redis_url=endpoints.redis_url).subscribe(
            name, callback, max_workers=16):
        done.wait(300)
    elapsed = time.perf_counter() - start
    redeliveries = sum(len(numbers) for numbers in delivered.values()) - total
    forward_or_restart = all(
        all(b == a + 1 or b <= a for a, b in itertools.pairwise(numbers)) for numbers in delivered.values())
    out(f"received {len(acked)}/{total} acked in {elapsed:.1f} s ({total / elapsed:,.0f} msg/s), "
        f"{nacks} nacks caused {redeliveries} redeliveries")
    example = next((k for k, numbers in delivered.items() if any(b <= a for a, b in itertools.pairwise(numbers))),
                   None)
    if example is not None:
        out(f"  cascade example {example}: delivered in order " + " ".join(map(str, delivered[example][:12])))
    return [
        (f"SUB-3 every message acked: {len(acked)}/{total}", len(acked) == total),
        ("SUB-1/SUB-4 each key moved forward one message at a time, restarting only at a nack",
         forward_or_restart),
    ]


def _spark_step(endpoints: Endpoints, topic: str, out: Callable[[str], None]) -> tuple[str, bool]:
    """Spark reads the same topic with its Kafka source and restores per-key order (SPK-1, SPK-2)."""
    try:
        from ordering_layer.spark import demo_step  # needs pyspark: the optional spark extra
    except ImportError as exc:
        out(f"[skipped] Spark step: {exc} (install the 'spark' extra)")
        return ("Spark step skipped", True)
    ok = bool(demo_step(endpoints, topic, out=out))
    return ("SPK-2 Spark restored per-key order", ok)


def _read_back(bootstrap: str, topic: str, expected: int) -> tuple[list[tuple[int, int, str, int]], str]:
    """Read the topic with a plain confluent-kafka consumer: (partition, offset, key, n) rows, sorted,
    and one record shown as that consumer sees it."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"demo-reader-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        rows: list[tuple[int, int, str, int]] = []
        sample = ""
        deadline = time.monotonic() + 60
        while len(rows) < expected and time.monotonic() < deadline:
            for record in consumer.consume(1000, 0.5):
                if record.error() is not None:
                    continue
                key, value, headers = record.key(), record.value(), record.headers()
                partition, offset = record.partition(), record.offset()
                assert partition is not None and offset is not None and key is not None
                if not sample:
                    sample = f"key={key!r} value={value!r} headers={headers!r}"
                rows.append((partition, offset, key.decode(), int(attributes_of(headers)["n"])))
        rows.sort()
        return rows, sample
    finally:
        consumer.close()
