"""A published workload with its ground truth, for the Spark tests.

Messages are published per key in rounds by ``OrderedProducer``, so each key's publish order is
known. On top come the things order restoring must see through: raw copies of earlier records
(what publisher retries and redrives leave behind), a partition count raised mid-way, unordered
messages, and undecodable records.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer
from ordering_layer.envelope import HEADER_MESSAGE_ID, encode_envelope, make_headers

from ordering_layer import Admin, OrderedProducer, PublishResult
from ordering_layer.publisher.partitioner import partition_for
from tests.kafka_helpers import headers_of, read_topic


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        pause.wait(interval)


class Workload:
    """Publishes to ``topic`` and records what a reader must restore.

    Attributes:
        truth: per ordering key, the message ids in publish order.
        unordered: ids of the messages published without a key.
        expected_gaps: ids of messages that follow an undecodable record of their key.
        undecodable: how many undecodable records were written.
        copies: how many raw copies of earlier records were written.
        published: per message id, the data and attributes it was published with.
    """

    def __init__(self, kafka_config: dict[str, Any], admin: Admin, topic: str, *, keys: int,
                 partitions: int) -> None:
        self.kafka_config = kafka_config
        self.admin = admin
        self.topic = topic
        self.partitions = partitions
        self.keys = [f"key-{i:03d}" for i in range(keys)]
        self.truth: dict[str, list[str]] = defaultdict(list)
        self.unordered: list[str] = []
        self.expected_gaps: set[str] = set()
        self.undecodable = 0
        self.copies = 0
        self.published: dict[str, tuple[bytes, dict[str, str]]] = {}
        self._gap_pending: set[str] = set()
        self._records = 0
        self._producer = OrderedProducer(kafka_config, settings={"metadata_max_age": 0.5})

    def close(self) -> None:
        """Flush and close the producer."""
        self._producer.close()

    def _record(self, key: str | None, payload: bytes, attributes: dict[str, str], published: PublishResult) -> None:
        self._records += 1
        self.published[published.message_id] = (payload, attributes)
        if key is None:
            self.unordered.append(published.message_id)
            return
        self.truth[key].append(published.message_id)
        if key in self._gap_pending:
            self._gap_pending.discard(key)
            self.expected_gaps.add(published.message_id)

    def _publish(self, key: str | None, payload: bytes) -> PublishResult:
        attributes = {"p": payload.decode()}
        published = self._producer.publish(self.topic, payload, ordering_key=key, attributes=attributes)
        result = published.result(timeout=30)
        self._record(key, payload, attributes, result)
        return result

    def publish_rounds(self, rounds: int, keys: list[str] | None = None) -> None:
        """Publish ``rounds`` messages per key, round-robin over the keys."""
        chosen = keys or self.keys
        sent = []
        for round_number in range(rounds):
            for key in chosen:
                number = len(self.truth[key]) + round_number
                payload, attributes = f"{key}:{number}".encode(), {"n": str(number)}
                sent.append((key, payload, attributes, self._producer.publish(
                    self.topic, payload, ordering_key=key, attributes=attributes)))
        for key, payload, attributes, future in sent:
            self._record(key, payload, attributes, future.result(timeout=30))

    def publish_unordered(self, count: int) -> None:
        """Publish ``count`` messages without an ordering key."""
        for i in range(count):
            self._publish(None, f"unordered:{len(self.unordered) + i}".encode())

    def raise_partitions(self, total: int) -> None:
        """Add partitions, then publish until the producer routes keys by the new count."""
        self.admin.add_partitions(self.topic, total)
        old, self.partitions = self.partitions, total
        mover = next(k for k in self.keys if partition_for(k.encode(), old) != partition_for(k.encode(), total))
        wait_until(lambda: self._publish(mover, b"probe").partition == partition_for(mover.encode(), total),
                   30, f"the producer to route by {total} partitions")

    def republish(self, every: int, partitioner: str, keyed: bool = True) -> None:
        """Write raw copies (same key, value, headers) of every ``every``-th record published so far,
        with a plain producer using ``partitioner``: a publisher retry or a redrive."""
        records = read_topic(self.kafka_config["bootstrap.servers"], self.topic, self._records + self.undecodable
                             + self.copies)
        wanted = ({i for ids in self.truth.values() for i in ids[::every]} if keyed else set(self.unordered[::every]))
        raw = Producer({**self.kafka_config, "partitioner": partitioner})
        for record in sorted(records, key=lambda r: (r.partition(), r.offset())):
            message_id = headers_of(record).get(HEADER_MESSAGE_ID)
            if message_id is not None and message_id.decode() in wanted:
                raw.produce(self.topic, record.value(), key=record.key(), headers=record.headers())
                wanted.discard(message_id.decode())
                self.copies += 1
        assert raw.flush(30) == 0

    def inject_undecodable(self, key: str | None, kind: str) -> None:
        """Write an undecodable record. ``kind``: ``bad-value`` (headers fine, value not an envelope),
        ``no-headers`` (a valid value without the layer's headers), ``bad-key`` (key not UTF-8).
        A record with a readable key goes to the key's current partition; its key's next message is
        then expected to follow a gap."""
        value = encode_envelope(b"lost", {})
        headers: list[tuple[str, bytes]] = []
        record_key = key.encode() if key is not None else None
        if kind == "bad-value":
            value += b"\xde\xad"
            headers = make_headers(f"lost-{uuid.uuid4().hex[:8]}", self.partitions)
        elif kind == "bad-key":
            record_key = b"\xff\xfe" + (record_key or b"")
        elif kind != "no-headers":
            raise ValueError(kind)
        produce: dict[str, Any] = {"headers": headers}
        if record_key is not None:
            produce["key"] = record_key
        if key is not None and kind != "bad-key":
            produce["partition"] = partition_for(record_key, self.partitions)
            self._gap_pending.add(key)
        raw = Producer(self.kafka_config)
        raw.produce(self.topic, value, **produce)
        assert raw.flush(30) == 0
        self.undecodable += 1
