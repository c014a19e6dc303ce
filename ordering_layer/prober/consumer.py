"""The prober's consuming side: a subscription consumed like a user would, every step recorded.

Three front ends: ``callback`` (``Subscriber.subscribe``), ``pull`` (``Subscriber.pull``) and
``consumer`` (``OrderedConsumer.consume`` with explicit acks). The handler waits a delay (fixed or
random in a range; much longer for slow keys), then nacks at random with ``nack_rate`` or acks. In
a pulled batch, the messages of one key are handled in order by one worker; after a nack the rest
of the key's batch is acked, which SUB-4 must still redeliver after the nacked one.

A poison message (``prober-poison`` attribute) is handled as it asks, whatever the plan: ``nack``
is nacked, ``exit`` ends this process with ``os._exit`` (a crash, DLQ-3), ``hold`` is held for
``poison_hold`` seconds (past its lease) and then acked.

Every delivery is recorded (``Delivery``) before the handler runs, every ack or nack
(``Settlement``) before it is sent, so the records precede what they cause; an ack's response is
recorded as ``ack_ok`` or ``ack_failed`` when it comes.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ordering_layer.config import FlowControl
from ordering_layer.errors import ConfigError
from ordering_layer.prober.events import (
    ACK,
    ACK_FAILED,
    ACK_OK,
    ATTR_POISON,
    NACK,
    POISON_EXIT,
    POISON_HOLD,
    POISON_NACK,
    Delivery,
    Event,
    Settlement,
    probe_fields,
)
from ordering_layer.subscriber import AckResponse, Message, OrderedConsumer, StreamingPullFuture, Subscriber
from ordering_layer.worker import Worker

_LOGGER = logging.getLogger(__name__)

EXIT_STATUS_POISON = 3  # the status a process ends with when a poison message of kind ``exit`` came

FRONT_ENDS = ("callback", "pull", "consumer")


@dataclass(frozen=True)
class HandlerPlan:
    """How the prober's handler behaves.

    Attributes:
        nack_rate: probability (0..1) of nacking a delivery.
        delay: (low, high) seconds of handling per message, uniform in the range (fixed when equal).
        slow_keys: ordering keys whose handling takes ``slow_delay`` seconds instead.
        slow_delay: seconds per message of a slow key.
        seed: seed of the nack and delay choices (None: random).
        poison_hold: seconds the handler holds a ``hold`` poison message before acking it.
    """

    nack_rate: float = 0.0
    delay: tuple[float, float] = (0.0, 0.0)
    slow_keys: frozenset[str] = field(default_factory=frozenset)
    slow_delay: float = 1.0
    seed: int | None = None
    poison_hold: float = 60.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.nack_rate <= 1.0:
            raise ConfigError(f"nack_rate must be within 0..1, got {self.nack_rate}")
        if not 0.0 <= self.delay[0] <= self.delay[1]:
            raise ConfigError(f"delay must be a range low <= high of seconds >= 0, got {self.delay}")
        if self.poison_hold < 0:
            raise ConfigError(f"poison_hold must be >= 0 seconds, got {self.poison_hold}")


class ProbeConsumer:
    """Consumes ``subscription`` with one front end and records what happens to ``sink``.

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers``).
        redis_url: the subscriptions' Redis.
        subscription: the subscription to consume; ``topic`` is its topic (for ``consumer``).
        front_end: ``callback``, ``pull`` or ``consumer``.
        handler: the handler's behaviour.
        sink: receives every ``Delivery`` and ``Settlement`` (called from several threads).
        subscriber_id: this subscriber's name in the records (unique per process).
        workers: callback threads, or pull-mode handler threads.
        batch_size: ``max_messages`` per pull.
        flow_control: the subscriber's limits.
    """

    def __init__(self, kafka_config: Mapping[str, Any], redis_url: str, subscription: str, topic: str, *,
                 front_end: str, handler: HandlerPlan, sink: Callable[[Event], None], subscriber_id: str,
                 workers: int = 10, batch_size: int = 100, flow_control: FlowControl | None = None) -> None:
        if front_end not in FRONT_ENDS:
            raise ConfigError(f"front end must be one of {FRONT_ENDS}, got {front_end!r}")
        self.front_end = front_end
        self.subscriber_id = subscriber_id
        self.deliveries = 0
        self.last_delivery = time.monotonic()
        self._kafka = dict(kafka_config)
        self._redis_url = redis_url
        self._subscription = subscription
        self._topic = topic
        self._plan = handler
        self._sink = sink
        self._workers = workers
        self._batch_size = batch_size
        self._flow_control = flow_control or FlowControl()
        self._random = random.Random(handler.seed)
        self._numbers = itertools.count(1)
        self._batches = itertools.count(1)
        self._stopping = threading.Event()
        self._subscriber: Subscriber | None = None
        self._streaming: StreamingPullFuture | None = None
        self._consumer: OrderedConsumer | None = None
        self._puller: Worker | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._groups = threading.BoundedSemaphore(2 * workers)

    def start(self) -> None:
        """Join the subscription and start handling."""
        if self.front_end == "callback":
            self._subscriber = Subscriber(self._kafka, redis_url=self._redis_url)
            self._streaming = self._subscriber.subscribe(self._subscription, self._on_message,
                                                         flow_control=self._flow_control, max_workers=self._workers)
            return
        if self.front_end == "pull":
            self._subscriber = Subscriber(self._kafka, redis_url=self._redis_url)
        else:
            self._consumer = OrderedConsumer({**self._kafka, "group.id": self._subscription,
                                              "enable.auto.commit": False},
                                             redis_url=self._redis_url, flow_control=self._flow_control)
            self._consumer.subscribe([self._topic])
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="prober-handler")
        self._puller = Worker("prober-pull", self._pull_step)
        self._puller.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking messages, let handlers finish (delays are cut short), leave the subscription."""
        self._stopping.set()
        if self._streaming is not None:
            self._streaming.cancel(timeout)
        if self._puller is not None:
            self._puller.stop(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._subscriber is not None:
            self._subscriber.close(timeout)
        if self._consumer is not None:
            self._consumer.close()

    # -- receiving ---------------------------------------------------------------------------------
    def _on_message(self, message: Message) -> None:
        self._handle(message, self._record(message, None), force_ack=False)

    def _pull_step(self) -> float:
        if self._consumer is not None:
            messages = self._consumer.consume(self._batch_size, 0.5)
        else:
            assert self._subscriber is not None
            messages = self._subscriber.pull(self._subscription, max_messages=self._batch_size, timeout=0.5,
                                             flow_control=self._flow_control)
        if not messages:
            return 0.0
        batch = next(self._batches)
        by_key: dict[str, list[tuple[Message, int]]] = {}
        for message in messages:
            by_key.setdefault(message.ordering_key, []).append((message, self._record(message, batch)))
        assert self._pool is not None
        for group in by_key.values():
            self._groups.acquire()  # at most two groups per handler thread queued: pull no faster
            future = self._pool.submit(self._handle_group, group)
            future.add_done_callback(self._group_done)
        return 0.0

    def _group_done(self, future: Future[None]) -> None:
        self._groups.release()
        error = future.exception()
        if error is not None:
            _LOGGER.error("prober handler failed; its messages stay unsettled until their leases end",
                          exc_info=error)

    def _handle_group(self, group: list[tuple[Message, int]]) -> None:
        nacked = False
        for message, number in group:
            nacked = self._handle(message, number, force_ack=nacked) or nacked

    # -- handling ----------------------------------------------------------------------------------
    def _record(self, message: Message, batch: int | None) -> int:
        number = next(self._numbers)
        fields = probe_fields(message.attributes)
        self._sink(Delivery(time.time(), self.subscriber_id, number, batch, message.ordering_key,
                            fields.run if fields else None, fields.seq if fields else None, message.message_id,
                            message.delivery_attempt, fields.published_at if fields else None))
        self.deliveries += 1
        self.last_delivery = time.monotonic()
        return number

    def _handle(self, message: Message, number: int, *, force_ack: bool) -> bool:
        """Handle one delivery; returns True when it was nacked."""
        plan = self._plan
        poison = message.attributes.get(ATTR_POISON)
        if poison == POISON_EXIT:
            _LOGGER.warning("poison message %s (attempt %d): ending the process", message.message_id,
                            message.delivery_attempt)
            os._exit(EXIT_STATUS_POISON)
        if poison == POISON_HOLD:
            delay = plan.poison_hold
        elif message.ordering_key in plan.slow_keys:
            delay = plan.slow_delay
        else:
            low, high = plan.delay
            delay = low if low == high else self._random.uniform(low, high)
        if delay > 0:
            self._stopping.wait(delay)
        nack = poison == POISON_NACK or \
            (not force_ack and plan.nack_rate > 0 and self._random.random() < plan.nack_rate)
        fields = probe_fields(message.attributes)
        run, seq = (fields.run, fields.seq) if fields else (None, None)

        def settlement(outcome: str) -> Settlement:
            return Settlement(time.time(), self.subscriber_id, number, message.ordering_key, run, seq,
                              message.delivery_attempt, outcome)

        if nack:
            self._sink(settlement(NACK))
            message.nack(error="prober: random nack")
            return True
        self._sink(settlement(ACK))

        def confirmed(future: Future[AckResponse]) -> None:
            ok = future.exception() is None and future.result() == AckResponse.SUCCESS
            self._sink(settlement(ACK_OK if ok else ACK_FAILED))

        message.ack_with_response().add_done_callback(confirmed)
        return False
