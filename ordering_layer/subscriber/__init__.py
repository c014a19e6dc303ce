"""Receiving with per-key order, per-message acks and cascade redelivery.

One coordinator (``engine``) over components that hold no references to each other; a message walks
``fetcher`` -> ``inbox`` -> ``engine`` -> ``partitions`` / ``partition`` -> ``flow`` -> ``leases`` ->
``state_writer`` -> ``dead_letters`` or ``handoff``; requests between them are typed (``requests``).

Which module keeps which property of ``SEMANTICS.md``:

- SUB-1 in-key order (one outstanding per key; one batch per key in pull mode): ``partition``
  (``KeyQueue``, ``PartitionState.release``)
- SUB-2 no head-of-line blocking (per-key queues, per-key backoff heap): ``partition``
- SUB-3 nothing lost (generations on fetched batches, claims, recovery walk, commit point):
  ``fetcher``, ``partitions``, ``partition`` (``OffsetTracker``)
- SUB-4 cascade redelivery (cursor rewind): ``partition`` (``PartitionState.nack``); lapses from
  ``leases``
- SUB-5 affinity (revoke waits for deliveries in progress): ``engine`` (``revoking``)
- SUB-6 unordered subscriptions (one queue per record): ``partition`` (``queue_key``)
- SUB-7 flow control (budget, held/paused fetch): ``flow``, applied by ``fetcher`` and ``engine``
- ACK-1 ack deadline, ACK-2 lease extension, ACK-3 manual deadlines: ``leases`` (+ ``histogram``),
  ``message``
- ACK-4 state in Redis, batched; commit of the lowest unsettled offset: ``state_writer``,
  ``state/``; ``engine`` (``_offsets``), ``fetcher`` (commits)
- ACK-5 fencing, ``ack_with_response``: ``partitions`` (epochs), ``state_writer`` (answers),
  ``state/lua/apply.lua``
- ACK-6 delivery attempt survives crashes (counted before hand-off): ``engine`` (``_admit`` ops
  flushed before ``_dispatch``), ``partitions`` (claim)
- DLQ-1 backoff per key: ``partition`` (``_hold``, wake heap)
- DLQ-2 dead-lettering, ``park_key``; DLQ-3 poison messages: ``dead_letters``
- DLQ-4 bad input (malformed ``ol-`` metadata ignored and counted): ``fetcher`` (``to_record``)
- GRP-2 sharing (cooperative-sticky group, rebalance hooks): ``fetcher``
- GRP-4 commit_on_get, GRP-5 manual ack of a batch: ``subscriber`` (``Subscriber.pull``,
  ``acknowledge``)
- DRP-2 drop-in consumer: ``consumer`` (``OrderedConsumer``)
"""

from ordering_layer.subscriber.consumer import OrderedConsumer
from ordering_layer.subscriber.message import AckResponse, Message
from ordering_layer.subscriber.subscriber import StreamingPullFuture, Subscriber

__all__ = ["AckResponse", "Message", "OrderedConsumer", "StreamingPullFuture", "Subscriber"]
