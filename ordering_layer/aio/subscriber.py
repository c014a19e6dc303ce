"""``AIOSubscriber``: pull mode awaitable from asyncio servers (``await subscriber.pull(...)``).

The pull of ``Subscriber`` runs on the executor, so many pulls (of one subscription or several) wait
at once without blocking the event loop; the messages are the same ``Message`` objects, and
``ack()``, ``nack()``, ``modify_ack_deadline()`` are called from the coroutine as they are (they
do not block: the subscriber's own threads write them). ``ack_with_response()`` returns a
``concurrent.futures.Future``: ``await asyncio.wrap_future(message.ack_with_response())``.

A pull whose coroutine is cancelled gives back what it receives: those messages are nacked and
delivered again (SUB-3), instead of staying leased, unseen, until their lease runs out. Pulls with
``commit_on_get`` of one subscription run one after another (each acks what the one before it
returned, GRP-4); other pulls run side by side.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from ordering_layer.aio.calls import CallGate, Lazy
from ordering_layer.config import FlowControl
from ordering_layer.subscriber import Message, Subscriber

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider


class AIOSubscriber:
    """``Subscriber``'s pull mode for asyncio: ``await AIOSubscriber(kafka).pull("orders-billing")``.

    Made inside a running event loop. The ``Subscriber`` is made on the executor at the first pull
    (its constructor checks the credentials against Kafka and Redis).

    Args:
        kafka_config: as ``Subscriber`` takes it.
        redis_url: as ``Subscriber`` takes it.
        metrics_port: as ``Subscriber`` takes it.
        tracing: as ``Subscriber`` takes it.
        tracer_provider: as ``Subscriber`` takes it.
        max_workers: threads of the executor made when none is given: how many pulls can wait at once.
        executor: where the blocking calls run (the caller's; not shut down by ``close``).

    Raises:
        RuntimeError: no event loop runs in this thread.
        ValueError: ``max_workers`` below 1.
    """

    def __init__(self, kafka_config: Mapping[str, Any], *, redis_url: str | None = None,
                 metrics_port: int | None = None, tracing: bool | None = None,
                 tracer_provider: TracerProvider | None = None, max_workers: int = 32,
                 executor: Executor | None = None) -> None:
        self._gate = CallGate.made(executor, max_workers, "ordering-layer-aio-subscriber")
        self._client = Lazy(self._gate, functools.partial(
            Subscriber, dict(kafka_config), redis_url=redis_url, metrics_port=metrics_port, tracing=tracing,
            tracer_provider=tracer_provider))
        self._committing: dict[str, CallGate] = {}  # per subscription: its commit_on_get pulls in turn
        self._closed = False

    async def __aenter__(self) -> AIOSubscriber:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def pull(self, subscription: str, max_messages: int = 100, timeout: float = 1.0, *,
                   commit_on_get: bool = False, flow_control: FlowControl | None = None) -> list[Message]:
        """Pull up to ``max_messages``, waiting up to ``timeout`` seconds: at most one batch per key is
        outstanding, in order (SUB-1), as ``Subscriber.pull``.

        The first pull of a subscription joins its group; the membership lasts until ``close()``.
        With ``commit_on_get`` each pull first acks everything the previous pull returned (GRP-4).

        Raises:
            RuntimeError: the subscriber is closed.
            ConfigError: ``max_messages`` below 1.
            SubscriptionNotFoundError: the subscription was never created.
        """
        if self._closed:
            raise RuntimeError("subscriber is closed")
        subscriber = await self._client.get()
        gate = self._gate
        if commit_on_get:
            gate = self._committing.setdefault(subscription, CallGate(gate.loop, gate.executor, owns_executor=False))
        return await gate.call(functools.partial(subscriber.pull, subscription, max_messages, timeout,
                                                 commit_on_get=commit_on_get, flow_control=flow_control),
                               serial=commit_on_get, given=list)

    @staticmethod
    def acknowledge(messages: Iterable[Message]) -> None:
        """Ack a batch of pulled messages without fetching more (GRP-5); does not block."""
        Subscriber.acknowledge(messages)

    async def close(self, timeout: float = 30.0) -> None:
        """Leave the groups joined by ``pull`` (outstanding pulled messages get ``timeout`` seconds to
        be acked) and shut down the executor made here."""
        if self._closed:
            return
        self._closed = True
        try:
            subscriber = self._client.value
            if subscriber is not None:
                await self._gate.call(functools.partial(subscriber.close, timeout))
        finally:
            await self._gate.shutdown()
