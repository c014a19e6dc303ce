"""``OrderedProducer``: a drop-in ``confluent_kafka.Producer`` that keeps per-key order (PUB-1..PUB-4, PUB-6).

Every record is idempotent with ``acks=all`` and routed by its ordering key with Kafka's murmur2
partitioner against a cached partition count. The record is plain Kafka: key = ordering key, value =
payload, headers = attributes plus ``ol-partition-count`` (and ``ol-message-id`` only for a
caller-chosen id). A final delivery failure of a key pauses that key (PUB-2) until ``resume_publish``.
With tracing on (``ordering_layer.tracing``) each send goes through a publish span that adds the
trace context to the headers; with it off ``publish`` and ``produce`` call ``_send`` directly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka import Message as KafkaMessage

from ordering_layer import metrics
from ordering_layer.config import (
    MAX_ORDERING_KEY_BYTES,
    PublisherSettings,
    from_mapping,
    require_bootstrap,
)
from ordering_layer.errors import (
    ConfigError,
    InvalidMessageError,
    MessageTooLargeError,
    OrderingKeyPausedError,
    PublishError,
    TopicError,
    UnsupportedOperationError,
)
from ordering_layer.kafka.auth import verify_kafka
from ordering_layer.kafka.partitioner import murmur2
from ordering_layer.kafka_config import flag, integer, read_kafka_config
from ordering_layer.publisher.future import FINISHED, RUNNING, LightFuture
from ordering_layer.record import (
    HEADER_MESSAGE_ID,
    HEADER_PARTITION_COUNT,
    MAX_MESSAGE_ID_BYTES,
    RESERVED_PREFIX,
    HeaderValue,
    attribute_headers,
    display_key,
    encode_ordering_key,
)
from ordering_layer.scheduler.book import ScheduleBook
from ordering_layer.scheduler.participant import join_activation
from ordering_layer.scheduler.records import CancelResult
from ordering_layer.scheduler.settings import SchedulerSettings, redis_url_or_env
from ordering_layer.tracing import PublishTracing, tracer
from ordering_layer.worker import Worker

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

_LOGGER = logging.getLogger(__name__)

DeliveryCallback = Callable[[KafkaError | None, KafkaMessage], None]
ProduceHeaders = Mapping[str, HeaderValue] | Sequence[tuple[str, HeaderValue]]

_ENFORCED = {"enable.idempotence": True, "acks": "all"}
_ACKS_ALL = {"all", "-1"}
_ACKS = ("acks", "request.required.acks")  # one setting, two names
_GROWTH_DRAIN = 5.0  # seconds a publish waits, after a growth, for the records in flight to be acknowledged
_INLINE_POLL_MASK = 255  # the publishing thread serves delivery reports every 256 sends
_new_future = object.__new__
_new_tuple = tuple.__new__
_monotonic = time.monotonic
_KEY_CACHE_SIZE = 65_536
_BUSY_WINDOW = 0.02
# Per-record overhead of Kafka's record format beyond key, value and header bytes (upper bound),
# and per header (name and value lengths as varints).
_RECORD_OVERHEAD = 64
_HEADER_OVERHEAD = 10
_UNCHECKED_HEADER_BYTES = 512
_MAX_LATENCY_SAMPLES = 10_000  # kept between two scrapes (640 000 records at 1 in 64); more are dropped
_TRANSACTIONS = "transactions (the layer's per-key pause and ordering are per record, not per transaction)"


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


def produce_headers(headers: ProduceHeaders | None) -> list[tuple[str, HeaderValue]]:
    """``produce(headers=...)`` as confluent-kafka takes them (a mapping or pairs; values str, bytes
    or None), passed through byte for byte; ``ol-`` names are refused (PUB-6)."""
    if not headers:
        return []
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise InvalidMessageError(f"headers must be (name, value) pairs; got {pair!r}")
        name, value = pair
        if not isinstance(name, str) or not (value is None or isinstance(value, str | bytes)):
            raise InvalidMessageError(f"headers must map str to str, bytes or None; got {name!r}: {value!r}")
        if name.startswith(RESERVED_PREFIX):
            raise InvalidMessageError(f"header name {name!r} uses the reserved prefix {RESERVED_PREFIX!r}")
    return pairs


def _check_message_id(message_id: str | None) -> bytes | None:
    if message_id is None:
        return None
    if not isinstance(message_id, str) or not message_id:
        raise InvalidMessageError(f"message_id must be a non-empty str, got {message_id!r}")
    raw = message_id.encode()
    if len(raw) > MAX_MESSAGE_ID_BYTES:
        raise InvalidMessageError(f"message_id is {len(raw)} bytes; at most {MAX_MESSAGE_ID_BYTES} are allowed")
    return raw


def _header_bytes(headers: Sequence[tuple[str, HeaderValue]]) -> int:
    size = 0
    for name, value in headers:
        size += len(name) + _HEADER_OVERHEAD + (len(value) if value is not None else 0)
    return size


class _Topic(NamedTuple):
    """A topic's cached partition count, the header stamping it, and when to read it again."""

    partitions: int
    expires: float
    count_header: tuple[str, HeaderValue]
    header_bytes: int  # bytes of the count header, plus the record overhead


class PublishFuture(LightFuture[PublishResult]):
    """The future ``publish`` returns; also the record's delivery callback.

    One object per message: it is the delivery callback itself (no closure or bound method per
    message), stores where the record landed, and builds the ``PublishResult`` when first asked.
    """

    __slots__ = ("_offset", "_owner", "_partition", "_stamp")
    _owner: OrderedProducer
    _partition: int  # these three are set by the delivery report
    _offset: int
    _stamp: int
    _message_id: str | None = None  # a caller-chosen id (else the decimal sequence number)
    _on_delivery_cb: DeliveryCallback | None = None  # set for OrderedProducer.produce()

    def __init__(self, owner: OrderedProducer) -> None:
        # OrderedProducer._send makes these inline, with the same assignments.
        self._state = RUNNING
        self._owner = owner

    def _value(self) -> PublishResult:
        result = self._result
        if result is None:
            partition, offset = self._partition, self._offset
            number = (partition << 48) | offset
            # PublishResult(...) without its Python-level __new__; fields in declaration order.
            result = self._result = _new_tuple(PublishResult, (
                self._message_id or str(number), number, partition, offset,
                datetime.fromtimestamp(self._stamp / 1000, tz=UTC)))
        return result

    def __call__(self, err: KafkaError | None, msg: KafkaMessage) -> None:
        """The record's delivery report (called by librdkafka through ``poll``/``flush``)."""
        if err is None:
            self._partition = msg.partition()  # type: ignore[assignment]  # never None in a report
            self._offset = offset = msg.offset()  # type: ignore[assignment]
            self._stamp = msg.timestamp()[1]
            # Publish latency is sampled by offset (1 in 64, unrelated to latency): the test costs
            # a few ns per message, the sample a C call and an append.
            if not offset & 63:  # type: ignore[operator]
                self._owner._sample_latency(msg)
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
    """Publishes with ordering keys; takes what ``confluent_kafka.Producer`` takes.

    ``OrderedProducer(conf)``, ``OrderedProducer(conf, **more)`` and ``OrderedProducer(**conf)``
    all work as they do for confluent-kafka (keyword settings override the dict's).

    Args:
        config: confluent-kafka settings, passed through; ``bootstrap.servers`` is required and
            ``enable.idempotence=True``, ``acks=all`` are enforced (a contrary value is refused).
        settings: layer settings (``PublisherSettings`` or a mapping of its fields).
        redis_url: the layer's Redis (default ``$ORDERING_LAYER_REDIS_URL``), for ``schedule``;
            with one, the producer also activates due scheduled messages while it runs, unless
            ``settings={"scheduler": False}`` (PUB-5).
        metrics_port: serve Prometheus metrics (publish latency, paused keys) on this port
            (``ordering_layer.metrics``); None: no endpoint.
        tracer_provider: the OpenTelemetry provider of the publish spans (default: the global one);
            giving one switches tracing on unless ``settings`` say ``tracing=False``
            (``ordering_layer.tracing``).

    Raises:
        ConfigError: missing bootstrap, an unknown layer or Kafka setting, a setting that
            would break ordering, or tracing asked for without ``opentelemetry-api``.
        AuthenticationError: Kafka refused the credentials or the TLS handshake (``server="kafka"``),
            found by a short metadata request before the producer is made (``auth.verify_kafka``).
    """

    def __init__(self, config: Mapping[str, Any] | None = None, /, *,
                 settings: PublisherSettings | Mapping[str, Any] | None = None, redis_url: str | None = None,
                 metrics_port: int | None = None, tracer_provider: TracerProvider | None = None,
                 **kwargs: Any) -> None:
        conf = read_kafka_config(config, kwargs)
        require_bootstrap(conf)
        verify_kafka(conf)
        self.settings = from_mapping(PublisherSettings, settings)
        # Decided once: with tracing off publish and produce call _send directly.
        publish_tracer = tracer(self.settings.tracing, tracer_provider)
        self._tracing = None if publish_tracer is None else PublishTracing(publish_tracer)
        if not flag(conf, "enable.idempotence", True):
            raise ConfigError("OrderedProducer needs enable.idempotence=true for in-key order (PUB-1)",
                              setting="enable.idempotence")
        for name in _ACKS:
            if str(conf.get(name, "all")).strip().lower() not in _ACKS_ALL:
                raise ConfigError(f"OrderedProducer needs acks=all (PUB-1); got {name}={conf[name]!r}", setting=name)
        if conf.get("transactional.id"):
            raise UnsupportedOperationError("transactional.id", _TRANSACTIONS)
        conf.update(_ENFORCED)
        conf.setdefault("linger.ms", 5)
        conf.setdefault("logger", logging.getLogger("ordering_layer.kafka.producer"))
        try:
            self._producer = Producer(conf)
        except KafkaException as exc:
            raise ConfigError(f"Kafka producer config refused: {exc.args[0]}") from exc
        self._produce = self._producer.produce
        self._limit = min(self.settings.max_message_bytes, integer(conf, "message.max.bytes", 1_000_000))
        # A record whose value is up to this size fits with any valid key and up to
        # _UNCHECKED_HEADER_BYTES of headers (record overhead included): no size sum needed.
        self._unchecked_size = self._limit - MAX_ORDERING_KEY_BYTES - _UNCHECKED_HEADER_BYTES
        self._lock = threading.Lock()
        self._paused: dict[str, BaseException] = {}
        self._topics: dict[str, _Topic] = {}
        # Validated ordering keys (as given, str or bytes) -> (text, record key, murmur2 & 0x7FFFFFFF).
        self._keys: dict[str | bytes, tuple[str, bytes, int]] = {}
        self._sent = 0
        self._closed = False
        self._last_inline_poll = 0.0
        self._poller = Worker("ordering-layer-producer-poll", self._poll_step)
        self._poller.start()
        self._config = conf
        self._redis_url = redis_url_or_env(redis_url)
        self._book: ScheduleBook | None = None
        self._activation = join_activation(conf, self._redis_url, enabled=self.settings.scheduler, producer=self,
                                           book=self._schedules() if self._redis_url else None)
        self._latency_samples: list[tuple[str, float]] = []
        self._metrics = metrics_port is not None
        if metrics_port is not None:
            metrics.register(self)
            metrics.start_metrics_server(metrics_port)

    # -- publishing ------------------------------------------------------------------------------
    def publish(self, topic: str, data: bytes, ordering_key: str | bytes | None = None,
                attributes: Mapping[str, str] | None = None, *, message_id: str | None = None,
                ) -> Future[PublishResult]:
        """Publish ``data`` with an optional ordering key; the future resolves to a ``PublishResult``.

        The record is key = ordering key, value = ``data``, headers = ``attributes`` (UTF-8) plus
        ``ol-partition-count``. ``message_id`` (optional, at most 256 bytes) is kept in an
        ``ol-message-id`` header for duplicate detection; without it the message id is the
        decimal sequence number. The future cannot be cancelled: the record is with the Kafka
        client once ``publish`` returns. With tracing on the headers also carry the publish span's
        trace context (``traceparent``; ``ordering_layer.tracing``).

        Raises:
            OrderingKeyPausedError: the key is paused after an earlier failure (PUB-2).
            InvalidOrderingKeyError, InvalidMessageError, MessageTooLargeError: bad input, including
                attribute names starting with ``ol-`` (PUB-4).
            TopicError: the topic does not exist.
        """
        headers = attribute_headers(attributes) if attributes else None
        if self._tracing is not None:
            return self._tracing.send(self._send, topic, data, ordering_key, headers, message_id, None, -1, 0)
        return self._send(topic, data, ordering_key, headers, message_id, None, -1, 0)

    # -- scheduled messages (PUB-5) ----------------------------------------------------------------
    def _schedules(self) -> ScheduleBook:
        if self._book is None:
            if not self._redis_url:
                raise ConfigError("scheduled messages need the layer's Redis: pass OrderedProducer(..., "
                                  "redis_url=...) or set $ORDERING_LAYER_REDIS_URL")
            self._book = ScheduleBook(self._config, self._redis_url,
                                      SchedulerSettings(schedule_topic=self.settings.schedule_topic))
        return self._book

    def schedule(self, topic: str, data: bytes, ordering_key: str | bytes | None = None,
                 attributes: Mapping[str, str] | None = None, *, enqueue_at: datetime) -> str:
        """Publish ``data`` to ``topic`` at ``enqueue_at`` (timezone-aware); return the schedule id.

        The message is stored durably in the schedule topic before this returns and is invisible
        to subscribers until activated at ``enqueue_at``: then it is published like a new message
        (new sequence number, the same ordering key) whose message id is the schedule id.

        Raises:
            ConfigError: no Redis URL, or a naive ``enqueue_at``.
            InvalidOrderingKeyError, InvalidMessageError: bad key, data or attributes (PUB-4).
            PublishError: the schedule topic did not take the record.
        """
        return self._schedules().schedule(topic, data, ordering_key, attributes, enqueue_at=enqueue_at)

    def cancel_scheduled(self, schedule_id: str) -> CancelResult:
        """Cancel a scheduled message before its activation (PUB-5).

        Returns ``CancelResult.CANCELLED`` (also for a repeated cancel), ``ALREADY_ENQUEUED`` when it
        is activated or being activated, or ``NOT_FOUND``. Raises ``ConfigError`` without a Redis URL.
        """
        return self._schedules().cancel(schedule_id)

    def produce(self, topic: str, value: bytes | str | None = None, key: str | bytes | None = None,
                partition: int = -1, callback: DeliveryCallback | None = None,
                on_delivery: DeliveryCallback | None = None, timestamp: int = 0,
                headers: ProduceHeaders | None = None) -> None:
        """``confluent_kafka.Producer.produce``, argument for argument; ``key`` is the ordering key.

        ``headers`` pass through byte for byte (names starting with ``ol-`` are refused; with
        tracing on, ``traceparent`` and the propagator's other headers are the publish span's);
        ``on_delivery(err, msg)`` (or ``callback``) is called with confluent-kafka's ``Message``.
        ``partition`` routes the record there instead of by key (per-key order then rests on the
        caller's routing). ``timestamp`` passes through, though topics the layer creates keep the
        broker's append time. Raises like ``publish``; a null value is an empty payload.
        """
        data = value.encode() if isinstance(value, str) else (value or b"")
        if self._tracing is not None:
            self._tracing.send(self._send, topic, data, key, produce_headers(headers) or None, None,
                               on_delivery or callback, partition, timestamp)
            return
        self._send(topic, data, key, produce_headers(headers) or None, None, on_delivery or callback,
                   partition, timestamp)

    def produce_batch(self, topic: str, messages: list[dict[str, Any]], partition: int = -1,
                      callback: DeliveryCallback | None = None, on_delivery: DeliveryCallback | None = None,
                      ) -> int:
        """``confluent_kafka.Producer.produce_batch``: each dict takes ``produce``'s keywords
        (``value``, ``key``, ``partition``, ``timestamp``, ``headers``, ``callback``); returns how many
        were queued (all of them, or it raises like ``produce``)."""
        for message in messages:
            self.produce(topic, message.get("value"), message.get("key"), message.get("partition", partition),
                         message.get("callback") or callback, on_delivery, message.get("timestamp", 0),
                         message.get("headers"))
        return len(messages)

    def _send(self, topic: str, data: bytes, ordering_key: str | bytes | None,
              headers: list[tuple[str, HeaderValue]] | None, message_id: str | None,
              on_delivery: DeliveryCallback | None, partition: int, timestamp: int) -> PublishFuture:
        # The hot path: raw produce costs ~5 us per message, so every step here counts.
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
        described = self._topics.get(topic)
        if described is None or described[1] <= _monotonic():  # [1]: expires
            described = self._describe(topic, described)
        partitions, _, count_header, header_bytes = described
        if headers is None:
            record_headers = [count_header]
        else:
            record_headers = [count_header, *headers]
            header_bytes += _header_bytes(headers)
        raw_id = None if message_id is None else _check_message_id(message_id)
        if raw_id is not None:
            record_headers.append((HEADER_MESSAGE_ID, raw_id))
            header_bytes += len(HEADER_MESSAGE_ID) + len(raw_id) + _HEADER_OVERHEAD
        if len(data) > self._unchecked_size or header_bytes > _UNCHECKED_HEADER_BYTES:
            self._check_size(len(data) + header_bytes + len(key_raw or b""))
        # PublishFuture(self), without the cost of calling a Python __init__.
        future = _new_future(PublishFuture)
        future._state = RUNNING
        future._owner = self
        if message_id is not None:
            future._message_id = message_id
        if on_delivery is not None:
            future._on_delivery_cb = on_delivery
        self._sent = sent = self._sent + 1
        if not sent & _INLINE_POLL_MASK:
            self._inline_poll()
        if partition < 0 and key_raw is not None:
            partition = key_hash % partitions
        try:
            # Positional: topic, value, key, partition, callback, on_delivery, timestamp, headers.
            self._produce(topic, data, key_raw, partition, future, None, timestamp, record_headers)
        except BufferError:
            self._produce_when_room(topic, data, key_raw, partition, future, timestamp, record_headers)
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
                           future: PublishFuture, timestamp: int, headers: list[tuple[str, HeaderValue]]) -> None:
        """The local queue is full: wait for deliveries to drain it, as Java's send() blocks."""
        while True:
            self._producer.poll(0.05)
            try:
                self._produce(topic, value, key_raw, partition, future, None, timestamp, headers)
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

    def _failed(self, msg: KafkaMessage, err: KafkaError) -> PublishError:
        """The error of a record that finally failed; pauses its key (PUB-2)."""
        topic, raw = msg.topic() or "", msg.key()
        if not raw:
            return PublishError(f"publish to {topic!r} failed: {err.str()}", topic=topic, ordering_key=None)
        key = display_key(raw) if isinstance(raw, bytes) else str(raw)
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

    # -- metrics ---------------------------------------------------------------------------------
    def _sample_latency(self, msg: KafkaMessage) -> None:
        samples = self._latency_samples
        if len(samples) < _MAX_LATENCY_SAMPLES:
            latency = msg.latency()
            if latency is not None:
                samples.append((msg.topic() or "", latency))

    def metrics_snapshot(self) -> dict[str, Any]:
        """For ``ordering_layer.metrics``: ``paused_keys`` (gauge) and ``publish_latency_seconds``, the
        (topic, seconds) samples taken since the previous call (records whose offset is a multiple of 64)."""
        samples, self._latency_samples = self._latency_samples, []
        return {"paused_keys": len(self._paused), "publish_latency_seconds": samples}

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
        if cached is not None and count != cached.partitions and self._producer.flush(_GROWTH_DRAIN) > 0:
            # SUB-8: the topic grew and a key routed by the new count may land in another partition;
            # its records in flight to the old one must be appended first. Until they are all
            # acknowledged the old count stays in force (read again soon).
            stale = cached._replace(expires=time.monotonic() + _GROWTH_DRAIN)
            self._topics[topic] = stale
            return stale
        count_header = (HEADER_PARTITION_COUNT, str(count).encode())
        header_bytes = len(count_header[0]) + len(count_header[1]) + _HEADER_OVERHEAD + _RECORD_OVERHEAD
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

    def poll(self, timeout: float | None = None) -> int:
        """Serve delivery callbacks, as ``Producer.poll``: wait up to ``timeout`` seconds (None or
        negative: until a callback is served or nothing is left in flight). A background thread
        serves them too, so a program that never polls still gets its callbacks."""
        if timeout is not None and timeout >= 0:
            return int(self._producer.poll(timeout))
        while True:
            served = int(self._producer.poll(0.1))
            if served or not len(self._producer):
                return served

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every queued record is delivered or failed; return how many remain."""
        return int(self._producer.flush(-1 if timeout is None else timeout))

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        """Drop queued (and in-flight) records, as ``Producer.purge``; their callbacks report
        ``_PURGE_QUEUE``/``_PURGE_INFLIGHT`` errors, which pause their keys (PUB-2)."""
        self._producer.purge(in_queue, in_flight, blocking)

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        """Cluster metadata, as ``Producer.list_topics``."""
        return self._producer.list_topics(topic, timeout)

    def __len__(self) -> int:
        return len(self._producer)

    def __bool__(self) -> bool:
        return True  # an empty queue does not make the producer false (``__len__`` would)

    # -- what the ordered producer does not offer -------------------------------------------------
    def init_transactions(self, timeout: float = -1) -> None:
        """Not supported: raises ``UnsupportedOperationError``."""
        raise UnsupportedOperationError("init_transactions", _TRANSACTIONS)

    def begin_transaction(self) -> None:
        """Not supported: raises ``UnsupportedOperationError``."""
        raise UnsupportedOperationError("begin_transaction", _TRANSACTIONS)

    def commit_transaction(self, timeout: float = -1) -> None:
        """Not supported: raises ``UnsupportedOperationError``."""
        raise UnsupportedOperationError("commit_transaction", _TRANSACTIONS)

    def abort_transaction(self, timeout: float = -1) -> None:
        """Not supported: raises ``UnsupportedOperationError``."""
        raise UnsupportedOperationError("abort_transaction", _TRANSACTIONS)

    def send_offsets_to_transaction(self, positions: Any, group_metadata: Any, timeout: float = -1) -> None:
        """Not supported: raises ``UnsupportedOperationError``."""
        raise UnsupportedOperationError("send_offsets_to_transaction", _TRANSACTIONS)

    def close(self, timeout: float | None = None) -> int:
        """Flush, then stop the poll thread. Returns the number of records still undelivered."""
        if self._closed:
            return 0
        self._activation.close()
        remaining = self.flush(timeout)
        self._closed = True
        self._poller.stop()
        self._producer.poll(0)
        if self._book is not None:
            self._book.close()
        if self._metrics:
            metrics.unregister(self)
        return remaining

    def __enter__(self) -> OrderedProducer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
