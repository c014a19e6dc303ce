"""One exception tree for the whole layer.

Driver errors (confluent-kafka, redis-py) are translated into these with ``raise ... from`` so
callers catch one family; each error carries the context it is about (key, topic, partition,
offset) as attributes.
"""

from __future__ import annotations


class OrderingLayerError(Exception):
    """Base of every error raised by ordering_layer."""


class ConfigError(OrderingLayerError, ValueError):
    """A setting is unknown, missing, out of range or contradicts the contract.

    Attributes:
        unknown: the names of settings that do not exist.
        setting: the name of the one setting refused (its value cannot be read or honoured), if any.
    """

    def __init__(self, message: str, *, unknown: tuple[str, ...] = (), setting: str | None = None) -> None:
        super().__init__(message)
        self.unknown = unknown
        self.setting = setting


class InvalidOrderingKeyError(OrderingLayerError, ValueError):
    """An ordering key is longer than 1024 bytes or is not valid UTF-8 (PUB-4)."""

    def __init__(self, message: str, *, key: object) -> None:
        super().__init__(message)
        self.key = key


class MessageTooLargeError(OrderingLayerError, ValueError):  # see also InvalidMessageError
    """An encoded message would exceed the producer's maximum message size (PUB-4)."""

    def __init__(self, message: str, *, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class PublishError(OrderingLayerError):
    """A publish finally failed (after the Kafka client's own retries)."""

    def __init__(self, message: str, *, topic: str, ordering_key: str | None) -> None:
        super().__init__(message)
        self.topic = topic
        self.ordering_key = ordering_key


class OrderingKeyPausedError(PublishError):
    """Publishing for this ordering key is paused after a failure until ``resume_publish`` (PUB-2)."""


class RecordFormatError(OrderingLayerError, ValueError):
    """A record of the layer's own (dead letter, schedule, snapshot) cannot be decoded."""


class TopicError(OrderingLayerError):
    """A topic cannot be created or described."""

    def __init__(self, message: str, *, topic: str) -> None:
        super().__init__(message)
        self.topic = topic


class SubscriptionNotFoundError(OrderingLayerError, LookupError):
    """The named subscription was never created (or was deleted)."""

    def __init__(self, subscription: str) -> None:
        super().__init__(f"subscription {subscription!r} does not exist")
        self.subscription = subscription


class SubscriptionExistsError(OrderingLayerError):
    """A subscription of that name exists already with other settings."""

    def __init__(self, subscription: str) -> None:
        super().__init__(f"subscription {subscription!r} exists already")
        self.subscription = subscription


class LeaseLostError(OrderingLayerError):
    """An ack, nack or deadline change was refused: the lease is gone (fenced owner or expiry)."""

    def __init__(self, message: str, *, partition: int, offset: int) -> None:
        super().__init__(message)
        self.partition = partition
        self.offset = offset


class StackError(OrderingLayerError, RuntimeError):
    """The local Kafka + Redis stack cannot start, stop or be found."""


class InvalidMessageError(OrderingLayerError, ValueError):
    """A message's data or attributes have the wrong type (PUB-4)."""


class TopicExistsError(TopicError):
    """``create_topic`` named a topic that exists already."""


class UnsupportedOperationError(OrderingLayerError, NotImplementedError):
    """A confluent-kafka method the ordered wrappers cannot offer (for example transactions, or a
    ``seek`` of one partition, which would break per-key order and per-message acks)."""

    def __init__(self, operation: str, reason: str) -> None:
        super().__init__(f"{operation} is not supported by ordering_layer: {reason}")
        self.operation = operation


class AuthenticationError(OrderingLayerError):
    """A server refused the layer's credentials or TLS handshake (wrong user, password or CA).

    ``server`` names which one: ``"kafka"`` or ``"redis"``. The message never carries the secret.
    """

    def __init__(self, message: str, *, server: str) -> None:
        super().__init__(message)
        self.server = server


class SnapshotNotFoundError(OrderingLayerError, LookupError):
    """The named snapshot was never created, was deleted, or has expired (GRP-3)."""

    def __init__(self, snapshot: str) -> None:
        super().__init__(f"snapshot {snapshot!r} does not exist (or has expired)")
        self.snapshot = snapshot


class SnapshotExistsError(OrderingLayerError):
    """``create_snapshot`` named a snapshot that exists already and has not expired (GRP-3)."""

    def __init__(self, snapshot: str) -> None:
        super().__init__(f"snapshot {snapshot!r} exists already")
        self.snapshot = snapshot


class SeekTimeoutError(OrderingLayerError, TimeoutError):
    """A seek was not applied by every partition in time (GRP-3). It stays pending: the partitions
    named apply it when their owner next checks or when they are next claimed."""

    def __init__(self, subscription: str, generation: int, partitions: tuple[int, ...], timeout: float) -> None:
        super().__init__(f"seek {generation} of {subscription!r} not applied by partitions "
                         f"{', '.join(map(str, partitions))} within {timeout:g} s (it stays pending)")
        self.subscription = subscription
        self.generation = generation
        self.partitions = partitions
