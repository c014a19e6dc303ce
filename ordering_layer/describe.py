"""What ``Admin.describe_subscription`` reports: per partition, the owner, epoch, offsets, backlog,
outstanding messages, oldest unacked age, held and parked keys.

Sources: the Kafka group description (owner), the committed offsets and watermarks (backlog), the
subscription's Redis state (epoch, settled offsets above the committed one, leases, parked keys),
and a short read of the partition from its first unsettled offset (the oldest unacked message's
append time, and the ordering keys of the leased messages).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from ordering_layer.config import SubscriptionSettings
from ordering_layer.kafka.offsets import PartitionOffsets, partition_offsets
from ordering_layer.kafka.partitioner import murmur2
from ordering_layer.kafka_config import connection_settings
from ordering_layer.record import display_key
from ordering_layer.state import StateStore
from ordering_layer.state.counts import moves_key
from ordering_layer.state.store import FLOOR_MEMBER, offset_fields, partition_keys

_LOGGER = logging.getLogger(__name__)

SCAN_LIMIT = 10_000  # records read per partition to find the keys of leased messages


@dataclass(frozen=True)
class PartitionDescription:
    """One partition of a subscription.

    ``oldest_unacked_age`` is Pub/Sub's ``oldest_unacked_message_age``: seconds since the broker
    appended the partition's first unsettled message (the lowest offset neither acked nor
    dead-lettered, delivered or not); None when every message is settled. ``held_keys`` counts the
    ordering keys with a leased (outstanding) message; it is a lower bound when ``held_keys_complete``
    is false (the leased messages lie more than ``SCAN_LIMIT`` records past the first unsettled one).
    ``parked_keys`` counts the subscription's parked keys that the layer's partitioner routes here.
    ``pending_seek`` is the generation of a seek (GRP-3) recorded for the partition that no owner has
    applied yet (0: none). ``moved_keys_held`` counts the keys a growth of the topic moved into the
    partition whose new messages wait for their old partitions (SUB-8), as its owner last reported.
    """

    partition: int
    owner: str | None  # the group member's client id
    owner_host: str | None
    owner_member_id: str | None
    epoch: int | None  # the owner epoch in Redis (None: never claimed)
    committed: int | None
    log_end: int
    backlog: int
    outstanding: int
    oldest_unacked_age: float | None
    held_keys: int
    held_keys_complete: bool
    parked_keys: int
    pending_seek: int = 0
    moved_keys_held: int = 0


@dataclass(frozen=True)
class SubscriptionDescription:
    """A subscription: settings, group state, partitions and parked keys (as text)."""

    name: str
    settings: SubscriptionSettings
    group_state: str
    partitions: tuple[PartitionDescription, ...]
    parked_keys: tuple[str, ...]

    @property
    def topic(self) -> str:
        """The subscription's topic."""
        return self.settings.topic

    @property
    def backlog(self) -> int:
        """Backlog summed over the partitions."""
        return sum(p.backlog for p in self.partitions)

    @property
    def outstanding(self) -> int:
        """Outstanding (leased) messages summed over the partitions."""
        return sum(p.outstanding for p in self.partitions)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (settings as stored, push secrets left out; totals included)."""
        return {"name": self.name, "topic": self.topic, "settings": self.settings.public(),
                "group_state": self.group_state, "backlog": self.backlog, "outstanding": self.outstanding,
                "parked_keys": list(self.parked_keys),
                "partitions": [dataclasses.asdict(p) for p in self.partitions]}


@dataclass(frozen=True)
class _Owner:
    client_id: str
    host: str
    member_id: str


@dataclass
class _RedisState:
    epoch: int | None
    settled: set[int]
    leased: set[int]
    floor: int = -1  # every offset below it is settled (``OpKind.FLOOR``); -1: none kept


@dataclass
class _Scan:
    """What a read of a partition from its first unsettled offset found."""

    start: int
    last_needed: int
    first_timestamp_ms: int | None = None
    keys: set[bytes] = dataclasses.field(default_factory=set)
    read: int = 0
    done: bool = False


def describe_subscription(admin: AdminClient, kafka_config: Mapping[str, Any], store: StateStore, name: str,
                          timeout: float, scan_limit: int = SCAN_LIMIT) -> SubscriptionDescription:
    """Gather a ``SubscriptionDescription`` (see the module doc).

    Raises:
        SubscriptionNotFoundError: no such subscription.
        confluent_kafka.KafkaException: Kafka did not answer the offset queries.
    """
    settings = store.settings(name)
    topic = settings.topic
    consumer = Consumer({"logger": logging.getLogger("ordering_layer.kafka.describe"),
                         **connection_settings(kafka_config), "group.id": name, "enable.auto.commit": False,
                         "auto.offset.reset": "earliest"})
    try:
        metadata = consumer.list_topics(topic, timeout=timeout).topics[topic]
        count = len(metadata.partitions)
        offsets = partition_offsets(consumer, topic, list(range(count)), timeout)
        redis_state = _read_redis(store, name, count)
        seeks = store.seek_status(name, list(range(count)))
        scans = _scan(consumer, topic, offsets, redis_state, timeout, scan_limit)
    finally:
        consumer.close()
    owners, group_state = _owners(admin, name, topic, timeout)
    parked = sorted(store.parked_keys(name))
    moved = {int(p): int(n) for p, n in store.client.hgetall(moves_key(name)).items()}
    parked_in = [(murmur2(key) & 0x7FFFFFFF) % count for key in parked]
    now_ms = time.time() * 1000
    rows = []
    for row in offsets:
        state, scan, owner = redis_state[row.partition], scans.get(row.partition), owners.get(row.partition)
        age = None
        if scan is not None and scan.first_timestamp_ms is not None:
            age = max(0.0, (now_ms - scan.first_timestamp_ms) / 1000)
        rows.append(PartitionDescription(
            partition=row.partition, owner=owner.client_id if owner else None,
            owner_host=owner.host if owner else None, owner_member_id=owner.member_id if owner else None,
            epoch=state.epoch, committed=row.committed, log_end=row.end, backlog=row.backlog,
            outstanding=len(state.leased), oldest_unacked_age=age,
            held_keys=len(scan.keys) if scan else 0, held_keys_complete=scan.done if scan else True,
            parked_keys=parked_in.count(row.partition),
            pending_seek=seeks[row.partition].generation if seeks[row.partition].pending else 0,
            moved_keys_held=moved.get(row.partition, 0)))
    return SubscriptionDescription(name, settings, group_state, tuple(rows), tuple(display_key(k) for k in parked))


def _read_redis(store: StateStore, name: str, count: int) -> dict[int, _RedisState]:
    pipe = store.client.pipeline(transaction=False)
    for partition in range(count):
        epoch, settled, _, leases = partition_keys(name, partition)
        pipe.get(epoch)
        pipe.zrange(settled, 0, -1)
        pipe.zscore(settled, FLOOR_MEMBER)
        pipe.hkeys(leases)
    replies = pipe.execute()
    states = {}
    for p in range(count):
        epoch, settled, floor, leased = replies[4 * p:4 * p + 4]
        states[p] = _RedisState(int(epoch) if epoch is not None else None, set(offset_fields(settled)),
                                set(offset_fields(leased)), int(floor) if floor is not None else -1)
    return states


def _first_unsettled(row: PartitionOffsets, state: _RedisState) -> int:
    offset = row.low if row.committed is None else max(row.committed, row.low)
    offset = max(offset, state.floor)
    while offset in state.settled:
        offset += 1
    return offset


def _scan(consumer: Consumer, topic: str, offsets: list[PartitionOffsets], redis_state: dict[int, _RedisState],
          timeout: float, scan_limit: int) -> dict[int, _Scan]:
    """Read each partition with unsettled messages from its first unsettled offset up to its last
    leased one (at most ``scan_limit`` records): the first record's time, the leased records' keys."""
    scans = {}
    for row in offsets:
        start = _first_unsettled(row, redis_state[row.partition])
        if start < row.end:
            scans[row.partition] = _Scan(start, max(redis_state[row.partition].leased, default=start))
    if not scans:
        return scans
    consumer.assign([TopicPartition(topic, p, scan.start) for p, scan in scans.items()])
    deadline = time.monotonic() + timeout
    pending = set(scans)
    while pending and time.monotonic() < deadline:
        try:
            records = consumer.consume(500, 0.2)
        except KafkaException as exc:
            _LOGGER.warning("reading %s for describe: %s", topic, exc.args[0])
            break
        for record in records:
            partition, offset = record.partition(), record.offset()
            if record.error() is not None or partition not in pending or offset is None:
                continue
            scan = scans[partition]
            if scan.first_timestamp_ms is None:
                scan.first_timestamp_ms = record.timestamp()[1]
            key = record.key()
            if key and offset in redis_state[partition].leased:
                scan.keys.add(key if isinstance(key, bytes) else key.encode())
            scan.read += 1
            if offset >= scan.last_needed or scan.read >= scan_limit:
                scan.done = offset >= scan.last_needed
                pending.discard(partition)
    return scans


def _owners(admin: AdminClient, name: str, topic: str, timeout: float) -> tuple[dict[int, _Owner], str]:
    """Partition -> the member owning it, and the group's state, from the group description."""
    try:
        group = admin.describe_consumer_groups([name], request_timeout=timeout)[name].result(timeout=timeout)
    except KafkaException as exc:
        _LOGGER.warning("describing consumer group %s: %s", name, exc.args[0])
        return {}, "UNKNOWN"
    owners = {}
    for member in group.members:
        for tp in member.assignment.topic_partitions if member.assignment else []:
            if tp.topic == topic:
                owners[tp.partition] = _Owner(member.client_id, member.host, member.member_id)
    state = group.state
    return owners, str(getattr(state, "name", state))
