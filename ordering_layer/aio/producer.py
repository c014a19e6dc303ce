"""``AIOOrderedProducer``: the shape of ``confluent_kafka.aio.AIOProducer`` over ``OrderedProducer`` (DRP-1).

``await producer.produce(topic, value, key)`` returns an ``asyncio.Future`` that resolves to the
delivered record (confluent-kafka's ``Message``) or raises ``KafkaException``, as confluent's does.
Produced messages are buffered and handed to the ``OrderedProducer`` in batches, one batch at a
time and in produce order (per-key order, PUB-1), on the executor: a batch goes at the event loop's
next turn, or at once from ``produce`` when ``batch_size`` are buffered (that ``produce`` then waits
for it: backpressure). Everything the sync producer gives stays: murmur2 routing by ordering key,
idempotence with ``acks=all``, per-key pause after a final failure (PUB-2), ``headers``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import Message as KafkaMessage

from ordering_layer.aio.calls import COMMON_CALLBACKS, CallGate, Lazy, callbacks_on_loop
from ordering_layer.config import PublisherSettings
from ordering_layer.errors import PublishError, UnsupportedOperationError
from ordering_layer.publisher import OrderedProducer
from ordering_layer.publisher.producer import DeliveryCallback, ProduceHeaders, produce_headers
from ordering_layer.record import HeaderValue, encode_ordering_key

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

T = TypeVar("T")
Delivery = asyncio.Future[KafkaMessage]


class _Buffered(NamedTuple):
    """A produced message waiting for its batch, and the future its delivery resolves."""

    topic: str
    value: bytes | str | None
    key: str | bytes | None
    partition: int
    timestamp: int
    headers: list[tuple[str, HeaderValue]] | None
    on_delivery: DeliveryCallback | None
    future: Delivery


class AIOOrderedProducer:
    """Drop-in ``confluent_kafka.aio.AIOProducer``: ``AIOOrderedProducer(conf, max_workers=4, ...)``.

    Made inside a running event loop. The ``OrderedProducer`` is made on the executor at the first
    call that needs it (its constructor checks the credentials with a metadata request), so a bad
    setting is raised by the first ``flush``, ``poll`` or delivery future rather than here.

    Args:
        producer_conf: confluent-kafka settings, as ``OrderedProducer`` takes them (``error_cb``,
            ``throttle_cb``, ``stats_cb``: coroutine functions or plain ones, run on the loop).
        max_workers: threads of the executor made when none is given.
        executor: where the blocking calls run (the caller's; not shut down by ``close``).
        batch_size: buffered messages that make ``produce`` hand them on at once (and wait).
        buffer_timeout: the longest a buffered message waits, in confluent's signature; here it
            never waits past the loop's next turn, so any value is met.
        settings: as ``OrderedProducer`` takes it.
        redis_url: as ``OrderedProducer`` takes it.
        metrics_port: as ``OrderedProducer`` takes it.
        tracer_provider: as ``OrderedProducer`` takes it.

    Raises:
        RuntimeError: no event loop runs in this thread.
        ValueError: ``max_workers`` or ``batch_size`` below 1, a negative ``buffer_timeout``.
    """

    def __init__(self, producer_conf: Mapping[str, Any], max_workers: int = 4, executor: Executor | None = None,
                 batch_size: int = 1000, buffer_timeout: float = 1.0, *,
                 settings: PublisherSettings | Mapping[str, Any] | None = None, redis_url: str | None = None,
                 metrics_port: int | None = None, tracer_provider: TracerProvider | None = None) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if buffer_timeout < 0:
            raise ValueError("buffer_timeout must not be negative")
        self._gate = CallGate.made(executor, max_workers, "ordering-layer-aio-producer")
        conf = callbacks_on_loop(self._gate, producer_conf, COMMON_CALLBACKS)
        self._client = Lazy(self._gate, functools.partial(
            OrderedProducer, conf, settings=settings, redis_url=redis_url, metrics_port=metrics_port,
            tracer_provider=tracer_provider))
        self._batch_size = batch_size
        self._buffer: list[_Buffered] = []
        self._sender: asyncio.Task[None] | None = None
        self._closed = False

    async def __aenter__(self) -> AIOOrderedProducer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- producing -------------------------------------------------------------------------------
    async def produce(self, topic: str, value: bytes | str | None = None, key: str | bytes | None = None,
                      partition: int = -1, callback: DeliveryCallback | None = None,
                      on_delivery: DeliveryCallback | None = None, timestamp: int = 0,
                      headers: ProduceHeaders | None = None) -> Delivery:
        """Buffer a message; return the future of its delivery (the record, or ``KafkaException``).

        Arguments as ``OrderedProducer.produce``; ``key`` is the ordering key. ``on_delivery`` (or
        ``callback``, a plain or a coroutine function) is called on the loop with ``(err, msg)``. A
        message the producer refuses when its batch is handed on (a paused key, PUB-2; a missing
        topic) fails its future with the layer's error.

        Raises:
            InvalidOrderingKeyError, InvalidMessageError: a bad key or header names (PUB-4).
            PublishError: the producer is closed.
        """
        if self._closed:
            raise PublishError("producer is closed", topic=topic, ordering_key=None)
        if key is not None:
            encode_ordering_key(key)  # PUB-4 here, not in the future
        future: Delivery = self._gate.loop.create_future()
        self._buffer.append(_Buffered(topic, value, key, partition, timestamp,
                                      produce_headers(headers) if headers else None, on_delivery or callback, future))
        sender = self._send_soon()
        if len(self._buffer) >= self._batch_size:
            await asyncio.shield(sender)
        return future

    def _send_soon(self) -> asyncio.Task[None]:
        """The task handing the buffer on, started if none runs (it drains what comes meanwhile)."""
        if self._sender is None or self._sender.done():
            self._sender = self._gate.loop.create_task(self._send_buffered())
        return self._sender

    async def _send_buffered(self) -> None:
        while self._buffer:
            batch, self._buffer = self._buffer, []
            try:
                producer = await self._client.get()
                refused = await self._gate.call(functools.partial(self._send_batch, producer, batch))
            except Exception as exc:  # noqa: BLE001 - no producer (a bad setting): every future is told
                refused = [(item.future, exc) for item in batch]
            for future, failure in refused:
                if not future.done():
                    future.set_exception(failure)

    def _send_batch(self, producer: OrderedProducer, batch: list[_Buffered]) -> list[tuple[Delivery, Exception]]:
        """Hand a batch to the producer (on the executor); the messages it refused, with why."""
        refused: list[tuple[Delivery, Exception]] = []
        for item in batch:
            try:
                producer.produce(item.topic, item.value, item.key, item.partition,
                                 functools.partial(self._delivered, item.future, item.on_delivery),
                                 None, item.timestamp, item.headers)
            except Exception as exc:  # noqa: BLE001 - that message's failure, for its future
                refused.append((item.future, exc))
        return refused

    def _delivered(self, future: Delivery, on_delivery: DeliveryCallback | None,
                   err: KafkaError | None, msg: KafkaMessage) -> None:
        """A delivery report (on the producer's thread): resolved on the loop."""
        self._gate.soon(self._resolve, future, on_delivery, err, msg)

    def _resolve(self, future: Delivery, on_delivery: DeliveryCallback | None, err: KafkaError | None,
                 msg: KafkaMessage) -> None:
        if not future.done():  # else purged, or cancelled by its awaiter
            if err is None:
                future.set_result(msg)
            else:
                future.set_exception(KafkaException(err))
        if on_delivery is not None:
            result = on_delivery(err, msg)
            if inspect.isawaitable(result):
                self._gate.background(result)

    async def _run(self, call: Callable[[OrderedProducer], T]) -> T:
        producer = await self._client.get()
        return await self._gate.call(functools.partial(call, producer))

    async def _drain(self) -> None:
        if self._buffer or (self._sender is not None and not self._sender.done()):
            await asyncio.shield(self._send_soon())

    # -- serving and waiting ---------------------------------------------------------------------
    async def poll(self, timeout: float = 0) -> int:
        """Serve delivery reports, as ``Producer.poll`` (a background thread serves them too)."""
        return await self._run(lambda producer: producer.poll(timeout))

    async def flush(self, timeout: float | None = None) -> int:
        """Hand on the buffer, then wait until every message is delivered or failed (up to
        ``timeout`` seconds; None: no limit); return how many remain."""
        await self._drain()
        if self._client.value is None:
            return len(self._buffer)
        return await self._run(lambda producer: producer.flush(timeout))

    async def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        """Drop the buffered messages (their futures cancelled) and, as ``Producer.purge``, the
        queued ones (their futures fail; their keys pause, PUB-2)."""
        buffered, self._buffer = self._buffer, []
        for item in buffered:
            item.future.cancel()
        if self._client.value is not None:
            await self._run(lambda producer: producer.purge(in_queue, in_flight, blocking))

    def __len__(self) -> int:
        """Messages buffered here plus those queued in the producer."""
        producer = self._client.value
        return len(self._buffer) + (len(producer) if producer is not None else 0)

    def __bool__(self) -> bool:
        return True  # an empty queue does not make the producer false (``__len__`` would)

    # -- metadata --------------------------------------------------------------------------------
    async def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        """Cluster metadata, as ``Producer.list_topics``."""
        return await self._run(lambda producer: producer.list_topics(topic, timeout))

    async def cluster_id(self, timeout: float = -1) -> str | None:
        """The cluster's id (from its metadata)."""
        return (await self.list_topics(None, timeout)).cluster_id  # type: ignore[no-any-return]

    # -- what the ordered producer does not offer --------------------------------------------------
    async def init_transactions(self, timeout: float = -1) -> None:
        """Not supported: raises ``UnsupportedOperationError`` (as ``OrderedProducer``)."""
        await self._run(lambda producer: producer.init_transactions(timeout))

    async def begin_transaction(self) -> None:
        """Not supported: raises ``UnsupportedOperationError`` (as ``OrderedProducer``)."""
        await self._run(lambda producer: producer.begin_transaction())

    async def send_offsets_to_transaction(self, positions: Any, group_metadata: Any, timeout: float = -1) -> None:
        """Not supported: raises ``UnsupportedOperationError`` (as ``OrderedProducer``)."""
        await self._run(lambda producer: producer.send_offsets_to_transaction(positions, group_metadata, timeout))

    async def commit_transaction(self, timeout: float = -1) -> None:
        """Not supported: raises ``UnsupportedOperationError`` (as ``OrderedProducer``)."""
        await self._run(lambda producer: producer.commit_transaction(timeout))

    async def abort_transaction(self, timeout: float = -1) -> None:
        """Not supported: raises ``UnsupportedOperationError`` (as ``OrderedProducer``)."""
        await self._run(lambda producer: producer.abort_transaction(timeout))

    async def set_sasl_credentials(self, username: str, password: str) -> None:
        """Not supported: raises ``UnsupportedOperationError`` (the credentials come from the settings)."""
        raise UnsupportedOperationError(
            "set_sasl_credentials", "the layer's Kafka clients take their credentials from the settings")

    # -- lifecycle -------------------------------------------------------------------------------
    async def close(self) -> None:
        """Flush, close the ``OrderedProducer`` (its poll thread) and shut down the executor made here."""
        if self._closed:
            return
        self._closed = True
        await self._drain()
        if self._client.value is not None:
            await self._run(lambda producer: producer.close())
        await self._gate.shutdown()
