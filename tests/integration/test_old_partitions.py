"""What a moved key left in its old partition (SUB-8, ``OldPartitions``), read from a real broker."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, cast

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from ordering_layer.kafka.partitioner import partition_for
from ordering_layer.record import HEADER_PARTITION_COUNT
from ordering_layer.stack import Endpoints
from ordering_layer.state import StateStore
from ordering_layer.state.store import partition_keys
from ordering_layer.subscriber import old_partitions
from ordering_layer.subscriber.old_partitions import OldPartitions
from tests.checker import wait_until

pytestmark = pytest.mark.integration


def moving_key(before: int, after: int) -> tuple[bytes, int, int]:
    """A key that ``before`` partitions route elsewhere than ``after`` do: (key, old, new partition)."""
    for number in itertools.count():
        key = f"moving-{number}".encode()
        if partition_for(key, before) != partition_for(key, after):
            return key, partition_for(key, before), partition_for(key, after)
    raise AssertionError("unreachable")


class StaleHighs:
    """The query consumer, with the high watermark asked before the last records were there (1)."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    def get_watermark_offsets(self, part: TopicPartition, *args: Any, **kwargs: Any) -> tuple[int, int]:
        low, high = self._consumer.get_watermark_offsets(part, *args, **kwargs)
        return low, min(high, 1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


@pytest.mark.parametrize("native", [True, False], ids=["native-scan", "consume"])
def test_a_record_appended_after_the_high_watermark_was_asked_is_not_taken_for_settled(
        kafka_config: dict[str, Any], endpoints: Endpoints, topic_factory: Callable[..., str],
        monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """SUB-8, SUB-3: the read of an old partition may take records past the high watermark it asked
    for (appended meanwhile: a lagging follower caught up, a producer still on the old count). Every
    record taken counts, so a moved key with such a record still waits, and the departure mark is
    bounded by what was read. A record taken but not looked at would let the key go out of its new
    partition first, and the mark would make the old partition's next owner skip that record: lost."""
    topic = topic_factory(partitions=4)
    key, old, new = moving_key(2, 4)
    producer = Producer(kafka_config)
    for number in range(3):
        producer.produce(topic, key=key, value=b"%d" % number, partition=old,
                         headers=[(HEADER_PARTITION_COUNT, b"2")])
    assert producer.flush(30) == 0
    subscription = f"old-{topic}"
    store = StateStore(endpoints.redis_url)
    store.client.zadd(partition_keys(subscription, old)[1], {"0": 0})  # the first record is settled
    history = [(2, 0), (4, 1)]
    reads = OldPartitions(kafka_config, store, subscription, topic)
    if not native:
        monkeypatch.setattr(old_partitions, "open_native_fetch", lambda *args, **kwargs: None)
    reads._consumer = cast(Consumer, StaleHighs(reads.consumer()))
    def refreshed() -> bool:
        try:
            reads.refresh({old}, history)
        except KafkaException:  # the group's coordinator is not ready yet: the guard tries again too
            return False
        return True

    try:
        wait_until(refreshed, 30, "the old partition read")
        assert (reads._scan is not None) is native
        assert reads._reads[old].end == 3  # the three records came in one fetch, past the high asked for
        assert reads.unsettled(old, {key: 4}) == {key}  # records 1 and 2 are not settled
        (mark,) = reads.departures({key: 4}, new, history, 0)
        assert mark.below == reads._reads[old].end  # the mark covers what was read, and no more
        assert store.client.zadd(partition_keys(subscription, old)[1], {"1": 0, "2": 0}) == 2
        assert reads.unsettled(old, {key: 4}) == set()  # once they are settled, the key goes
    finally:
        reads.close()
