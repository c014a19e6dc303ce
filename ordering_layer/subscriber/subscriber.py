"""The Pub/Sub-shaped front end over the engine: ``Subscriber`` (callback and pull modes)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, cast

from ordering_layer import metrics
from ordering_layer.config import FlowControl, require_bootstrap
from ordering_layer.errors import ConfigError
from ordering_layer.kafka_config import read_kafka_config
from ordering_layer.publisher.activation import join_activation
from ordering_layer.scheduler.participant import Activation
from ordering_layer.state import StateStore
from ordering_layer.subscriber.client_config import redis_url_from, verify_credentials
from ordering_layer.subscriber.delivery_tracing import DeliveryTracing
from ordering_layer.subscriber.engine import Engine, known_partitions
from ordering_layer.subscriber.executors import AsyncWorkers, Callback, Handoff, handoff_for
from ordering_layer.subscriber.message import Message, ack_all
from ordering_layer.subscriber.runs import Hooks
from ordering_layer.tracing import tracer

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

_LOGGER = logging.getLogger(__name__)


class StreamingPullFuture:
    """Handle of a callback subscription: ``cancel()`` stops it, ``result()`` waits for the end."""

    def __init__(self, engine: Engine, pool: Handoff, activation: Activation,
                 tracing: DeliveryTracing | None = None) -> None:
        self.engine = engine
        self._pool = pool
        self._activation = activation
        self._tracing = tracing
        self._done = threading.Event()
        self._lock = threading.Lock()

    def cancel(self, timeout: float = 30.0) -> bool:
        """Stop receiving, let running callbacks finish (up to ``timeout``), commit, leave the group."""
        with self._lock:
            if self._done.is_set():
                return False
            self.engine.close(timeout)
            metrics.unregister(self.engine)
            self._pool.shutdown()
            self._activation.close()
            if self._tracing is not None:
                self._tracing.close()
            self._done.set()
            return True

    def cancelled(self) -> bool:
        """True once cancelled."""
        return self._done.is_set()

    def done(self) -> bool:
        """True once cancelled."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> None:
        """Block until the subscription is cancelled (or ``timeout`` passes: TimeoutError)."""
        if not self._done.wait(timeout):
            raise TimeoutError("subscription still running")

    def __enter__(self) -> StreamingPullFuture:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()


class Subscriber:
    """Receives messages of subscriptions, in callback mode (``subscribe``) or pull mode (``pull``).

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers`` required; e.g.
            ``session.timeout.ms`` passes through).
        redis_url: the Redis holding the subscriptions' state (default ``$ORDERING_LAYER_REDIS_URL``).
        metrics_port: serve Prometheus metrics of this subscriber's subscriptions on this port
            (``ordering_layer.metrics``); None: no endpoint.
        tracing: an OpenTelemetry span per delivery, child of the publish span named by the
            record's trace headers (``ordering_layer.tracing``; needs ``opentelemetry-api``). None:
            on when ``$ORDERING_LAYER_TRACING`` is ``1`` or a ``tracer_provider`` is given.
        tracer_provider: the provider of the delivery spans (default: the global one).

    Raises:
        ConfigError: ``bootstrap.servers`` or the Redis URL is missing, the metrics port cannot
            be bound, or tracing is asked for without ``opentelemetry-api``.
        AuthenticationError: Kafka (``server="kafka"``) or Redis (``server="redis"``) refused the
            credentials or the TLS handshake.
    """

    def __init__(self, kafka_config: Mapping[str, Any], *, redis_url: str | None = None,
                 metrics_port: int | None = None, tracing: bool | None = None,
                 tracer_provider: TracerProvider | None = None) -> None:
        self._kafka = read_kafka_config(kafka_config)
        require_bootstrap(self._kafka)
        verify_credentials(self._kafka)
        self._redis_url = redis_url_from(redis_url)
        self._store = StateStore(self._redis_url, kafka_config=self._kafka)
        # PUB-5: a running subscription takes part in activating scheduled messages; pull mode
        # from its first pull until close().
        self._pull_activation: Activation | None = None
        self._pull_engines: dict[str, Engine] = {}
        self._last_pull: dict[str, list[Message]] = {}
        # Decided once: with tracing off callbacks and pulled messages are handed out as they are.
        self._tracer = tracer(tracing, tracer_provider)
        self._pull_tracing: dict[str, DeliveryTracing] = {}
        self._lock = threading.Lock()
        self._metrics_port = metrics_port
        if metrics_port is not None:
            metrics.start_metrics_server(metrics_port)

    def subscribe(self, subscription: str, callback: Callback, *,
                  flow_control: FlowControl | None = None, max_workers: int = 10,
                  track_leases: bool = True,
                  executor: Executor | asyncio.AbstractEventLoop | AsyncWorkers | None = None) -> StreamingPullFuture:
        """Deliver the subscription's messages to ``callback`` on a pool of ``max_workers`` threads.

        With ordering, one message per key is outstanding at a time (SUB-1); keys are independent
        (SUB-2). A callback that raises nacks its message. With tracing on each callback runs in its
        delivery's span (``ordering_layer.tracing``). ``track_leases=False`` turns lease
        deadlines off (no expiry, no extension, no lease writes): for benchmarks only.

        Where the callback runs (SUB-9, ``executors``): a coroutine function (``async def``) is
        awaited on an event loop the subscriber runs in a thread of its own, as many keys at once
        as flow control lets out, or on ``executor`` when that is an event loop (running in a
        thread of yours; cancelling waits for its callbacks and leaves it running), or by a fixed
        number of worker coroutines on one (``AsyncWorkers``: at most that many at once). Otherwise
        ``executor``: a ``ThreadPoolExecutor`` (or any executor running callables in this
        process) runs the callbacks instead of the subscriber's threads; a
        ``ProcessPoolExecutor`` runs a picklable top-level callback on a picklable copy of each
        message (``processes.MessageCopy``) in its worker processes, returning acks, raising nacks,
        a process that dies nacks what it held (the pool is replaced). The executor stays yours:
        cancelling does not shut it down.

        Raises:
            SubscriptionNotFoundError: the subscription was never created.
            ConfigError: a ``concurrent.futures`` executor with a coroutine function, an event loop
                with a plain function or not running, or a callback for worker processes that cannot
                be pickled.
        """
        settings = self._store.settings(subscription)
        tracing = None if self._tracer is None else DeliveryTracing(self._tracer, subscription)
        plain = cast(Callable[[Message], Any], callback)  # a MessageCopy's only with worker processes
        handler = plain if tracing is None else tracing.wrap(plain)

        def begin(message: Message) -> bool:
            # ACK-6: the start counts the attempt (written first for a suspect, noted under a
            # dead-letter policy, nothing to do otherwise).
            return not (message.suspect or engine.notes_starts) or engine.begin(message)

        def run(message: Message) -> None:
            if (message.suspect or engine.notes_starts) and not engine.begin(message):  # ``begin``, inline
                return
            try:
                handler(message)
            except Exception as exc:  # noqa: BLE001 - user code; its failure is a nack
                _LOGGER.warning("callback failed on %r: %r; nacking", message, exc)
                message.nack(error=repr(exc))

        hooks = Hooks(begin, give_back=lambda messages: engine.give_back(messages),
                      current=lambda message: engine.owns(message))
        pool = handoff_for(f"ordering-layer-cb-{subscription}", callback, executor=executor,
                           max_workers=max_workers, run=run, hooks=hooks, tracing=tracing)

        engine = Engine(self._kafka, self._store, subscription, settings,
                        flow_control=flow_control or FlowControl(), on_messages=pool.submit,
                        track_leases=track_leases, watch=pool.watch,
                        partitions=known_partitions(self._store, settings.topic))
        engine.start()
        if self._metrics_port is not None:
            metrics.register(engine, kafka_config=self._kafka)
        return StreamingPullFuture(engine, pool, join_activation(self._kafka, self._redis_url), tracing)

    def pull(self, subscription: str, max_messages: int = 100, timeout: float = 1.0, *,
             commit_on_get: bool = False, flow_control: FlowControl | None = None) -> list[Message]:
        """Pull up to ``max_messages``: at most one batch per key is outstanding, in order (SUB-1).

        The first pull joins the subscription's group; the membership lasts until ``close()``.
        With ``commit_on_get`` each pull first acks everything the previous pull returned (GRP-4).
        """
        if max_messages < 1:
            raise ConfigError("max_messages must be >= 1")
        with self._lock:
            engine = self._pull_engines.get(subscription)
            if engine is None:
                settings = self._store.settings(subscription)
                engine = Engine(self._kafka, self._store, subscription, settings,
                                flow_control=flow_control or FlowControl(), on_messages=None,
                                partitions=known_partitions(self._store, settings.topic))
                engine.start()
                self._pull_engines[subscription] = engine
                if self._tracer is not None:
                    self._pull_tracing[subscription] = DeliveryTracing(self._tracer, subscription)
                if self._metrics_port is not None:
                    metrics.register(engine, kafka_config=self._kafka)
                if self._pull_activation is None:
                    self._pull_activation = join_activation(self._kafka, self._redis_url)
            previous = self._last_pull.pop(subscription, [])
        if commit_on_get:
            self.acknowledge(previous)
        messages = engine.pull(max_messages, timeout)
        if self._tracer is not None:
            tracing = self._pull_tracing.get(subscription)  # None once close() took it
            if tracing is not None:
                tracing.deliver_all(messages)
        with self._lock:
            self._last_pull[subscription] = messages
        return messages

    @staticmethod
    def acknowledge(messages: Iterable[Message]) -> None:
        """Ack a batch of pulled messages without fetching more (GRP-5): one request per subscription,
        not one per message."""
        ack_all(messages)

    def close(self, timeout: float = 30.0) -> None:
        """Leave the groups joined by ``pull`` (outstanding pulled messages get ``timeout`` to be acked)."""
        with self._lock:
            engines, self._pull_engines = list(self._pull_engines.values()), {}
            activation, self._pull_activation = self._pull_activation, None
            tracings, self._pull_tracing = list(self._pull_tracing.values()), {}
        if activation is not None:
            activation.close()
        for engine in engines:
            engine.close(timeout)
            metrics.unregister(engine)
        for tracing in tracings:
            tracing.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
