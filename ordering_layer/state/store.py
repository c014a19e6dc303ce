"""The Redis state store: one hash tag per (subscription, partition), Lua scripts for every write.

Keys: ``ol:{<subscription>:<partition>}:epoch|settled|attempts|leases`` (one slot per partition, so
Redis Cluster works) and ``ol:sub:<subscription>`` for the settings. Redis is an accelerator of
correctness: losing it loses no message (Kafka holds them), it only causes redelivery.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Final, Literal

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ordering_layer.config import SubscriptionSettings
from ordering_layer.errors import SubscriptionNotFoundError

_LOGGER = logging.getLogger(__name__)

OpLetter = Literal["d", "l", "b", "e", "a", "n", "w"]


class OpKind:
    """What one state change does, named; the value is its letter in ``apply.lua``'s packed argument
    (plain strings, not an Enum: formatting an Enum member costs half as much again per op, and
    the packing is the hot path of every flush).

    Each op is (kind, offset, value):

    * ``DELIVERED``: attempts[offset] = value (the attempt number); its lease comes with a ``LEASE``;
    * ``LEASE``: leases[offset] = value (the deadline, epoch ms);
    * ``BATCH_LEASE``: the lease deadline (value, ms) of the ``BATCH_DELIVERED`` ops after it (offset 0);
    * ``BATCH_DELIVERED``: attempts[offset] = value and leases[offset] = the batch lease;
    * ``SETTLED``: acked or dead-lettered: added to the settled set, attempts and lease dropped;
    * ``NACKED``: the lease is dropped (the message stays unsettled);
    * ``WATERMARK``: value is the committed offset: everything settled below it is forgotten (offset 0).
    """

    DELIVERED: Final = "d"
    LEASE: Final = "l"
    BATCH_LEASE: Final = "b"
    BATCH_DELIVERED: Final = "e"
    SETTLED: Final = "a"
    NACKED: Final = "n"
    WATERMARK: Final = "w"


Op = tuple[OpLetter, int, int]


class ApplyResult(enum.IntEnum):
    """Outcome of a fenced batch write."""

    FENCED = 0
    APPLIED = 1
    ADOPTED = 2


@dataclass(frozen=True)
class ClaimedPartition:
    """What a new owner learns when it claims a partition."""

    epoch: int
    settled: frozenset[int]
    attempts: dict[int, int]


def _script(name: str) -> str:
    return (resources.files("ordering_layer.state") / "lua" / f"{name}.lua").read_text()


def partition_keys(subscription: str, partition: int) -> list[str]:
    """epoch, settled, attempts and leases keys of one partition (one hash slot)."""
    tag = f"ol:{{{subscription}:{partition}}}"
    return [f"{tag}:epoch", f"{tag}:settled", f"{tag}:attempts", f"{tag}:leases"]


def settings_key(subscription: str) -> str:
    """The key holding a subscription's settings."""
    return f"ol:sub:{subscription}"


class StateStore:
    """Typed access to the layer's Redis state.

    Args:
        redis_url: e.g. ``redis://127.0.0.1:6379/0``.
    """

    def __init__(self, redis_url: str) -> None:
        self.client = redis.Redis.from_url(
            redis_url, socket_timeout=5.0, socket_connect_timeout=5.0,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=5),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        self._apply_source = _script("apply")
        self._apply_sha = hashlib.sha1(self._apply_source.encode()).hexdigest()
        self._claim = self.client.register_script(_script("claim"))

    # -- subscription settings -------------------------------------------------------------------
    def create_settings(self, subscription: str, settings: SubscriptionSettings) -> bool:
        """Store settings unless the subscription exists; True when created."""
        return bool(self.client.set(settings_key(subscription), settings.to_json(), nx=True))

    def settings(self, subscription: str) -> SubscriptionSettings:
        """The stored settings. Raises ``SubscriptionNotFoundError``."""
        raw = self.client.get(settings_key(subscription))
        if raw is None:
            raise SubscriptionNotFoundError(subscription)
        return SubscriptionSettings.from_json(raw)

    def delete_subscription(self, subscription: str) -> int:
        """Remove the settings and every partition key of the subscription; return keys removed."""
        keys: list[str | bytes] = [settings_key(subscription), f"{settings_key(subscription)}:parked"]
        keys.extend(self.client.scan_iter(match=f"ol:{{{subscription}:*", count=1000))
        return int(self.client.delete(*keys))

    # -- partitions ------------------------------------------------------------------------------
    def claim(self, subscription: str, partition: int) -> ClaimedPartition:
        """Become the owner of a partition: bump its epoch, read settled offsets and attempts."""
        keys = partition_keys(subscription, partition)[:3]
        raw = self._claim(keys=keys, args=[])
        split = raw.index(b"|")
        pairs = raw[split + 1:]
        return ClaimedPartition(
            epoch=int(raw[0]),
            settled=frozenset(int(o) for o in raw[1:split]),
            attempts={int(pairs[i]): int(pairs[i + 1]) for i in range(0, len(pairs), 2)},
        )

    def apply_many(self, batches: Sequence[tuple[str, int, int, Sequence[Op]]]) -> list[ApplyResult]:
        """Apply op batches of several partitions in one pipeline (one round trip).

        Each batch is (subscription, partition, epoch, ops); ``OpKind`` names what each op does. The
        ops travel packed into one argument, ``"<letter>,<offset>,<value>;"`` each (see ``lua/apply.lua``).
        """
        # EVALSHA straight on the pipeline: redis-py's Script objects would add a SCRIPT EXISTS
        # round trip to every pipeline; the script is loaded again only after a NOSCRIPT answer
        # (a restarted or flushed Redis).
        for _ in range(2):
            pipe = self.client.pipeline(transaction=False)
            for subscription, partition, epoch, ops in batches:
                packed = "".join([f"{kind},{offset},{value};" for kind, offset, value in ops])
                pipe.evalsha(self._apply_sha, 4, *partition_keys(subscription, partition), epoch, packed)
            try:
                return [ApplyResult(int(r)) for r in pipe.execute()]
            except redis.exceptions.NoScriptError:
                self.client.script_load(self._apply_source)  # type: ignore[no-untyped-call]
        raise redis.exceptions.NoScriptError("apply.lua could not be loaded")

    def parked_keys(self, subscription: str) -> set[bytes]:
        """Ordering keys (record key bytes) parked by a ``park_key`` dead-letter policy (DLQ-2)."""
        return set(self.client.smembers(f"{settings_key(subscription)}:parked"))

    def park_key(self, subscription: str, ordering_key: bytes) -> None:
        """Park a key: its later messages follow its dead letter until ``release_key``."""
        self.client.sadd(f"{settings_key(subscription)}:parked", ordering_key)

    def release_key(self, subscription: str, ordering_key: str | bytes) -> bool:
        """Release a parked key (text is taken as UTF-8); True when it was parked."""
        return bool(self.client.srem(f"{settings_key(subscription)}:parked", ordering_key))

    def outstanding(self, subscription: str, partition: int) -> int:
        """Leases currently held in the partition (delivered, not yet settled)."""
        return int(self.client.hlen(partition_keys(subscription, partition)[3]))
