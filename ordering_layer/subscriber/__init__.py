"""Receiving with per-key order, per-message acks and cascade redelivery.

One coordinator (``engine``: its threads, lock and step loop, the routing of typed ``requests``)
over components that hold no references to each other. A message walks ``fetcher`` (with
``native_fetch``: the records taken from librdkafka without a Python object per message;
``fetched``: a record read once) -> ``inbox`` -> ``engine`` -> ``partitions`` / ``owned_partition``
(the partition's bookkeeping in the compiled core, ``core/src/partition.rs``, whose pure-Python
reference model is in ``tests/model``; the records and deliveries it queues are ``records``) ->
``dispatch`` (released as a ``Message`` within ``flow``, made outstanding in ``leases``, its attempt
queued in the core and flushed by ``state_writer`` through ``flushes``, one or two flushes in
flight, written and their answers read by the coordinator, ``state/pipe.py``; on a cluster a thread
of its own makes each round trip) -> ``dead_letters`` or ``handoff`` once the flush answered; its
ack comes back through ``message`` -> ``inbox`` -> ``settlement``. The coordinator's rules live in
``dispatch`` (release, hand-out), ``settlement`` (acks, nacks, deadlines, lapses, dead-letter
reports, start notes), ``starts`` (a worker's start of a delivery: written first for a suspect,
noted under a dead-letter policy), ``commits`` (commit points, commit reports, seek look-ups),
``ownership`` (claims on assignment, revocation, loss, fencing) and ``flushes`` (the Redis writes
and their verdicts); the engine hands them the components they act on.

Which module keeps which property of ``SEMANTICS.md``. "The core" is ``owned_partition`` and the
compiled ``core/src/partition.rs`` it holds (``key_queue.rs``, ``tracker.rs``); the pure-Python
model in ``tests/model`` (``partition``, ``key_queue``, ``commit_point``, ``recovery_walk``) is its
reference, with the same rules under the same names, checked against it by
``tests/model/test_core.py``:

- SUB-1 in-key order (one outstanding per key; one batch per key in pull mode): the core
  (``release_ready``; reference ``PartitionState.release``), ``dispatch`` (per-key release size)
- SUB-2 no head-of-line blocking (per-key queues, per-key backoff heap): the core (reference
  ``key_queue.KeyBackoff``); callbacks held in user code get more workers (``handoff``: the
  pool's watch)
- SUB-3 nothing lost (generations on fetched batches, claims, recovery walk, commit point):
  ``fetcher``, ``partitions``, the core (``add``: recovery walk, reference ``recovery_walk``;
  ``tracker.rs``: commit point)
- SUB-4 cascade redelivery (cursor rewind): the core (``nack``; reference ``PartitionState.nack``),
  applied by ``settlement`` (nacks, and lapses from ``leases``); across crashes, ``UNSETTLED`` ops
  and, for a recovery walk ended early (``engine``, ``partitions.end_walks``), cascade marks and the
  commit point held at them: the core (``end_walk``, ``cascades`` of the claim; reference
  ``recovery_walk``), ``state/``
- SUB-5 affinity (revoke waits for deliveries in progress): ``ownership`` (``revoking``)
- SUB-6 unordered subscriptions (one queue per record): the core (``queue_key``)
- SUB-7 flow control (budget, held/paused fetch): ``flow``, applied by ``fetcher`` and ``dispatch``
- ACK-1 ack deadline, ACK-2 lease extension, ACK-3 manual deadlines: ``leases`` (the compiled
  ``core/src/leases.rs``: deadlines, the p99 extension, lapses),
  ``message``, ``settlement`` (lease ops, lapses)
- ACK-4 state in Redis, batched; commit of the lowest unsettled offset: the core (ops queued in
  decision order), ``state_writer``, ``state/`` (``pipe``: flushes back to back on one
  connection); ``settlement`` (ops), ``flushes`` (``flush``; leases of deliveries held past
  ``LEASE_WRITE_AGE``, ``leases.write_leases``; each partition's commit point as its floor in
  Redis, the core's ``take_ops(floor=True)``, so the settled set keeps only what is above it),
  ``commits`` (commit interval, commit reports), ``partitions`` (``commit_offsets``; a claim's
  floor skips what an earlier owner settled below it), ``fetcher`` (commits)
- ACK-5 fencing, ``ack_with_response``: ``partitions`` (epochs), ``flushes`` and ``ownership`` (fencing verdicts),
  ``settlement`` and ``leases`` (stale epochs and lease handles refused), ``state_writer`` (answers),
  ``state/lua/apply.lua``
  (the ops' Redis writes, grouped into command runs by ``core/src/runs.rs``)
- ACK-6 delivery attempt survives crashes (counted before hand-off): the core (release ops; a
  record's first attempt goes to a run of consecutive offsets, ``core/src/runs.rs``),
  ``flushes`` (releases held until their flush answered, then ``dispatch.hand_out``),
  ``starts`` (``begin``: a suspect's start written first; the start notes of callbacks and of pulls
  answered from releases ahead, ``handoff``), ``settlement`` (the notes written), ``partitions``
  (claim, ``charged_attempts``; in pull mode nothing released ahead from a partition with charged
  attempts pending); suspects of repeated crashes go out one at a time: the core (``Quarantine``;
  reference ``key_queue.Quarantine``)
- DLQ-1 backoff per key: the core (``hold``, ``wake``; reference ``key_queue.KeyBackoff``)
- DLQ-2 dead-lettering, ``park_key``; DLQ-3 poison messages: ``dead_letters``, screened by
  ``dispatch`` (``hand_out``), settled by ``settlement`` (``dead_lettered``); a poison crashes alone:
  the core (``Quarantine`` of suspects)
- DLQ-4 bad input (malformed ``ol-`` metadata ignored and counted): ``fetched`` (``read_headers``,
  ``to_record``), ``native_fetch`` (``header_metadata``), counted by ``fetcher``
- GRP-2 sharing (cooperative-sticky group, rebalance hooks): ``fetcher``, ``ownership``
- GRP-3 seek: ``commits`` (seek generation looked up once a commit interval, commit reports told
  apart by their seek tag), ``ownership`` (``apply_seeks``: restarted partitions' deliveries void),
  ``partitions`` (claims that apply a seek, ``AWAITING_SEEK``, ``confirm``), ``fetcher`` (consumer
  seeks, ``Sought``), the core (``start_offset``: the target is the commit point until records arrive)
- GRP-4 commit_on_get, GRP-5 manual ack of a batch: ``subscriber`` (``Subscriber.pull``,
  ``acknowledge``); a pull answered at once from messages released ahead of it, whole per-key
  batches (``handoff.PullWaiters``), except from partitions whose claim charged attempts not yet
  settled (``partitions.release``: DLQ-3)
- DRP-2 drop-in consumer: ``consumer`` (``OrderedConsumer``)
"""

from ordering_layer.subscriber.consumer import OrderedConsumer
from ordering_layer.subscriber.executors import AsyncWorkers
from ordering_layer.subscriber.message import AckResponse, Message
from ordering_layer.subscriber.subscriber import StreamingPullFuture, Subscriber

__all__ = ["AckResponse", "AsyncWorkers", "Message", "OrderedConsumer", "StreamingPullFuture", "Subscriber"]
