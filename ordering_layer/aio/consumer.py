"""``AIOOrderedConsumer``: the shape of ``confluent_kafka.aio.AIOConsumer`` over ``OrderedConsumer`` (DRP-2).

Every method is a coroutine running the ``OrderedConsumer`` call on the executor, so a program
written for ``confluent_kafka.aio`` runs with the import swapped and keeps per-key order, per-message
acks and cascade redelivery. As there, calls that receive or settle (``poll``, ``consume``,
``commit``, ``store_offsets``, ``subscribe``, ``unsubscribe``, ``close``) run one at a time; a call
made from a rebalance or commit callback is admitted at once. The callbacks (``on_assign``,
``on_revoke``, ``on_lost``; ``error_cb``, ``throttle_cb``, ``stats_cb``, ``on_commit`` in the
settings) may be coroutine functions, as ``confluent_kafka.aio`` wants them, or plain ones; they run
on the event loop and get this wrapper as their consumer.

A ``poll`` or ``consume`` whose coroutine is cancelled (``asyncio.wait_for``, a task cancelled)
gives back what it receives: those messages are nacked and delivered again (SUB-3), their delivery
attempt counted, instead of being auto-committed unseen.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, TypeVar

from confluent_kafka import TopicPartition

from ordering_layer.aio.calls import COMMON_CALLBACKS, CallGate, Lazy, callbacks_on_loop, on_loop
from ordering_layer.config import FlowControl
from ordering_layer.errors import UnsupportedOperationError
from ordering_layer.subscriber import Message, OrderedConsumer

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

T = TypeVar("T")
RebalanceCallback = Callable[[Any, list[TopicPartition]], Any]

_CALLBACKS = (*COMMON_CALLBACKS, "on_commit")
_PER_KEY = "per-key order and per-message acks need the group protocol to own partitions"


def _one(message: Message | None) -> Iterable[Message]:
    return () if message is None else (message,)


class AIOOrderedConsumer:
    """Drop-in ``confluent_kafka.aio.AIOConsumer``: ``AIOOrderedConsumer(conf, max_workers=100, executor=None)``.

    Made inside a running event loop. The ``OrderedConsumer`` is made on the executor at the first
    call (its constructor checks the credentials against Kafka and Redis), so a bad setting is
    raised by the first awaited method, usually ``subscribe``. Give the executor at least two
    threads when a callback calls back into the consumer (as confluent's needs).

    Args:
        consumer_conf: confluent-kafka settings, as ``OrderedConsumer`` takes them (``group.id``
            names the subscription); not changed here.
        max_workers: threads of the executor made when none is given.
        executor: where the blocking calls run (the caller's; not shut down by ``close``).
        redis_url: as ``OrderedConsumer`` takes it.
        flow_control: as ``OrderedConsumer`` takes it.
        metrics_port: as ``OrderedConsumer`` takes it.
        tracing: as ``OrderedConsumer`` takes it.
        tracer_provider: as ``OrderedConsumer`` takes it.
        **kwargs: further settings (``logger=``), as ``OrderedConsumer`` takes them.

    Raises:
        RuntimeError: no event loop runs in this thread.
        ValueError: ``max_workers`` below 1.
    """

    def __init__(self, consumer_conf: Mapping[str, Any], max_workers: int = 100, executor: Executor | None = None,
                 *, redis_url: str | None = None, flow_control: FlowControl | None = None,
                 metrics_port: int | None = None, tracing: bool | None = None,
                 tracer_provider: TracerProvider | None = None, **kwargs: Any) -> None:
        self._gate = CallGate.made(executor, max_workers, "ordering-layer-aio-consumer")
        conf = callbacks_on_loop(self._gate, {**consumer_conf, **kwargs}, _CALLBACKS)
        self._client = Lazy(self._gate, functools.partial(
            OrderedConsumer, conf, redis_url=redis_url, flow_control=flow_control, metrics_port=metrics_port,
            tracing=tracing, tracer_provider=tracer_provider))
        self._closed = False

    async def __aenter__(self) -> AIOOrderedConsumer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _run(self, call: Callable[[OrderedConsumer], T], *, serial: bool = False,
                   given: Callable[[T], Iterable[Message]] | None = None) -> T:
        if self._closed:
            raise RuntimeError("Consumer closed")  # what confluent-kafka raises
        consumer = await self._client.get()
        return await self._gate.call(functools.partial(call, consumer), serial=serial, given=given)

    def _on_loop(self, callback: RebalanceCallback | None, name: str) -> Callable[..., None] | None:
        return None if callback is None else on_loop(self._gate, callback, name, first=self)

    # -- subscribing -------------------------------------------------------------------------------
    async def subscribe(self, topics: list[str], on_assign: RebalanceCallback | None = None,
                        on_revoke: RebalanceCallback | None = None, on_lost: RebalanceCallback | None = None) -> None:
        """Join the subscription's group for its one topic (``OrderedConsumer.subscribe``); the
        callbacks get ``(this consumer, partitions)`` on the loop, on_revoke before the partitions
        are let go (the consumer's fetch waits for it)."""
        assign, revoke, lost = (self._on_loop(on_assign, "on_assign"), self._on_loop(on_revoke, "on_revoke"),
                                self._on_loop(on_lost, "on_lost"))
        await self._run(lambda consumer: consumer.subscribe(topics, assign, revoke, lost), serial=True)

    async def unsubscribe(self) -> None:
        """Leave the group (what was returned and auto-committed is acked first)."""
        await self._run(lambda consumer: consumer.unsubscribe(), serial=True)

    # -- receiving ---------------------------------------------------------------------------------
    async def poll(self, timeout: float | None = None) -> Message | None:
        """One message, or None after ``timeout`` seconds (None or negative: wait until one comes)."""
        return await self._run(lambda consumer: consumer.poll(timeout), serial=True, given=_one)

    async def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        """Up to ``num_messages`` (at most one batch per key, in order), waiting up to ``timeout``
        seconds (negative: until some come); what is ready, as ``OrderedConsumer.consume``."""
        return await self._run(lambda consumer: consumer.consume(num_messages, timeout), serial=True, given=list)

    # -- committing --------------------------------------------------------------------------------
    async def commit(self, message: Message | None = None, offsets: list[TopicPartition] | None = None,
                     asynchronous: bool = True) -> list[TopicPartition] | None:
        """Ack explicitly, as ``OrderedConsumer.commit`` (synchronous: wait for Redis, return the offsets).

        Raises:
            LeaseLostError: (synchronous) an ack was refused: the partition moved to another owner.
        """
        return await self._run(lambda consumer: consumer.commit(message, offsets, asynchronous), serial=True)

    async def store_offsets(self, message: Message | None = None, offsets: list[TopicPartition] | None = None) -> None:
        """Mark messages processed, which acks them (``OrderedConsumer.store_offsets``)."""
        await self._run(lambda consumer: consumer.store_offsets(message, offsets), serial=True)

    # -- metadata ----------------------------------------------------------------------------------
    async def assignment(self) -> list[TopicPartition]:
        """The partitions this consumer owns now."""
        return await self._run(lambda consumer: consumer.assignment())

    async def committed(self, partitions: list[TopicPartition], timeout: float = -1) -> list[TopicPartition]:
        """The group's committed offsets: each partition's lowest offset not yet settled."""
        return await self._run(lambda consumer: consumer.committed(partitions, timeout))

    async def get_watermark_offsets(self, partition: TopicPartition, timeout: float = -1,
                                    cached: bool = False) -> tuple[int, int]:
        """Low and high watermark of a partition."""
        return await self._run(lambda consumer: consumer.get_watermark_offsets(partition, timeout, cached))

    async def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        """Cluster metadata, as ``Consumer.list_topics``."""
        return await self._run(lambda consumer: consumer.list_topics(topic, timeout))

    async def cluster_id(self, timeout: float = -1) -> str | None:
        """The cluster's id (from its metadata)."""
        return (await self.list_topics(None, timeout)).cluster_id  # type: ignore[no-any-return]

    # -- what cannot be offered --------------------------------------------------------------------
    async def assign(self, partitions: list[TopicPartition]) -> None:
        """Not supported (``UnsupportedOperationError``): partitions are owned through the group."""
        await self._run(lambda consumer: consumer.assign(partitions))

    async def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        """Not supported (``UnsupportedOperationError``)."""
        await self._run(lambda consumer: consumer.incremental_assign(partitions))

    async def unassign(self) -> None:
        """Not supported (``UnsupportedOperationError``): partitions are let go through the group."""
        raise UnsupportedOperationError("unassign", _PER_KEY)

    async def incremental_unassign(self, partitions: list[TopicPartition]) -> None:
        """Not supported (``UnsupportedOperationError``)."""
        raise UnsupportedOperationError("incremental_unassign", _PER_KEY)

    async def seek(self, partition: TopicPartition) -> None:
        """Not supported: use ``Admin.seek(subscription, time=...)``, which keeps per-key order."""
        await self._run(lambda consumer: consumer.seek(partition))

    async def pause(self, partitions: list[TopicPartition]) -> None:
        """Not supported: flow control pauses the fetch itself (SUB-7)."""
        await self._run(lambda consumer: consumer.pause(partitions))

    async def resume(self, partitions: list[TopicPartition]) -> None:
        """Not supported: flow control resumes the fetch itself (SUB-7)."""
        await self._run(lambda consumer: consumer.resume(partitions))

    async def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """Not supported: the fetch position is not where delivery stands (keys wait, messages are
        redelivered); ``committed`` gives each partition's lowest unsettled offset."""
        raise UnsupportedOperationError("position", "delivery is per key, not at a partition position; "
                                                    "committed() gives the lowest unsettled offset")

    async def offsets_for_times(self, partitions: list[TopicPartition], timeout: float = -1) -> list[TopicPartition]:
        """Not supported: use ``Admin.seek(subscription, time=...)`` to move the subscription (GRP-3)."""
        raise UnsupportedOperationError("offsets_for_times", "use Admin.seek(subscription, time=...) (GRP-3)")

    async def consumer_group_metadata(self) -> Any:
        """Not supported: it serves transactions, which the ordered producer does not offer."""
        raise UnsupportedOperationError("consumer_group_metadata", "it serves transactions, which the "
                                                                   "ordered producer does not offer")

    async def set_sasl_credentials(self, username: str, password: str) -> None:
        """Not supported: the layer's Kafka clients take their credentials from the settings."""
        raise UnsupportedOperationError(
            "set_sasl_credentials", "the layer's Kafka clients take their credentials from the settings")

    # -- lifecycle ---------------------------------------------------------------------------------
    async def close(self) -> None:
        """Ack what auto-commit owes, commit what is settled, leave the group and shut down the
        executor made here. Later calls raise ``RuntimeError`` (as confluent's)."""
        if self._closed:
            return
        try:
            if self._client.value is not None:
                await self._run(lambda consumer: consumer.close(), serial=True)
        finally:
            self._closed = True
            await self._gate.shutdown()
