"""The native fetch is used only on a handle it recognises (``native_fetch.open_native_fetch``)."""

from __future__ import annotations

import gc
import logging

import pytest
from confluent_kafka import Consumer
from confluent_kafka import Message as KafkaMessage

from ordering_layer import FlowControl
from ordering_layer._core import NativeFetch
from ordering_layer.record import HEADER_MESSAGE_ID, HEADER_PARTITION_COUNT, read_metadata
from ordering_layer.subscriber import native_fetch
from ordering_layer.subscriber.fetched import to_record
from ordering_layer.subscriber.fetcher import Fetcher, RebalanceHooks
from ordering_layer.subscriber.flow import FlowGate
from ordering_layer.subscriber.records import Record
from tests.fetch_helpers import OwnAll, report_release

CONFIG = {"bootstrap.servers": "127.0.0.1:9", "group.id": "native-unit", "client.id": "native-unit"}


def test_the_loaded_librdkafka_is_found() -> None:
    path = native_fetch.loaded_librdkafka()
    assert path is not None and "librdkafka" in path


def test_a_consumer_handle_is_recognised_and_released() -> None:
    consumer = Consumer(CONFIG)
    try:
        fetch = native_fetch.open_native_fetch(consumer, CONFIG, "t", lambda record: None)
        assert isinstance(fetch, NativeFetch)
        assert fetch.attached() == []
        records, errors = fetch.fetch(10, 0.0)  # nothing assigned: an empty batch, at once
        assert records == [] and errors == []
        fetch.close()
        assert fetch.fetch(10, 0.0) == ([], [])  # closed: empty, never a dangling queue
        fetch.attach([0, 1])  # a rebalance while the consumer closes: nothing attached, no error
        assert fetch.attached() == []
    finally:
        consumer.close()


def test_a_handle_of_another_name_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    consumer = Consumer(CONFIG)
    try:
        with caplog.at_level(logging.INFO, logger=native_fetch.__name__):
            assert native_fetch.open_native_fetch(consumer, {**CONFIG, "client.id": "other"}, "t",
                                                  lambda record: None) is None
        assert "not a consumer named other#consumer-" in caplog.text
    finally:
        consumer.close()


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORDERING_LAYER_NATIVE_FETCH", "0")
    consumer = Consumer(CONFIG)
    try:
        assert native_fetch.open_native_fetch(consumer, CONFIG, "t", lambda record: None) is None
    finally:
        consumer.close()


@pytest.mark.parametrize(("version", "known"), [
    ("2.6.1", True), ("2.10.0", True), ("2.16.0", True), ("2.16.9", True), ("2.16.0-RC2", True),
    ("2.6.0", False), ("2.5.3", False), ("1.9.2", False), ("2.17.0", False), ("3.0.0", False), ("v2.16.1", False),
])
def test_the_known_releases_are_the_tested_ones(version: str, known: bool) -> None:
    assert native_fetch.is_known_release(version) is known


def test_the_loaded_releases_are_known() -> None:
    assert native_fetch.unknown_release() is None


@pytest.mark.parametrize(("confluent_kafka_version", "librdkafka_version", "named"), [
    (("2.17.0", 0x021100FF), None, "confluent-kafka 2.17.0"),  # the (string, int) pair of older releases
    ("2.5.3", None, "confluent-kafka 2.5.3"),
    (None, "2.17.0", "librdkafka 2.17.0"),  # confluent-kafka built against another librdkafka
])
def test_another_release_falls_back_to_consume_logged_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        confluent_kafka_version: str | tuple[str, int] | None, librdkafka_version: str | None, named: str) -> None:
    """The consumer's layout is known only on the tested releases: on any other the fetcher consumes,
    and says so once."""
    report_release(monkeypatch, confluent_kafka_version, librdkafka_version)
    with caplog.at_level(logging.INFO, logger=native_fetch.__name__):
        consumer = Consumer(CONFIG)
        try:
            assert native_fetch.open_native_fetch(consumer, CONFIG, "t", lambda record: None) is None
            assert native_fetch.open_native_fetch(consumer, CONFIG, "t", lambda record: None) is None
        finally:
            consumer.close()
        fetcher = Fetcher(CONFIG, "old", "t", FlowGate(FlowControl()), OwnAll(), lambda event: None,
                          RebalanceHooks())
        try:
            assert fetcher.native is None
        finally:
            fetcher.close()
    fallbacks = [r.getMessage() for r in caplog.records if "not a release the native fetch was tested on" in r.message]
    assert fallbacks == [f"fetching through consume(): {named} is not a release the native fetch was tested on "
                         "(2.6.1 to 2.16.x)"]


def test_metadata_is_shared_only_for_the_layers_one_header_records() -> None:
    malformed: list[Record] = []
    metadata_of = native_fetch.header_metadata(malformed.append)
    plain = [(HEADER_PARTITION_COUNT, b"6")]
    metadata, kept, shareable = metadata_of(plain, 0, 1)
    assert shareable and kept == tuple(plain) and metadata == read_metadata(plain)
    with_id = [(HEADER_PARTITION_COUNT, b"6"), (HEADER_MESSAGE_ID, b"m-1")]
    metadata, kept, shareable = metadata_of(with_id, 0, 2)
    assert not shareable and kept == with_id and metadata.message_id == "m-1"
    assert not malformed
    metadata, kept, shareable = metadata_of([(HEADER_PARTITION_COUNT, b"x")], 3, 7)
    assert not shareable and metadata.malformed is not None
    assert [(r.partition, r.offset) for r in malformed] == [(3, 7)]  # DLQ-4: reported with its position


def _consumers() -> int:
    return sum(1 for item in gc.get_objects() if type(item) is Consumer)


@pytest.mark.parametrize("close", [True, False], ids=["closed", "abandoned"])
def test_a_fetcher_leaves_no_consumer_behind(close: bool) -> None:
    """The fetch holds the consumer until its queues are given back, and the collector sees what it
    holds: a fetcher closed, or dropped without a close, is collected with its consumer, and
    nothing waits for a forwarded queue."""
    gc.collect()
    before = _consumers()
    fetcher = Fetcher(CONFIG, "leak", "t", FlowGate(FlowControl()), OwnAll(), lambda event: None, RebalanceHooks())
    assert fetcher.native is not None
    fetcher.native.attach([0, 1])
    if close:
        fetcher.close()
    del fetcher
    gc.collect()
    assert _consumers() == before


def test_records_share_headers_only_with_the_same_header() -> None:
    """The one-header records of the layer share their metadata and headers, on either fetch path; a
    record whose one header is a user's header with the same value keeps its own (PUB-7)."""
    user = to_record(KafkaMessage(topic="t", partition=0, offset=1, key=b"k", value=b"v", headers=[("n", b"77")]))
    layer = to_record(KafkaMessage(topic="t", partition=0, offset=2, key=b"k", value=b"v",
                                   headers=[(HEADER_PARTITION_COUNT, b"77")]))
    again = to_record(KafkaMessage(topic="t", partition=0, offset=3, key=b"k", value=b"v",
                                   headers=[(HEADER_PARTITION_COUNT, b"77")]))
    assert list(user.headers or ()) == [("n", b"77")] and user.metadata.partition_count is None
    assert list(layer.headers or ()) == [(HEADER_PARTITION_COUNT, b"77")] and layer.metadata.partition_count == 77
    assert again.headers is layer.headers and again.metadata is layer.metadata
