"""``Scheduler``: activates due scheduled messages (PUB-5).

Each step claims due ids in Redis with a lease (several schedulers share the work; a crashed one's
claims come back when its lease ends), publishes each through the producer it was given (an
``OrderedProducer``: ``publisher.activation`` binds it) with ``message_id=<schedule id>`` (a new
sequence number, the same ordering key, and an id that makes a duplicate after a crash
detectable), then marks them activated in Redis and in the schedule topic. A missing index (Redis
lost or flushed) is rebuilt from the schedule topic first.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

import redis

from ordering_layer.config import from_mapping
from ordering_layer.errors import ConfigError, OrderingLayerError
from ordering_layer.kafka_config import connection_settings
from ordering_layer.record import now_ms
from ordering_layer.scheduler.book import ScheduleBook
from ordering_layer.scheduler.records import ScheduledMessage, ScheduleState
from ordering_layer.scheduler.settings import SchedulerSettings
from ordering_layer.worker import Worker

_LOGGER = logging.getLogger(__name__)

_PUBLISH_TIMEOUT = 30.0
_SWEEP_EVERY = 60.0
REDIS_RETRY = 1.0  # seconds between steps while Redis does not answer


class Publisher(Protocol):
    """What the scheduler publishes through (``OrderedProducer`` is one)."""

    def publish(self, topic: str, data: bytes, ordering_key: str | bytes | None = None,
                attributes: Mapping[str, str] | None = None, *, message_id: str | None = None) -> Future[Any]:
        """Publish one message; the future resolves once the broker has it."""

    def close(self, timeout: float | None = ...) -> Any:
        """Flush and close."""


MakePublisher = Callable[[Mapping[str, Any]], Publisher]  # connection settings -> a publisher of its own


class Scheduler:
    """Activates due scheduled messages on a named daemon thread until ``stop``.

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers`` at least).
        redis_url: the Redis holding the time index.
        producer: the producer to publish through (shared: not closed at ``stop``).
        make_producer: without ``producer``, makes the scheduler's own on the first activation (from
            the connection settings of ``kafka_config``); it is closed at ``stop``.
        settings: ``SchedulerSettings`` or a mapping of its fields.
        book: a ``ScheduleBook`` to share (e.g. the producer's own); made from the above otherwise.

    Raises:
        ConfigError: an unknown or invalid setting; neither ``producer`` nor ``make_producer``.
    """

    def __init__(self, kafka_config: Mapping[str, Any], redis_url: str, *,
                 producer: Publisher | None = None, make_producer: MakePublisher | None = None,
                 settings: SchedulerSettings | Mapping[str, Any] | None = None,
                 book: ScheduleBook | None = None, name: str = "ordering-layer-scheduler") -> None:
        if producer is None and make_producer is None:
            raise ConfigError("a Scheduler publishes through producer= or one made by make_producer=")
        self._make_producer = make_producer
        self.settings = from_mapping(SchedulerSettings, settings)
        self._kafka = dict(kafka_config)
        self.book = book or ScheduleBook(kafka_config, redis_url, self.settings)
        self._producer = producer
        self._own_producer = producer is None
        self._worker = Worker(name, self._step)
        self._lock = threading.Lock()
        self._next_sweep = 0.0
        self.activated = 0  # messages this scheduler published and marked activated
        self._redis_down = False  # the last step could not reach Redis (logged once per outage)

    def start(self) -> None:
        """Start activating. Raises ``RuntimeError`` when started before."""
        self._worker.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop after the step under way; close the producer it made itself."""
        self._worker.stop(timeout)
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is not None and self._own_producer:
            producer.close(timeout)
        self.book.close()

    def _publisher(self) -> Publisher:
        with self._lock:
            if self._producer is None:
                assert self._make_producer is not None
                self._producer = self._make_producer(connection_settings(self._kafka))
            return self._producer

    # -- one step --------------------------------------------------------------------------------
    def _step(self) -> float:
        """One step (``_activate_due``); while Redis does not answer, one warning per outage and a
        step every ``REDIS_RETRY`` seconds (what was claimed comes back when its lease ends)."""
        try:
            wait = self._activate_due()
        except redis.RedisError as exc:
            if not self._redis_down:
                self._redis_down = True
                _LOGGER.warning("scheduled messages wait: Redis does not answer (%s); trying again every %.0f s",
                                exc, REDIS_RETRY)
            return REDIS_RETRY
        if self._redis_down:
            self._redis_down = False
            _LOGGER.info("Redis answers again: activating scheduled messages")
        return wait

    def _activate_due(self) -> float:
        """Claim and activate what is due; return the seconds to wait before the next step."""
        settings = self.settings
        now = now_ms()
        claim = self.book.index.claim(now, int(settings.lease * 1000), settings.batch)
        if not claim.built:
            self.book.rebuild()
            return 0.0
        if claim.messages:
            self.activate(claim.messages)
            if len(claim.messages) >= settings.batch:
                return 0.0
        self._sweep()
        if claim.next_ms is None:
            return settings.poll_interval * random.uniform(0.8, 1.2)
        return max(0.0, min(settings.poll_interval, (claim.next_ms - now_ms()) / 1000))

    def activate(self, messages: list[ScheduledMessage]) -> int:
        """Publish claimed messages and mark those published activated; return how many.

        A message whose publish fails stays claimed: it is tried again when its lease ends.
        """
        producer = self._publisher()
        sent: list[tuple[ScheduledMessage, Future[Any]]] = []
        for message in messages:
            try:
                sent.append((message, producer.publish(message.topic, message.data, message.ordering_key,
                                                       message.attributes or None, message_id=message.schedule_id)))
            except OrderingLayerError as exc:
                _LOGGER.warning("scheduled message %s to %r not published (retried after its lease): %s",
                                message.schedule_id, message.topic, exc)
        published: dict[str, ScheduledMessage] = {}
        for message, future in sent:
            try:
                future.result(_PUBLISH_TIMEOUT)
            except (OrderingLayerError, TimeoutError) as exc:  # retried after the lease
                _LOGGER.warning("scheduled message %s to %r not published (retried after its lease): %r",
                                message.schedule_id, message.topic, exc)
            else:
                published[message.schedule_id] = message
        at = now_ms()
        fresh = self.book.index.complete(list(published), ScheduleState.ACTIVATED, at)
        self.book.log.write([published[i].finished(ScheduleState.ACTIVATED, at) for i in fresh])
        self.activated += len(published)
        return len(published)

    def _sweep(self) -> None:
        """Now and then, forget terminal states older than the retention (tombstones in the topic)."""
        if time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + _SWEEP_EVERY * random.uniform(0.8, 1.2)
        before = now_ms() - int(self.settings.done_retention * 1000)
        forgotten = self.book.index.sweep(before, self.settings.batch)
        self.book.log.forget(forgotten)
        if forgotten:
            _LOGGER.info("forgot %d schedule ids done before the retention", len(forgotten))

