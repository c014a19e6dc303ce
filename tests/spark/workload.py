"""A published workload with its ground truth, for the Spark tests.

Messages are published per key in rounds by ``OrderedProducer``, so each key's publish order is
known; half the keys carry caller-chosen message ids (``ol-message-id``), the others get the
sequence number as id. On top come the things order restoring must see through: raw copies of
earlier records (what redrives leave behind), a partition count raised mid-way, unordered
messages, and records of another producer (a plain ``confluent_kafka.Producer``: no ``ol-``
headers, keys that are not UTF-8, malformed ``ol-`` headers, null values, non-UTF-8 header
values), some of them written into two partitions of one key.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

from confluent_kafka import KafkaError, Producer
from confluent_kafka import Message as KafkaMessage

from ordering_layer import Admin, OrderedProducer, PublishResult
from ordering_layer.kafka.partitioner import partition_for
from ordering_layer.record import HEADER_MESSAGE_ID, HeaderPairs, sequence_number
from tests.kafka_helpers import headers_of, read_topic


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        pause.wait(interval)


class Written(NamedTuple):
    """What a reader must see of one message: payload, attributes, where it went."""

    data: bytes
    attributes: dict[str, str]
    partition: int
    offset: int


class Workload:
    """Publishes to ``topic`` and records what a reader must restore.

    Attributes:
        truth: per ordering key (its bytes), the message ids in publish order.
        unordered: ids of the messages written without a key.
        written: per message id, what was written (the first record of the id).
        copies: how many raw copies of earlier records were written.
        records: how many records the topic holds.
        undefined: keys written by the plain producer into two partitions (order undefined).
        malformed: how many records carry malformed ``ol-`` headers.
    """

    def __init__(self, kafka_config: dict[str, Any], admin: Admin, topic: str, *, keys: int,
                 partitions: int) -> None:
        self.kafka_config = kafka_config
        self.admin = admin
        self.topic = topic
        self.partitions = partitions
        self.keys = [f"key-{i:03d}".encode() for i in range(keys)]
        self.truth: dict[bytes, list[str]] = defaultdict(list)
        self.unordered: list[str] = []
        self.written: dict[str, Written] = {}
        self.copies = 0
        self.records = 0
        self.undefined: set[bytes] = set()
        self.malformed = 0
        self._producer = OrderedProducer(kafka_config, settings={"metadata_max_age": 0.5})
        self._plain = Producer(kafka_config)

    def close(self) -> None:
        """Flush and close the producers."""
        self._producer.close()
        assert self._plain.flush(30) == 0

    def _record(self, key: bytes | None, data: bytes, attributes: dict[str, str], message_id: str, partition: int,
                offset: int) -> None:
        self.records += 1
        self.written[message_id] = Written(data, attributes, partition, offset)
        if key is None:
            self.unordered.append(message_id)
        else:
            self.truth[key].append(message_id)

    def _message_id(self, key: bytes, number: int) -> str | None:
        """Caller-chosen ids for every other key; the rest get the sequence number."""
        return f"{key.decode()}#{number}" if self.keys.index(key) % 2 == 0 else None

    def _published(self, key: bytes | None, data: bytes, attributes: dict[str, str], result: PublishResult) -> None:
        self._record(key, data, attributes, result.message_id, result.partition, result.offset)

    def _publish(self, key: bytes | None, data: bytes, message_id: str | None = None) -> PublishResult:
        attributes = {"p": data.decode()}
        future = self._producer.publish(self.topic, data, ordering_key=key.decode() if key else None,
                                        attributes=attributes, message_id=message_id)
        result = future.result(timeout=30)
        self._published(key, data, attributes, result)
        return result

    def publish_rounds(self, rounds: int) -> None:
        """Publish ``rounds`` messages per key through the layer, round-robin over the keys."""
        sent = []
        for round_number in range(rounds):
            for key in self.keys:
                number = len(self.truth[key]) + round_number
                data, attributes = key + f":{number}".encode(), {"n": str(number)}
                sent.append((key, data, attributes, self._producer.publish(
                    self.topic, data, ordering_key=key.decode(), attributes=attributes,
                    message_id=self._message_id(key, number))))
        for key, data, attributes, future in sent:
            self._published(key, data, attributes, future.result(timeout=30))

    def publish_unordered(self, count: int) -> None:
        """Publish ``count`` messages without an ordering key (every other one with an id)."""
        for i in range(count):
            number = len(self.unordered)
            self._publish(None, f"unordered:{number}".encode(), f"u#{number}" if i % 2 == 0 else None)

    def raise_partitions(self, total: int) -> None:
        """Add partitions, then publish until the producer routes keys by the new count."""
        self.admin.add_partitions(self.topic, total)
        old, self.partitions = self.partitions, total
        mover = next(k for k in self.keys if partition_for(k, old) != partition_for(k, total))
        wait_until(lambda: self._publish(mover, b"probe").partition == partition_for(mover, total),
                   30, f"the producer to route by {total} partitions")

    def republish(self, every: int, partitioner: str, keyed: bool = True) -> None:
        """Write raw copies (same key, value, headers) of every ``every``-th record published so far
        with a message id header, with a plain producer using ``partitioner``: a redrive."""
        records = read_topic(self.kafka_config["bootstrap.servers"], self.topic, self.records + self.copies)
        with_ids = [ids for ids in self.truth.values()] if keyed else [self.unordered]
        wanted = {i for ids in with_ids for i in ids if "#" in i}
        wanted = set(sorted(wanted)[::every])
        raw = Producer({**self.kafka_config, "partitioner": partitioner})
        for record in sorted(records, key=lambda r: (r.partition(), r.offset())):
            header = headers_of(record).get(HEADER_MESSAGE_ID)
            message_id = header.decode("utf-8", "replace") if header is not None else None
            if message_id in wanted:
                raw.produce(self.topic, record.value(), key=record.key(), headers=record.headers())
                wanted.discard(message_id)
                self.copies += 1
        assert raw.flush(30) == 0

    def produce_plain(self, key: bytes | None, count: int, *, partition: int, value: bytes | None = b"plain",
                      headers: HeaderPairs | None = None, attributes: dict[str, str] | None = None,
                      malformed: bool = False) -> list[str]:
        """Write ``count`` records with a plain ``confluent_kafka.Producer`` (another producer, PUB-7)
        into ``partition``; their message ids are their sequence numbers.

        Args:
            key: the record key, any bytes (None: unordered).
            value: the value (None: a tombstone, read as an empty payload).
            headers: the record headers as written; ``attributes`` what a reader must make of them.
            malformed: the headers hold malformed ``ol-`` values (counted in ``malformed``).

        Returns:
            The message ids.
        """
        reports: list[KafkaMessage] = []

        def delivered(err: KafkaError | None, msg: KafkaMessage) -> None:
            assert err is None, err
            reports.append(msg)

        for _ in range(count):
            self._plain.produce(self.topic, value, key=key, partition=partition, headers=list(headers or []),
                                on_delivery=delivered)
            assert self._plain.flush(30) == 0  # one at a time: the truth is the write order
        if key is not None and key in self.truth and any(
                self.written[i].partition != partition for i in self.truth[key]):
            self.undefined.add(key)
        ids = []
        for msg in reports:
            message_id = str(sequence_number(msg.partition(), msg.offset()))
            self._record(key, value or b"", attributes or {}, message_id, msg.partition(), msg.offset())
            ids.append(message_id)
        self.malformed += count if malformed else 0
        return ids
