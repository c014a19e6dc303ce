"""``OrderedProducer``: a drop-in ``confluent_kafka.Producer`` that keeps per-key order (PUB-1..PUB-4, PUB-6).

Every record is idempotent with ``acks=all`` and routed by its ordering key with Kafka's murmur2
partitioner against a cached partition count, which is stamped into the record's headers. A final
delivery failure of a key pauses that key (PUB-2) until ``resume_publish``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import Any, NamedTuple

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka import Message as KafkaMessage

from ordering_layer.config import (
    MAX_ORDERING_KEY_BYTES,
    PublisherSettings,
    from_mapping,
    require_bootstrap,
)
from ordering_layer.envelope import encode_envelope, make_headers
from ordering_layer.errors import (
    ConfigError,
    InvalidMessageError,
    InvalidOrderingKeyError,
    MessageTooLargeError,
    OrderingKeyPausedError,
    PublishError,
    TopicError,
)
from ordering_layer.publisher.partitioner import partition_for
from ordering_layer.worker import Worker

_LOGGER = logging.getLogger(__name__)

DeliveryCallback = Callable[[KafkaError | None, KafkaMessage], None]

_ENFORCED = {"enable.idempotence": True, "acks": "all"}
_ACKS_ALL = {"all", "-1"}
_INLINE_POLL_EVERY = 256
_BUSY_WINDOW = 0.02
# Per-record overhead of Kafka's record format beyond key, value and header bytes (upper bound).
_RECORD_OVERHEAD = 64


class PublishResult(NamedTuple):
    """What a publish resolves to (PUB-3)."""

    message_id: str
    sequence_number: int
    partition: int
    offset: int
    enqueued_time: datetime


def sequence_number(partition: int, offset: int) -> int:
    """The 64-bit sequence number of a record: partition in the upper 16 bits, offset below."""
    return (partition << 48) | offset


def encode_ordering_key(ordering_key: str | bytes | None) -> tuple[str | None, bytes | None]:
    """Validate an ordering key (PUB-4); return it as text and as the Kafka record key.

    Empty or absent means unordered. Raises ``InvalidOrderingKeyError`` for a key that is not
    valid UTF-8 or is longer than 1024 bytes.
    """
    if ordering_key is None or ordering_key in ("", b""):
        return None, None
    if isinstance(ordering_key, bytes):
        try:
            text = ordering_key.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidOrderingKeyError("ordering key is not valid UTF-8", key=ordering_key) from exc
        raw = ordering_key
    elif isinstance(ordering_key, str):
        try:
            raw = ordering_key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidOrderingKeyError("ordering key is not valid UTF-8", key=ordering_key) from exc
        text = ordering_key
    else:
        raise InvalidOrderingKeyError(
            f"ordering key must be str or bytes, not {type(ordering_key).__name__}", key=ordering_key)
    if len(raw) > MAX_ORDERING_KEY_BYTES:
        raise InvalidOrderingKeyError(
            f"ordering key is {len(raw)} bytes; at most {MAX_ORDERING_KEY_BYTES} are allowed", key=text)
    return text, raw


def _check_attributes(attributes: Mapping[str, str] | None) -> Mapping[str, str]:
    if not attributes:
        return {}
    for name, value in attributes.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidMessageError(f"attributes must map str to str; got {name!r}: {value!r}")
    return attributes


def _attributes_from_headers(headers: Mapping[str, Any] | Sequence[tuple[str, Any]] | None) -> dict[str, str]:
    """The drop-in ``produce(headers=...)`` become attributes: str or UTF-8 bytes values."""
    if not headers:
        return {}
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    attributes: dict[str, str] = {}
    for name, value in pairs:
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidMessageError(f"header {name!r} is not UTF-8 text") from exc
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidMessageError(f"headers must map str to str or bytes; got {name!r}: {value!r}")
        attributes[name] = value
    return attributes


class _Pending:
    """One record handed to librdkafka and not yet reported; called with its delivery report."""

    __slots__ = ("future", "message_id", "on_delivery", "ordering_key", "owner", "topic")

    def __init__(self, owner: OrderedProducer, message_id: str, ordering_key: str | None, topic: str,
                 future: Future[PublishResult] | None, on_delivery: DeliveryCallback | None) -> None:
        self.owner = owner
        self.message_id = message_id
        self.ordering_key = ordering_key
        self.topic = topic
        self.future = future
        self.on_delivery = on_delivery

    def __call__(self, err: KafkaError | None, msg: KafkaMessage) -> None:
        self.owner._delivered(self, err, msg)


class OrderedProducer:
    """Publishes with ordering keys; same config dict as ``confluent_kafka.Producer``.

    Args:
        config: confluent-kafka settings, passed through; ``bootstrap.servers`` is required and
            ``enable.idempotence=True``, ``acks=all`` are enforced (a contrary value is refused).
        settings: layer settings (``PublisherSettings`` or a mapping of its fields).

    Raises:
        ConfigError: missing bootstrap, an unknown layer or Kafka setting, or a setting that
            would break ordering.
    """

    def __init__(self, config: Mapping[str, Any],
                 settings: PublisherSettings | Mapping[str, Any] | None = None) -> None:
        require_bootstrap(config)
        self.settings = from_mapping(PublisherSettings, settings)
        conf = dict(config)
        if str(conf.get("enable.idempotence", True)).lower() not in ("true", "1"):
            raise ConfigError("OrderedProducer needs enable.idempotence=true for in-key order (PUB-1)")
        if str(conf.get("acks", "all")).lower() not in _ACKS_ALL:
            raise ConfigError(f"OrderedProducer needs acks=all (PUB-1); got acks={conf['acks']!r}")
        conf.update(_ENFORCED)
        conf.setdefault("linger.ms", 5)
        conf.setdefault("logger", logging.getLogger("ordering_layer.kafka.producer"))
        try:
            self._producer = Producer(conf)
        except KafkaException as exc:
            raise ConfigError(f"Kafka producer config refused: {exc.args[0]}") from exc
        self._limit = min(self.settings.max_message_bytes, int(conf.get("message.max.bytes", 1_000_000)))
        self._lock = threading.Lock()
        self._paused: dict[str, BaseException] = {}
        self._counts: dict[str, tuple[int, float]] = {}
        self._id_prefix = uuid.uuid4().hex[:16] + "-"
        self._ids = itertools.count()
        self._closed = False
        self._last_send = 0.0
        self._sends = 0
        self._poller = Worker("ordering-layer-producer-poll", self._poll_step)
        self._poller.start()

    # -- publishing ------------------------------------------------------------------------------
    def publish(self, topic: str, data: bytes, ordering_key: str | bytes | None = None,
                attributes: Mapping[str, str] | None = None) -> Future[PublishResult]:
        """Publish ``data`` with an optional ordering key; the future resolves to a ``PublishResult``.

        Raises:
            OrderingKeyPausedError: the key is paused after an earlier failure (PUB-2).
            InvalidOrderingKeyError, InvalidMessageError, MessageTooLargeError: bad input (PUB-4).
            TopicError: the topic does not exist.
        """
        future: Future[PublishResult] = Future()
        self._send(topic, data, ordering_key, _check_attributes(attributes), future, None)
        return future

    def produce(self, topic: str, value: bytes | str | None = None, key: str | bytes | None = None,
                *, headers: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
                on_delivery: DeliveryCallback | None = None, callback: DeliveryCallback | None = None,
                ) -> None:
        """The shape of ``confluent_kafka.Producer.produce``: ``key`` is the ordering key.

        ``headers`` become the message's attributes; ``on_delivery(err, msg)`` (or ``callback``) is
        called from the producer's poll thread. Raises like ``publish``.
        """
        data = value.encode() if isinstance(value, str) else (value or b"")
        self._send(topic, data, key, _attributes_from_headers(headers), None, on_delivery or callback)

    def _send(self, topic: str, data: bytes, ordering_key: str | bytes | None,
              attributes: Mapping[str, str], future: Future[PublishResult] | None,
              on_delivery: DeliveryCallback | None) -> None:
        if self._closed:
            raise PublishError("producer is closed", topic=topic, ordering_key=None)
        key_text, key_raw = encode_ordering_key(ordering_key)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidMessageError(f"data must be bytes, not {type(data).__name__}")
        if key_text is not None:
            cause = self._paused.get(key_text)
            if cause is not None:
                raise OrderingKeyPausedError(
                    f"publishing for ordering key {key_text!r} is paused after a failure; "
                    "call resume_publish()", topic=topic, ordering_key=key_text) from cause
        value = encode_envelope(bytes(data), attributes)
        message_id = f"{self._id_prefix}{next(self._ids):x}"
        count = self._partition_count(topic)
        headers = make_headers(message_id, count)
        size = len(value) + len(key_raw or b"") + sum(len(k) + len(v) for k, v in headers) + _RECORD_OVERHEAD
        if size > self._limit:
            raise MessageTooLargeError(
                f"message is {size} bytes encoded; the limit is {self._limit}", size=size, limit=self._limit)
        kwargs: dict[str, Any] = {"headers": headers,
                                  "on_delivery": _Pending(self, message_id, key_text, topic, future, on_delivery)}
        if key_raw is not None:
            kwargs["key"] = key_raw
            kwargs["partition"] = partition_for(key_raw, count)
        self._last_send = time.monotonic()
        self._sends += 1
        if not self._sends % _INLINE_POLL_EVERY:
            self._producer.poll(0)
        while True:
            try:
                self._producer.produce(topic, value, **kwargs)
                return
            except BufferError:
                # The local queue is full: wait for deliveries to drain it, as Java's send() blocks.
                self._producer.poll(0.05)
            except KafkaException as exc:
                raise PublishError(f"produce to {topic!r} refused: {exc.args[0]}",
                                   topic=topic, ordering_key=key_text) from exc

    def _delivered(self, pending: _Pending, err: KafkaError | None, msg: KafkaMessage) -> None:
        key = pending.ordering_key
        if err is None:
            if pending.future is not None:
                partition, offset = msg.partition(), msg.offset()
                assert partition is not None and offset is not None
                _, stamp = msg.timestamp()
                pending.future.set_result(PublishResult(
                    pending.message_id, sequence_number(partition, offset), partition, offset,
                    datetime.fromtimestamp(stamp / 1000, tz=UTC)))
        else:
            error: PublishError
            if key is None:
                error = PublishError(f"publish to {pending.topic!r} failed: {err.str()}",
                                     topic=pending.topic, ordering_key=None)
            else:
                with self._lock:
                    already = key in self._paused
                    error_type = OrderingKeyPausedError if already else PublishError
                    error = error_type(f"publish of ordering key {key!r} to {pending.topic!r} failed: "
                                       f"{err.str()}; the key is paused until resume_publish()",
                                       topic=pending.topic, ordering_key=key)
                    error.__cause__ = KafkaException(err)
                    self._paused.setdefault(key, error)
                _LOGGER.warning("ordering key %r paused: %s", key, err.str())
            if pending.future is not None:
                pending.future.set_exception(error)
        if pending.on_delivery is not None:
            pending.on_delivery(err, msg)

    def resume_publish(self, ordering_key: str | bytes) -> None:
        """Allow publishing for a key paused after a failure (PUB-2); harmless if not paused."""
        key_text, _ = encode_ordering_key(ordering_key)
        if key_text is not None:
            with self._lock:
                self._paused.pop(key_text, None)

    def is_paused(self, ordering_key: str | bytes) -> bool:
        """True while publishing for ``ordering_key`` is paused."""
        key_text, _ = encode_ordering_key(ordering_key)
        return key_text in self._paused

    # -- metadata --------------------------------------------------------------------------------
    def _partition_count(self, topic: str) -> int:
        cached = self._counts.get(topic)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            metadata = self._producer.list_topics(topic, timeout=10)
        except KafkaException as exc:
            if cached is not None:
                return cached[0]
            raise TopicError(f"cannot read metadata of topic {topic!r}: {exc.args[0]}", topic=topic) from exc
        described = metadata.topics.get(topic)
        if described is None or described.error is not None or not described.partitions:
            if cached is not None:
                return cached[0]
            reason = described.error.str() if described is not None and described.error else "no partitions"
            raise TopicError(f"topic {topic!r} is not available: {reason}", topic=topic)
        count = len(described.partitions)
        self._counts[topic] = (count, now + self.settings.metadata_max_age)
        return count

    # -- lifecycle -------------------------------------------------------------------------------
    def _poll_step(self) -> float:
        # While publishing is busy the publishing thread serves delivery reports itself (every
        # _INLINE_POLL_EVERY sends): a second thread running callbacks then would only fight it for
        # the GIL. When publishing pauses, this thread keeps futures resolving.
        idle = time.monotonic() - self._last_send
        if idle < _BUSY_WINDOW:
            return _BUSY_WINDOW - idle
        self._producer.poll(0.1)
        return 0.0

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery callbacks (also done by a background thread); as ``Producer.poll``."""
        return int(self._producer.poll(timeout))

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every queued record is delivered or failed; return how many remain."""
        return int(self._producer.flush(-1 if timeout is None else timeout))

    def __len__(self) -> int:
        return len(self._producer)

    def close(self, timeout: float | None = None) -> int:
        """Flush, then stop the poll thread. Returns the number of records still undelivered."""
        if self._closed:
            return 0
        remaining = self.flush(timeout)
        self._closed = True
        self._poller.stop()
        self._producer.poll(0)
        return remaining

    def __enter__(self) -> OrderedProducer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
