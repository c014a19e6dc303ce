"""The demo job (``ordering-layer demo``, ``make demo``): publish over many keys and prove the order.

It publishes a per-key numbered workload with ``OrderedProducer``, reads the topic back with a
plain confluent-kafka consumer, and checks and prints what the contract promises: every key in one
partition, in publish order, with sequence numbers ``partition << 48 | offset``.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from ordering_layer.admin import Admin
from ordering_layer.envelope import decode_record
from ordering_layer.publisher import OrderedProducer, PublishResult
from ordering_layer.stack import Endpoints


def run(endpoints: Endpoints, *, messages: int, keys: int, partitions: int,
        out: Callable[[str], None] = print) -> bool:
    """Run the demo against ``endpoints``; print as it goes; return True when every check held."""
    kafka = {"bootstrap.servers": endpoints.bootstrap}
    topic = f"demo-orders-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    Admin(kafka).create_topic(topic, partitions=partitions)
    out(f"== ordering-layer demo on Kafka {endpoints.bootstrap}, Redis {endpoints.redis_url}")
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

    received = _read_back(endpoints.bootstrap, topic, messages)
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
    for text, ok in checks:
        out(f"[{'ok' if ok else 'FAILED'}] {text}")
    return all(ok for _, ok in checks)


def _read_back(bootstrap: str, topic: str, expected: int) -> list[tuple[int, int, str, int]]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"demo-reader-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        rows: list[tuple[int, int, str, int]] = []
        deadline = time.monotonic() + 60
        while len(rows) < expected and time.monotonic() < deadline:
            for record in consumer.consume(1000, 0.5):
                if record.error() is not None:
                    continue
                decoded = decode_record(record.key(), record.value(), record.headers())
                partition, offset = record.partition(), record.offset()
                assert partition is not None and offset is not None and decoded.ordering_key is not None
                rows.append((partition, offset, decoded.ordering_key, int(decoded.attributes["n"])))
        rows.sort()
        return rows
    finally:
        consumer.close()
