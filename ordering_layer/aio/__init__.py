"""asyncio front ends over the sync clients, shaped like ``confluent_kafka.aio`` (DRP-1, DRP-2).

- ``AIOOrderedProducer``: ``confluent_kafka.aio.AIOProducer``'s methods over ``OrderedProducer``
  (``producer``).
- ``AIOOrderedConsumer``: ``confluent_kafka.aio.AIOConsumer``'s methods over ``OrderedConsumer``
  (``consumer``).
- ``AIOSubscriber``: ``Subscriber``'s pull mode, awaitable (``subscriber``).

A program written for ``confluent_kafka.aio`` runs with the import swapped::

    from ordering_layer.aio import AIOOrderedConsumer as AIOConsumer, AIOOrderedProducer as AIOProducer

Each runs the sync client's blocking calls on a thread pool and its callbacks on the event loop
(``calls``), so the loop never waits for Kafka or Redis. The package does not import
``confluent_kafka.aio``: it works with every confluent-kafka release the layer supports.
"""

from ordering_layer.aio.consumer import AIOOrderedConsumer
from ordering_layer.aio.producer import AIOOrderedProducer
from ordering_layer.aio.subscriber import AIOSubscriber

__all__ = ["AIOOrderedConsumer", "AIOOrderedProducer", "AIOSubscriber"]
