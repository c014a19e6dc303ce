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
from ordering_layer.envelope import (
    ENVELOPE_VERSION,
    HEADER_ENVELOPE,
    HEADER_MESSAGE_ID,
    HEADER_PARTITION_COUNT,
    encode_envelope,
)
from ordering_layer.errors import (
    ConfigError,
    InvalidMessageError,
    InvalidOrderingKeyError,
    MessageTooLargeError,
    OrderingKeyPausedError,
    PublishError,
    TopicError,
)
from ordering_layer.publisher.future import FINISHED, RUNNING, LightFuture
from ordering_layer.publisher.partitioner import murmur2
from ordering_layer.worker import Worker

_LOGGER = logging.getLogger(__name__)

DeliveryCallback = Callable[[KafkaError | None, KafkaMessage], None]

_ENFORCED = {"enable.idempotence": True, "acks": "all"}
_ACKS_ALL = {"all", "-1"}
_INLINE_POLL_MASK = 255  # the publishing thread serves delivery reports every 256 sends
# Envelopes without attributes of payloads shorter than _SHORT are built here as head + data +
# _EMPTY_MAP, with the heads (Avro length prefixes) cut from encode_envelope's own output.
_SHORT = 2048
_HEADS = tuple(encode_envelope(bytes(n), {})[:-n - 1] for n in range(_SHORT))
_EMPTY_MAP = b"\x00"
_new_future = object.__new__
_new_tuple = tuple.__new__
_monotonic = time.monotonic
_KEY_CACHE_SIZE = 65_536
_ENVELOPE_HEADER = (HEADER_ENVELOPE, ENVELOPE_VERSION)
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


class _Topic(NamedTuple):
    """A topic's cached partition count, the header stamping it, and when to read it again."""

    partitions: int
    expires: float
    count_header: tuple[str, str | bytes | None]
    header_bytes: int  # bytes of the layer headers except the message id's value, plus overhead


class PublishFuture(LightFuture[PublishResult]):
    """The future ``publish`` returns; also the record's delivery callback.

    One object per message: it is the delivery callback itself (no closure or bound method per
    message), stores where the record landed, and builds the ``PublishResult`` when first asked.
    """

    __slots__ = ("_number", "_offset", "_owner", "_partition", "_stamp")
    _owner: OrderedProducer
    _number: int
    _partition: int  # these three are set by the delivery report
    _offset: int
    _stamp: int
    _on_delivery_cb: DeliveryCallback | None = None  # set for OrderedProducer.produce()

    def __init__(self, owner: OrderedProducer, number: int) -> None:
        # OrderedProducer._send makes these inline, with the same three assignments.
        self._state = RUNNING
        self._owner = owner
        self._number = number

    @property
    def message_id(self) -> str:
        """The id stamped in the record's ``ol-message-id`` header."""
        return self._owner._message_id(self._number)

    def _value(self) -> PublishResult:
        result = self._result
        if result is None:
            partition, offset = self._partition, self._offset
            # PublishResult(...) without its Python-level __new__; fields in declaration order.
            result = self._result = _new_tuple(PublishResult, (
                self._owner._message_id(self._number), (partition << 48) | offset, partition, offset,
                datetime.fromtimestamp(self._stamp / 1000, tz=UTC)))
        return result

    def __call__(self, err: KafkaError | None, msg: KafkaMessage) -> None:
        """The record's delivery report (called by librdkafka through ``poll``/``flush``)."""
        if err is None:
            self._partition = msg.partition()  # type: ignore[assignment]  # never None in a report
            self._offset = msg.offset()  # type: ignore[assignment]
            self._stamp = msg.timestamp()[1]
        else:
            self._exception = self._owner._failed(msg, err)
        # LightFuture._complete inlined (one completion per record; nobody waits on most).
        self._state = FINISHED
        cond = self._cond
        if cond is not None:
            self._wake(cond)
        if self._on_delivery_cb is not None:
            self._on_delivery_cb(err, msg)


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
        self._produce = self._producer.produce
        self._limit = min(self.settings.max_message_bytes, int(conf.get("message.max.bytes", 1_000_000)))
        # A value up to this size fits with any valid key and the layer headers (ids < 64 hex digits).
        self._unchecked_size = self._limit - MAX_ORDERING_KEY_BYTES - _RECORD_OVERHEAD - 256
        self._lock = threading.Lock()
        self._paused: dict[str, BaseException] = {}
        self._topics: dict[str, _Topic] = {}
        # Validated ordering keys (as given, str or bytes) -> (text, record key, murmur2 & 0x7FFFFFFF).
        self._keys: dict[str | bytes, tuple[str, bytes, int]] = {}
        self._id_prefix = uuid.uuid4().hex[:16] + "-"
        self._id_prefix_bytes = self._id_prefix.encode()
        self._ids = itertools.count()
        self._closed = False
        self._last_inline_poll = 0.0
        self._poller = Worker("ordering-layer-producer-poll", self._poll_step)
        self._poller.start()

    # -- publishing ------------------------------------------------------------------------------
    def publish(self, topic: str, data: bytes, ordering_key: str | bytes | None = None,
                attributes: Mapping[str, str] | None = None) -> Future[PublishResult]:
        """Publish ``data`` with an optional ordering key; the future resolves to a ``PublishResult``.

        The future is a ``concurrent.futures.Future`` (a ``PublishFuture``) that cannot be
        cancelled: the record is with the Kafka client once ``publish`` returns.

        Raises:
            OrderingKeyPausedError: the key is paused after an earlier failure (PUB-2).
            InvalidOrderingKeyError, InvalidMessageError, MessageTooLargeError: bad input (PUB-4).
            TopicError: the topic does not exist.
        """
        return self._send(topic, data, ordering_key, _check_attributes(attributes) if attributes else None, None)

    def produce(self, topic: str, value: bytes | str | None = None, key: str | bytes | None = None,
                *, headers: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
                on_delivery: DeliveryCallback | None = None, callback: DeliveryCallback | None = None,
                ) -> None:
        """The shape of ``confluent_kafka.Producer.produce``: ``key`` is the ordering key.

        ``headers`` become the message's attributes; ``on_delivery(err, msg)`` (or ``callback``) is
        called from the producer's poll thread. Raises like ``publish``.
        """
        data = value.encode() if isinstance(value, str) else (value or b"")
        self._send(topic, data, key, _attributes_from_headers(headers), on_delivery or callback)

    def _send(self, topic: str, data: bytes, ordering_key: str | bytes | None,
              attributes: Mapping[str, str] | None, on_delivery: DeliveryCallback | None) -> PublishFuture:
        # The hot path: raw produce costs ~5 us per message, so every step here counts (issue 2).
        if self._closed:
            raise PublishError("producer is closed", topic=topic, ordering_key=None)
        key_text: str | None = None
        key_raw: bytes | None = None
        key_hash = 0
        if ordering_key is not None:
            try:
                route = self._keys.get(ordering_key)
            except TypeError:  # unhashable: not a str or bytes; refused below
                route = None
            if route is None:
                route = self._validate_key(ordering_key)
            if route is not None:
                key_text, key_raw, key_hash = route
        if type(data) is not bytes:
            if not isinstance(data, bytes | bytearray | memoryview):
                raise InvalidMessageError(f"data must be bytes, not {type(data).__name__}")
            data = bytes(data)
        if self._paused and key_text is not None:
            self._check_not_paused(topic, key_text)
        size = len(data)
        if attributes or size >= _SHORT:
            value = encode_envelope(data, attributes or {})
        else:
            value = b"".join((_HEADS[size], data, _EMPTY_MAP))
        described = self._topics.get(topic)
        if described is None or described[1] <= _monotonic():  # [1]: expires
            described = self._describe(topic, described)
        partitions, _, count_header, header_bytes = described
        number = next(self._ids)
        message_id = b"%s%x" % (self._id_prefix_bytes, number)
        if len(value) > self._unchecked_size:  # else it fits whatever key and headers it has
            self._check_size(len(value) + len(message_id) + header_bytes + len(key_raw or b""))
        # PublishFuture(self, number), without the cost of calling a Python __init__.
        future = _new_future(PublishFuture)
        future._state = RUNNING
        future._owner = self
        future._number = number
        if on_delivery is not None:
            future._on_delivery_cb = on_delivery
        if not number & _INLINE_POLL_MASK:
            self._inline_poll()
        try:
            # Positional: topic, value, key, partition, callback, on_delivery, timestamp, headers.
            self._produce(topic, value, key_raw, -1 if key_raw is None else key_hash % partitions, future,
                          None, 0, [(HEADER_MESSAGE_ID, message_id), count_header, _ENVELOPE_HEADER])
        except BufferError:
            self._produce_when_room(topic, value, key_raw, -1 if key_raw is None else key_hash % partitions,
                                    future, [(HEADER_MESSAGE_ID, message_id), count_header, _ENVELOPE_HEADER])
        except KafkaException as exc:
            raise PublishError(f"produce to {topic!r} refused: {exc.args[0]}",
                               topic=topic, ordering_key=key_text) from exc
        return future

    def _check_size(self, size: int) -> None:
        if size > self._limit:
            raise MessageTooLargeError(
                f"message is {size} bytes encoded; the limit is {self._limit}", size=size, limit=self._limit)

    def _inline_poll(self) -> None:
        """Serve delivery reports on the publishing thread, every 256 sends (see ``_poll_step``)."""
        self._producer.poll(0)
        self._last_inline_poll = _monotonic()

    def _check_not_paused(self, topic: str, key_text: str) -> None:
        cause = self._paused.get(key_text)
        if cause is not None:
            raise OrderingKeyPausedError(
                f"publishing for ordering key {key_text!r} is paused after a failure; "
                "call resume_publish()", topic=topic, ordering_key=key_text) from cause

    def _produce_when_room(self, topic: str, value: bytes, key_raw: bytes | None, partition: int,
                           future: PublishFuture, headers: list[tuple[str, str | bytes | None]]) -> None:
        """The local queue is full: wait for deliveries to drain it, as Java's send() blocks."""
        while True:
            self._producer.poll(0.05)
            try:
                self._produce(topic, value, key_raw, partition, future, None, 0, headers)
                return
            except BufferError:
                continue
            except KafkaException as exc:
                raise PublishError(f"produce to {topic!r} refused: {exc.args[0]}", topic=topic,
                                   ordering_key=key_raw.decode() if key_raw else None) from exc

    def _validate_key(self, ordering_key: str | bytes) -> tuple[str, bytes, int] | None:
        """Check a key not seen lately (PUB-4) and remember it; None for an empty key."""
        key_text, key_raw = encode_ordering_key(ordering_key)
        if key_text is None or key_raw is None:
            return None
        route = (key_text, key_raw, murmur2(key_raw) & 0x7FFFFFFF)
        if len(self._keys) >= _KEY_CACHE_SIZE:
            self._keys.clear()
        self._keys[ordering_key] = route
        return route

    def _message_id(self, number: int) -> str:
        return f"{self._id_prefix}{number:x}"

    def _failed(self, msg: KafkaMessage, err: KafkaError) -> PublishError:
        """The error of a record that finally failed; pauses its key (PUB-2)."""
        topic, raw = msg.topic() or "", msg.key()
        if not raw:
            return PublishError(f"publish to {topic!r} failed: {err.str()}", topic=topic, ordering_key=None)
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        with self._lock:
            already = key in self._paused
            error_type = OrderingKeyPausedError if already else PublishError
            error = error_type(f"publish of ordering key {key!r} to {topic!r} failed: "
                               f"{err.str()}; the key is paused until resume_publish()",
                               topic=topic, ordering_key=key)
            error.__cause__ = KafkaException(err)
            self._paused.setdefault(key, error)
        _LOGGER.warning("ordering key %r paused: %s", key, err.str())
        return error

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
    def _describe(self, topic: str, cached: _Topic | None) -> _Topic:
        """Read the topic's partition count (cached for ``metadata_max_age``); the stale one on error."""
        try:
            metadata = self._producer.list_topics(topic, timeout=10)
        except KafkaException as exc:
            if cached is not None:
                return cached
            raise TopicError(f"cannot read metadata of topic {topic!r}: {exc.args[0]}", topic=topic) from exc
        described = metadata.topics.get(topic)
        if described is None or described.error is not None or not described.partitions:
            if cached is not None:
                return cached
            reason = described.error.str() if described is not None and described.error else "no partitions"
            raise TopicError(f"topic {topic!r} is not available: {reason}", topic=topic)
        count = len(described.partitions)
        count_header = (HEADER_PARTITION_COUNT, str(count).encode())
        header_bytes = (len(HEADER_MESSAGE_ID) + len(count_header[0]) + len(count_header[1])
                        + len(_ENVELOPE_HEADER[0]) + len(_ENVELOPE_HEADER[1]) + _RECORD_OVERHEAD)
        fresh = _Topic(count, time.monotonic() + self.settings.metadata_max_age, count_header, header_bytes)
        self._topics[topic] = fresh
        return fresh

    # -- lifecycle -------------------------------------------------------------------------------
    def _poll_step(self) -> float:
        # While publishing is busy the publishing thread serves delivery reports itself (every 256
        # sends): a second thread running callbacks then would only fight it for the GIL. Once
        # no such poll happened for _BUSY_WINDOW (publishing paused, or too slow to reach 256
        # sends soon), this thread keeps futures resolving.
        idle = time.monotonic() - self._last_inline_poll
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
