"""``OrderedConsumer``: the shape of ``confluent_kafka.Consumer`` with per-key order (DRP-2).

A program written for confluent-kafka runs with the import swapped. ``group.id`` names the
subscription (created with default settings, ordering on, when missing; ``auto.offset.reset``
chooses its start). ``poll``/``consume`` return ``Message`` objects with confluent-kafka's accessors.
With ``enable.auto.commit`` (confluent's default) what a ``poll``/``consume`` returned is acked at the
next ``poll``/``consume``/``close`` of the consumer, so a plain poll-process loop gets per-key order
and at-least-once unchanged; with it off, ``ack()``/``nack()`` or ``commit(...)`` settle explicitly.
With ``enable.auto.offset.store=false`` nothing is acked by the next poll: ``store_offsets(msg)``
acks, as storing an offset marks a message processed in confluent-kafka.

The settings are read as librdkafka reads them (``kafka_config.read_kafka_config``: the nested
``default.topic.config``, the ``auto.offset.reset`` aliases, strings for booleans); one the layer
cannot honour is refused with a ``ConfigError`` naming it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from confluent_kafka import TopicPartition

from ordering_layer import metrics
from ordering_layer._core import unsettled
from ordering_layer.config import FlowControl, StartPosition, SubscriptionSettings, require_bootstrap
from ordering_layer.errors import (
    ConfigError,
    LeaseLostError,
    SubscriptionExistsError,
    SubscriptionNotFoundError,
    UnsupportedOperationError,
)
from ordering_layer.kafka_config import CONSUMER_HONOURS, flag, offset_reset, read_kafka_config, refuse_unhonoured
from ordering_layer.publisher.activation import join_activation
from ordering_layer.state import StateStore
from ordering_layer.subscriber.client_config import redis_url_from, verify_credentials
from ordering_layer.subscriber.delivery_tracing import DeliveryTracing
from ordering_layer.subscriber.engine import Engine, RebalanceHooks, known_partitions
from ordering_layer.subscriber.message import AckResponse, Message
from ordering_layer.subscriptions import Subscriptions
from ordering_layer.tracing import tracer

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

_LOGGER = logging.getLogger(__name__)

_WAIT_STEP = 1.0  # an endless poll waits in steps of this many seconds
_MAX_MESSAGES = 1_000_000  # confluent-kafka's limit for consume(num_messages)
_PER_KEY = "per-key order and per-message acks need the group protocol to own partitions"
UserRebalanceCallback = Callable[[Any, list[TopicPartition]], None]


class OrderedConsumer:
    """Drop-in ``confluent_kafka.Consumer``: ``OrderedConsumer(conf)``, ``(conf, **more)`` or ``(**conf)``.

    Args:
        config: confluent-kafka settings (``bootstrap.servers`` and ``group.id`` required; the rest
            pass through, e.g. ``session.timeout.ms``, ``logger``).
        redis_url: the layer's Redis; default ``$ORDERING_LAYER_REDIS_URL``.
        flow_control: limits on outstanding messages (SUB-7).
        metrics_port: serve Prometheus metrics of this consumer's subscription on this port
            (``ordering_layer.metrics``); None: no endpoint.
        tracing: an OpenTelemetry span per message returned, from ``poll``/``consume`` to its ack or
            nack (``ordering_layer.tracing``). None: on when ``$ORDERING_LAYER_TRACING`` is ``1`` (a
            drop-in program's switch) or a ``tracer_provider`` is given.
        tracer_provider: the provider of the delivery spans (default: the global one).

    Raises:
        ConfigError: missing bootstrap, group or Redis URL; a setting that cannot be read or honoured
            (``setting`` names it); the metrics port cannot be bound; tracing asked for without
            ``opentelemetry-api``.
        AuthenticationError: Kafka (``server="kafka"``) or Redis (``server="redis"``) refused the
            credentials or the TLS handshake.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, /, *, redis_url: str | None = None,
                 flow_control: FlowControl | None = None, metrics_port: int | None = None,
                 tracing: bool | None = None, tracer_provider: TracerProvider | None = None,
                 **kwargs: Any) -> None:
        conf = read_kafka_config(config, kwargs)
        require_bootstrap(conf)
        if not conf.get("group.id"):
            raise ConfigError("OrderedConsumer needs 'group.id' (the subscription name)", setting="group.id")
        refuse_unhonoured(conf, CONSUMER_HONOURS, "OrderedConsumer")
        self._auto_commit = flag(conf, "enable.auto.commit", True)
        self._auto_store = flag(conf, "enable.auto.offset.store", True)
        self._start = StartPosition.LATEST if offset_reset(conf) == "latest" else StartPosition.TRIM_HORIZON
        verify_credentials(conf)
        self._config = conf
        self._redis_url = redis_url_from(redis_url)
        self._store = StateStore(self._redis_url, kafka_config=conf)
        self._activation = join_activation(conf, self._redis_url)  # PUB-5
        self._flow_control = flow_control or FlowControl()
        self._engine: Engine | None = None
        self._tracer = tracer(tracing, tracer_provider)  # decided once; None: off
        self._tracing: DeliveryTracing | None = None  # of the current subscription, with tracing on
        self._topic = ""
        self._returned: list[Message] = []  # returned by poll/consume, not yet settled through us
        self._closed = False
        self._metrics_port = metrics_port
        if metrics_port is not None:
            metrics.start_metrics_server(metrics_port)

    # -- subscribing -------------------------------------------------------------------------------
    def subscribe(self, topics: list[str], on_assign: UserRebalanceCallback | None = None,
                  on_revoke: UserRebalanceCallback | None = None,
                  on_lost: UserRebalanceCallback | None = None) -> None:
        """Join the subscription's group for its one topic; callbacks get ``(consumer, partitions)``.

        The callbacks run on the consumer's fetch thread (confluent-kafka runs them inside
        ``poll``): on_assign after the partitions are claimed, on_revoke before they are let go.

        Raises:
            ConfigError: not exactly one topic, a regex, or a subscription of another topic.
        """
        self._check_open()
        if len(topics) != 1 or topics[0].startswith("^"):
            raise ConfigError("OrderedConsumer subscribes to exactly one topic (a subscription consumes one)")
        if self._engine is not None:
            raise ConfigError("already subscribed; unsubscribe() first")
        topic = topics[0]
        name = str(self._config["group.id"])
        try:
            settings = self._store.settings(name)
        except SubscriptionNotFoundError:
            settings = self._create(name, topic)
        if settings.topic != topic:
            raise ConfigError(f"subscription {name!r} consumes {settings.topic!r}, not {topic!r}")
        hooks = RebalanceHooks(self._bind(on_assign), self._bind(on_revoke), self._bind(on_lost))
        self._engine = Engine(self._config, self._store, name, settings, flow_control=self._flow_control,
                              on_messages=None, rebalance=hooks, partitions=known_partitions(self._store, topic))
        self._topic = topic
        if self._tracer is not None:
            self._tracing = DeliveryTracing(self._tracer, name)
        self._engine.start()
        if self._metrics_port is not None:
            metrics.register(self._engine, kafka_config=self._config)

    def _create(self, name: str, topic: str) -> SubscriptionSettings:
        subscriptions = Subscriptions(self._config, redis_url=self._redis_url)
        with contextlib.suppress(SubscriptionExistsError):  # created meanwhile by another consumer
            subscriptions.create_subscription(name, topic=topic, start=self._start)
        _LOGGER.info("created subscription %s of %s (ordering on, start %s)", name, topic, self._start.kind)
        return self._store.settings(name)

    def _bind(self, callback: UserRebalanceCallback | None) -> Callable[[list[TopicPartition]], None] | None:
        if callback is None:
            return None
        return lambda partitions: callback(self, partitions)

    def unsubscribe(self) -> None:
        """Leave the group (what was returned and auto-committed is acked first)."""
        self._auto_ack()
        engine, self._engine = self._engine, None
        tracing, self._tracing = self._tracing, None
        if engine is not None:
            engine.close()
            metrics.unregister(engine)
        if tracing is not None:
            tracing.close()

    # -- receiving ---------------------------------------------------------------------------------
    def poll(self, timeout: float | None = None) -> Message | None:
        """One message, or None after ``timeout`` seconds (None or negative: wait until one comes)."""
        messages = self._receive(1, timeout)
        return messages[0] if messages else None

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        """Up to ``num_messages`` (at most one batch per key, in order), waiting up to ``timeout`` s
        (negative: until some come). It returns what is ready rather than waiting for the full
        count: a key's next messages cannot come before the ones returned are settled.

        Raises:
            ValueError: ``num_messages`` outside 1..1,000,000 (as confluent-kafka).
        """
        if not 1 <= num_messages <= _MAX_MESSAGES:
            raise ValueError(f"num_messages must be between 1 and {_MAX_MESSAGES}")
        return self._receive(num_messages, timeout)

    def _receive(self, count: int, timeout: float | None) -> list[Message]:
        engine = self._require()
        self._auto_ack()
        if timeout is not None and timeout >= 0:
            messages = engine.pull(count, timeout)
        else:
            messages = []
            while not messages:
                messages = engine.pull(count, _WAIT_STEP)
        # Messages settled through Message.ack() or nack() go: a consumer that acks each message
        # and never commits would otherwise keep every message it was ever returned.
        self._prune()
        self._returned.extend(messages)
        if self._tracing is not None:
            self._tracing.deliver_all(messages)
        return messages

    def _auto_ack(self) -> None:
        if self._auto_commit and self._auto_store and self._returned:
            for message in self._returned:
                if not message.settled:
                    message.ack()
            self._returned = []

    # -- committing --------------------------------------------------------------------------------
    def commit(self, message: Message | None = None, offsets: list[TopicPartition] | None = None,
               asynchronous: bool = True) -> list[TopicPartition] | None:
        """Ack explicitly: ``message`` alone; with ``offsets``, every returned message below each
        offset of those partitions; with neither, everything returned so far. Synchronous commits
        wait until Redis has the acks and return the offsets acked up to.

        Raises:
            LeaseLostError: (synchronous) an ack was refused: the partition moved to another owner.
        """
        self._require()
        chosen = self._chosen(message, offsets)
        if asynchronous:
            for m in chosen:
                m.ack()
            self._prune()
            return None
        answers: list[tuple[Message, Future[AckResponse]]] = [(m, m.ack_with_response()) for m in chosen]
        self._prune()
        done: dict[int, int] = {}
        for m, answer in answers:
            if answer.result() not in (AckResponse.SUCCESS, AckResponse.INVALID_ACK_ID):
                raise LeaseLostError(f"ack of {m.topic()}:{m.partition()}:{m.offset()} refused: "
                                     f"{answer.result().value}", partition=m.partition(), offset=m.offset())
            done[m.partition()] = max(done.get(m.partition(), 0), m.offset() + 1)
        return [TopicPartition(self._topic, p, o) for p, o in sorted(done.items())]

    def store_offsets(self, message: Message | None = None, offsets: list[TopicPartition] | None = None) -> None:
        """Mark messages processed, as confluent-kafka's ``store_offsets``: here that acks them (the
        layer settles message by message and commits the lowest unsettled offset itself).
        ``message`` alone, or every returned message below each offset of ``offsets``.

        Raises:
            ValueError: neither or both of ``message`` and ``offsets``.
        """
        self._require()
        if message is None and offsets is None:
            raise ValueError("store_offsets takes message or offsets")
        for m in self._chosen(message, offsets):
            m.ack()
        self._prune()

    def _chosen(self, message: Message | None, offsets: list[TopicPartition] | None) -> list[Message]:
        """The unsettled messages that ``message``/``offsets`` name (all returned ones for neither)."""
        if message is not None and offsets is not None:
            raise ValueError("pass message or offsets, not both")
        if message is not None:
            chosen = [message]
        elif offsets is not None:
            limits = {(tp.topic, tp.partition): tp.offset for tp in offsets}
            chosen = [m for m in self._returned if m.offset() < limits.get((m.topic(), m.partition()), -1)]
        else:
            chosen = list(self._returned)
        return [m for m in chosen if not m.settled]

    def _prune(self) -> None:
        self._returned = unsettled(self._returned)

    # -- metadata ----------------------------------------------------------------------------------
    def assignment(self) -> list[TopicPartition]:
        """The partitions this consumer owns now."""
        engine = self._require()
        return [TopicPartition(self._topic, p) for p in engine.assigned_partitions()]

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        """Cluster metadata, as ``Consumer.list_topics``."""
        return self._require().consumer.list_topics(topic, timeout)

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float = -1,
                              cached: bool = False) -> tuple[int, int]:
        """Low and high watermark of a partition, as ``Consumer.get_watermark_offsets``."""
        low, high = self._require().consumer.get_watermark_offsets(partition, timeout, cached)
        return int(low), int(high)

    def committed(self, partitions: list[TopicPartition], timeout: float = -1) -> list[TopicPartition]:
        """The group's committed offsets: each partition's lowest offset not yet settled."""
        return list(self._require().consumer.committed(partitions, timeout))

    # -- what cannot be offered --------------------------------------------------------------------
    def assign(self, partitions: list[TopicPartition]) -> None:
        """Not supported (``UnsupportedOperationError``): partitions are owned through the group."""
        raise UnsupportedOperationError("assign", _PER_KEY)

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        """Not supported (``UnsupportedOperationError``)."""
        raise UnsupportedOperationError("incremental_assign", _PER_KEY)

    def seek(self, partition: TopicPartition) -> None:
        """Not supported: use ``Admin.seek(subscription, time=...)``, which keeps per-key order."""
        raise UnsupportedOperationError("seek", "a partition seek would break per-key order and acks; "
                                                "use Admin.seek(subscription, time=...) (GRP-3)")

    def pause(self, partitions: list[TopicPartition]) -> None:
        """Not supported: flow control pauses the fetch itself (SUB-7)."""
        raise UnsupportedOperationError("pause", "flow control pauses the fetch itself (SUB-7)")

    def resume(self, partitions: list[TopicPartition]) -> None:
        """Not supported: flow control resumes the fetch itself (SUB-7)."""
        raise UnsupportedOperationError("resume", "flow control resumes the fetch itself (SUB-7)")

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Ack what auto-commit owes, commit what is settled and leave the group."""
        if self._closed:
            return
        self.unsubscribe()
        self._activation.close()
        self._closed = True

    def _require(self) -> Engine:
        self._check_open()
        if self._engine is None:
            raise ConfigError("call subscribe() first")
        return self._engine

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Consumer closed")  # what confluent-kafka raises

    def __enter__(self) -> OrderedConsumer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
