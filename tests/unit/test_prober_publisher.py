"""The prober's publisher against a fake producer: per-key numbering, spread, and republish after a failure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, cast

import pytest

from ordering_layer.errors import ConfigError, OrderingKeyPausedError, PublishError
from ordering_layer.prober.events import ATTR_POISON, ATTR_RUN, ATTR_SEQ, probe_fields
from ordering_layer.prober.publisher import ProbePublisher, PublishPlan
from ordering_layer.publisher import OrderedProducer


class FakeProducer:
    """Resolves publishes at once; fails the publishes listed in ``fail`` (key, seq) once each, and
    then refuses the key until ``resume_publish`` as ``OrderedProducer`` does (PUB-2)."""

    def __init__(self, fail: set[tuple[str, int]] | None = None) -> None:
        self.fail = set(fail or ())
        self.paused: set[str] = set()
        self.stored: dict[str, list[int]] = defaultdict(list)
        self.resumed: list[str] = []
        self.poison: list[tuple[str, str]] = []

    def publish(self, topic: str, data: bytes, ordering_key: str | None = None,
                attributes: Mapping[str, str] | None = None) -> Future[Any]:
        assert ordering_key is not None and attributes is not None
        if ordering_key in self.paused:
            raise OrderingKeyPausedError("paused", topic=topic, ordering_key=ordering_key)
        future: Future[Any] = Future()
        if ATTR_POISON in attributes:
            self.poison.append((ordering_key, attributes[ATTR_POISON]))
            future.set_result(None)
            return future
        fields = probe_fields(attributes)
        assert fields is not None and fields.run == "run-1"
        if (ordering_key, fields.seq) in self.fail:
            self.fail.discard((ordering_key, fields.seq))
            self.paused.add(ordering_key)
            future.set_exception(PublishError("broker said no", topic=topic, ordering_key=ordering_key))
        else:
            self.stored[ordering_key].append(fields.seq)
            future.set_result(None)
        return future

    def resume_publish(self, ordering_key: str) -> None:
        self.paused.discard(ordering_key)
        self.resumed.append(ordering_key)

    def flush(self, timeout: float | None = None) -> int:
        return 0


def run(plan: PublishPlan, producer: FakeProducer) -> ProbePublisher:
    publisher = ProbePublisher(cast(OrderedProducer, producer), plan)
    publisher.run()
    return publisher


def test_messages_spread_over_keys_numbered_per_key() -> None:
    """Each key gets its share, numbered 0, 1, 2, ... in its own sequence; metadata in attributes."""
    producer = FakeProducer()
    publisher = run(PublishPlan("t", "run-1", keys=3, messages=10), producer)
    assert publisher.expectations() == {"key-0": 4, "key-1": 3, "key-2": 3}
    assert dict(producer.stored) == {"key-0": [0, 1, 2, 3], "key-1": [0, 1, 2], "key-2": [0, 1, 2]}
    assert publisher.published == 10 and publisher.failures == 0 and publisher.in_flight() == 0
    assert (ATTR_RUN, ATTR_SEQ) == ("prober-run", "prober-seq")


def test_failed_publish_is_republished_from_the_failed_seq() -> None:
    """PUB-2: a failed publish pauses its key; the prober resumes the key and publishes again from
    the failed seq, so the key's stored sequence has no hole and the count is exact."""
    producer = FakeProducer(fail={("key-1", 2)})
    publisher = run(PublishPlan("t", "run-1", keys=2, messages=12), producer)
    assert producer.stored["key-1"] == [0, 1, 2, 3, 4, 5]
    assert producer.stored["key-0"] == [0, 1, 2, 3, 4, 5]
    assert producer.resumed == ["key-1"]
    assert publisher.expectations() == {"key-0": 6, "key-1": 6}
    assert publisher.failures == 1 and publisher.published == 12


def test_stopped_publisher_counts_what_was_published() -> None:
    """A publisher stopped at once publishes nothing and expects nothing."""
    producer = FakeProducer()
    publisher = ProbePublisher(cast(OrderedProducer, producer), PublishPlan("t", "run-1", keys=2, messages=0,
                                                                            duration=60))
    publisher.stop.set()
    publisher.run()
    assert publisher.expectations() == {"key-0": 0, "key-1": 0}


def test_poison_messages_go_first_one_per_kind_on_their_own_keys() -> None:
    """DLQ-2, DLQ-3: the poison kinds asked for are published before the sequences, each on key
    <prefix>-poison-<kind>, without run or seq (the verifier does not judge them)."""
    producer = FakeProducer()
    publisher = run(PublishPlan("t", "run-1", keys=2, messages=4, poison=("nack", "exit", "hold")), producer)
    assert producer.poison == [("key-poison-nack", "nack"), ("key-poison-exit", "exit"), ("key-poison-hold", "hold")]
    assert publisher.poison_published == 3 and publisher.published == 4
    with pytest.raises(ConfigError, match="unknown poison"):
        PublishPlan("t", "run-1", poison=("explode",))
