"""Typed requests that travel through the engine's inbox to its coordinator thread.

Every request is immutable; the coordinator routes them by type. User threads post ``Settle``
(through ``Message``; a plain ``ack()`` posts the ``Message`` itself, the one request that costs no
object per ack) and ``Pull``; the fetch thread posts ``Fetched``, ``Committed`` and ``Sought``; the
dead-letter producer's delivery reports post ``DeadLettered``; the move guard posts ``MovesCleared`` and
``CountsChanged``. ``SeekPartition`` goes the other way,
from the coordinator to the fetch thread, queued with the commits.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Final, NamedTuple

from ordering_layer.subscriber.records import Delivery, QueueKey, Record

if TYPE_CHECKING:
    from ordering_layer.subscriber.message import AckResponse, Message


class SettleKind:
    """What a ``Settle`` asks (plain ints: compared per message on the hot path)."""

    ACK: Final = 0
    NACK: Final = 1
    DEADLINE: Final = 2


class Settle(NamedTuple):
    """A request from user code about one delivery: ack, nack or a new deadline (ACK-3)."""

    kind: int  # SettleKind
    delivery: Delivery
    epoch: int  # the owner epoch the delivery was made under (ACK-5)
    seconds: float
    error: str | None
    future: Future[AckResponse] | None


class Fetched(NamedTuple):
    """Records as ``consume`` returned them, with each partition's assignment generation then:
    records of an earlier generation were fetched for an ownership that has ended since; and the
    highest ``ol-partition-count`` the fetch has seen (a growth of the topic, SUB-8)."""

    records: list[Record]
    generations: dict[int, int]
    highest_count: int = 0


class MovesCleared(NamedTuple):
    """Keys held for a move in ``partition`` (owned under ``epoch``) whose records in their old
    partitions are settled (SUB-8)."""

    partition: int
    epoch: int
    keys: list[bytes]


class CountsChanged(NamedTuple):
    """The topic's partition-count history grew (SUB-8): ascending (count, from ms)."""

    history: list[tuple[int, int]]


class Pull(NamedTuple):
    """A pull waiting for messages until ``deadline`` (monotonic seconds)."""

    max_messages: int
    deadline: float
    future: Future[list[Message]]


class Committed(NamedTuple):
    """Offsets the group coordinator has taken, as (partition, offset, seek generation of the commit's
    tag or None): Redis may forget what is settled below them, unless a seek came after the commit;
    and partitions whose commit it refused (their commit point is sent again at the next interval)."""

    offsets: list[tuple[int, int, int | None]]
    failed: tuple[int, ...] = ()


class SeekPartition(NamedTuple):
    """Move the consumer's position in ``partition`` to ``offset``, for seek ``seek_generation`` (GRP-3)."""

    partition: int
    offset: int
    seek_generation: int


class Sought(NamedTuple):
    """The consumer was sought for seek ``seek_generation``: records of ``partition`` fetched under
    assignment generation ``generation`` come from the seek's target on."""

    partition: int
    generation: int
    seek_generation: int


class GiveBack(NamedTuple):
    """Messages a callback worker did not start (the rest of a key's run, ``CallbackPool``): back to
    their keys, their attempts taken back."""

    messages: list[Message]


class DeadLettered(NamedTuple):
    """The dead-letter topic took (``error`` None) or refused a record delivered under ``epoch``."""

    partition: int
    epoch: int
    queue_key: QueueKey
    offset: int
    error: str | None
