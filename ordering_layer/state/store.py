"""The Redis state store: one hash tag per (subscription, partition), Lua scripts for every write.

Keys: ``ol:{<subscription>:<partition>}:epoch|settled|attempts|leases|seek|cascades|firsts`` (one slot per
partition, so every script touches one slot of a Redis Cluster; the attempts and leases hashes, offset ->
value, keep one more field, ``KEEP_FIELD``, so that Redis does not delete and recreate them as they empty;
first attempts are written as runs of consecutive offsets, ``firsts_key``),
``ol:sub:<subscription>`` for the settings, ``ol:sub:<subscription>:parked`` for parked keys, ``:seek``
for the latest seek generation announced to the subscribers and ``:seek-counter`` for the next one
(each read and written alone, by one-key commands).
Redis is an accelerator of correctness: losing it loses no message (Kafka holds them), it only causes
redelivery; nor does it lose a subscription, whose settings have a durable copy in Kafka
(``state.durable``) that ``settings`` reads back when Redis has none. The client comes from
``state.client.redis_client``, so a Redis Cluster URL works as well.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Concatenate, Final, Literal, ParamSpec, TypeVar, cast

import redis
from redis.cluster import RedisCluster

from ordering_layer._core import OP_LETTERS, command_runs
from ordering_layer.config import SubscriptionSettings
from ordering_layer.errors import OrderingLayerError, SubscriptionNotFoundError
from ordering_layer.state.client import mask_url, redis_client, retry_policy, verify_redis
from ordering_layer.state.durable import SettingsLog

_LOGGER = logging.getLogger(__name__)

OpLetter = Literal["d", "l", "b", "e", "r", "q", "D", "E", "R", "Q", "s", "a", "n", "u", "c", "x", "f"]


def _letter(name: str) -> OpLetter:
    """The letter of op ``name``, as the core defines it (``core/src/ops.rs``)."""
    return cast(OpLetter, OP_LETTERS[name])


class OpKind:
    """What one state change does, named; the value is its letter in ``apply.lua``'s packed argument
    (plain strings, not an Enum: formatting an Enum member costs half as much again per op, and
    the packing is the hot path of every flush).

    Each op is (kind, offset, value):

    * ``DELIVERED``: attempts[offset] = value (the attempt number): handed to user code (pull mode);
      its lease comes with a ``LEASE``;
    * ``LEASE``: leases[offset] = value (the deadline, epoch ms);
    * ``BATCH_LEASE``: the lease deadline (value, ms) of the batch ops after it (offset 0);
    * ``BATCH_DELIVERED``: attempts[offset] = value and leases[offset] = the batch lease;
    * ``RELEASED``: attempts[offset] = -value: attempt ``value`` went to the callback pool, user code
      has not been seen to start it; its lease comes with a ``LEASE``;
    * ``BATCH_RELEASED``: attempts[offset] = -value and leases[offset] = the batch lease;
    * ``FIRST_DELIVERED``, ``FIRST_RELEASED``, ``BATCH_FIRST_DELIVERED``, ``BATCH_FIRST_RELEASED``: the
      same for a record's first attempt (value 1), which is written to no attempts field: the batch's
      first attempts go to the partition's first-attempt runs (``firsts_key``), one member per value
      (1 or -1) listing the batch's stretches of consecutive offsets;
    * ``STARTED``: attempts[offset] = value: user code started attempt ``value`` (callback mode);
    * ``SETTLED``: acked or dead-lettered: added to the settled set (unless below a ``FLOOR`` of the same
      batch, which covers it), attempts and lease dropped. The value's bits: 1, the lease is left
      alone (the engine never wrote one for the delivery); 2, so is the attempts field (there is none:
      the record's only attempt is in a first-attempt run, which the floor drops once past it);
    * ``NACKED``: the lease is dropped (the message stays unsettled); a value above 0 is the attempt
      user code nacked, so attempts[offset] = value (it started); 0 for a lapsed lease;
    * ``UNSETTLED``: a settled record goes out again in a cascade (SUB-4): dropped from the settled set,
      so that a successor cascades from it if this owner crashes first (value 0); the successor
      charges it the attempt of the first-attempt run that covers it, if one does (its settle dropped
      only an attempts field);
    * ``CASCADE_FROM``: the key of the record at offset cascades from it, found by a recovery walk
      that released before its end (SUB-4): added to the partition's cascades set (value 0);
    * ``CASCADE_DONE``: a walk has ended: the mark at offset is dropped from the cascades set (value 0);
    * ``FLOOR``: value is the owner's commit point: everything below it is settled. It is kept as the
      settled set's member ``_`` (raised, never lowered) and the offsets below it are dropped from
      the set, which so holds only the offsets settled above the floor, and the first-attempt members
      wholly below it are dropped (offset 0). A claim reads it
      (``ClaimedPartition.floor``) and the new owner skips the records below it.
    """

    DELIVERED: Final = _letter("DELIVERED")
    LEASE: Final = _letter("LEASE")
    BATCH_LEASE: Final = _letter("BATCH_LEASE")
    BATCH_DELIVERED: Final = _letter("BATCH_DELIVERED")
    RELEASED: Final = _letter("RELEASED")
    BATCH_RELEASED: Final = _letter("BATCH_RELEASED")
    FIRST_DELIVERED: Final = _letter("FIRST_DELIVERED")
    BATCH_FIRST_DELIVERED: Final = _letter("BATCH_FIRST_DELIVERED")
    FIRST_RELEASED: Final = _letter("FIRST_RELEASED")
    BATCH_FIRST_RELEASED: Final = _letter("BATCH_FIRST_RELEASED")
    STARTED: Final = _letter("STARTED")
    SETTLED: Final = _letter("SETTLED")
    NACKED: Final = _letter("NACKED")
    UNSETTLED: Final = _letter("UNSETTLED")
    CASCADE_FROM: Final = _letter("CASCADE_FROM")
    CASCADE_DONE: Final = _letter("CASCADE_DONE")
    FLOOR: Final = _letter("FLOOR")


Op = tuple[OpLetter, int, int]


class ApplyResult(enum.IntEnum):
    """Outcome of a fenced batch write."""

    FENCED = 0
    APPLIED = 1
    ADOPTED = 2


@dataclass(frozen=True)
class ClaimedPartition:
    """What a new owner learns when it claims a partition.

    ``attempts`` maps each unsettled offset handed out before to the number of its last attempt;
    ``unstarted`` holds the offsets whose last attempt went to a callback pool without user code
    being seen to start it (it may have started: the mark travels in a later flush).
    ``seek_generation`` is the partition's latest seek (0: never sought); ``seek_offset`` is that
    seek's target when the claim applied it (the owner starts there instead of the committed offset
    and, once it has committed it, marks it applied), None when no seek was pending. ``floor`` is
    the last owner's commit point as written to Redis (everything below it is settled; it may be
    above the committed offset, which lags it by up to a commit interval), None when none is kept.
    """

    epoch: int
    settled: frozenset[int]
    attempts: dict[int, int]
    unstarted: frozenset[int] = frozenset()
    seek_generation: int = 0
    seek_offset: int | None = None
    cascades: frozenset[int] = frozenset()
    floor: int | None = None


@dataclass(frozen=True)
class SeekStatus:
    """A partition's latest seek generation and the last one applied (0: none)."""

    generation: int
    applied: int

    @property
    def pending(self) -> bool:
        """A seek is recorded that no owner has applied yet."""
        return self.generation > self.applied


def _command_runs(packed: str) -> list[str | bytes]:
    """``apply.lua``'s arguments after the epoch for packed ops: the runs' header, each run's arguments."""
    header, arguments = command_runs(packed)
    return [header, *arguments]


def unpack_ops(packed: str) -> list[Op]:
    """Ops packed for ``apply.lua`` (``"<letter>,<offset>,<value>;"`` each) as (kind, offset, value)."""
    ops: list[Op] = []
    for item in packed.split(";")[:-1]:
        kind, offset, value = item.split(",")
        ops.append((cast(OpLetter, kind), int(offset), int(value)))
    return ops


def parse_claim(raw: Sequence[Any]) -> ClaimedPartition:
    """``claim.lua``'s answer: ``[epoch, settled offsets..., "|", offset, attempt, ..., "|", seek
    generation, seek target, "|", cascade marks..., "|", floor, "|", first-attempt runs...]``, an
    attempt negated while it waited in a callback pool, the target -1 when the claim applied no seek,
    the floor -1 when none is kept (the parts after the attempts may be left out: no seek, no marks,
    no floor, no runs; each run ``"<first>,<last>,...,<value>"``). An unsettled offset with no field
    of its own takes the attempt of the run that covers it (``firsts_key``; of two, which only a
    loss of Redis between two owners makes, the one user code had)."""
    split = raw.index(b"|")
    sections: list[list[Any]] = [[]]
    for item in raw[split + 1:]:
        if item == b"|":
            sections.append([])
        else:
            sections[-1].append(item)
    attempts, seek, marks, floor, firsts = (*sections, [], [], [], [])[:5]
    seek_generation, target = (int(seek[0]), int(seek[1])) if seek else (0, -1)
    stored = {int(attempts[i]): int(attempts[i + 1]) for i in range(0, len(attempts), 2)}
    kept_floor = int(floor[0]) if floor else -1
    settled = frozenset(int(o) for o in raw[1:split])
    from_runs: dict[int, int] = {}
    for run in firsts:
        *bounds, value = (int(part) for part in run.split(b","))
        for first, last in zip(bounds[::2], bounds[1::2], strict=True):
            for offset in range(max(first, kept_floor), last + 1):
                if offset not in stored and offset not in settled:
                    from_runs[offset] = max(value, from_runs.get(offset, value))
    stored.update(from_runs)
    return ClaimedPartition(
        epoch=int(raw[0]),
        settled=settled,
        attempts={offset: abs(n) for offset, n in stored.items()},
        unstarted=frozenset(offset for offset, n in stored.items() if n < 0),
        seek_generation=seek_generation,
        seek_offset=target if target >= 0 else None,
        cascades=frozenset(int(o) for o in marks),
        floor=kept_floor if kept_floor >= 0 else None,
    )


def _script(name: str) -> str:
    return (resources.files("ordering_layer.state") / "lua" / f"{name}.lua").read_text()


KEEP_FIELD = "_"  # the field of the attempts and leases hashes that is not an offset (apply.lua)


FLOOR_MEMBER = KEEP_FIELD  # the settled set's member whose score is the floor (``OpKind.FLOOR``)


def offset_fields(fields: Iterable[bytes | str]) -> list[int]:
    """The offsets among the fields of an attempts or leases hash (``KEEP_FIELD`` left out), or among
    the members of a settled set (its floor, ``FLOOR_MEMBER``, left out)."""
    return [int(f) for f in fields if f not in (KEEP_FIELD, KEEP_FIELD.encode())]


def partition_keys(subscription: str, partition: int) -> list[str]:
    """epoch, settled, attempts and leases keys of one partition (one hash slot)."""
    tag = f"ol:{{{subscription}:{partition}}}"
    return [f"{tag}:epoch", f"{tag}:settled", f"{tag}:attempts", f"{tag}:leases"]


def cascades_key(subscription: str, partition: int) -> str:
    """The key of a partition's cascade marks (same slot as ``partition_keys``): the offsets from which
    keys cascade, written by an owner whose recovery walk released before its end."""
    return f"ol:{{{subscription}:{partition}}}:cascades"


def firsts_key(subscription: str, partition: int) -> str:
    """The key of a partition's first-attempt runs (same slot as ``partition_keys``): a record's
    first attempt is written with those of its batch, one member per value listing the stretches of
    consecutive offsets, ``"<first>,<last>,...,<value>"`` (apply.lua, ``core/src/runs.rs``)."""
    return f"ol:{{{subscription}:{partition}}}:firsts"


def seek_key(subscription: str, partition: int) -> str:
    """The key of a partition's latest seek (same slot as ``partition_keys``)."""
    return f"ol:{{{subscription}:{partition}}}:seek"


def settings_key(subscription: str) -> str:
    """The key holding a subscription's settings."""
    return f"ol:sub:{subscription}"


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _redis_call(method: Callable[Concatenate[StateStore, _P], _R]) -> Callable[Concatenate[StateStore, _P], _R]:
    """Run a store method under the layer's retry policy on a cluster, raising only ``RedisError``.

    The cluster client retries without waiting, which would turn a failed master into a busy loop
    of the callers' own retries; and it raises some topology failures (a slot no node serves)
    outside ``redis.RedisError``, while callers handle Redis failures as ``RedisError``.
    """

    @functools.wraps(method)
    def wrapper(store: StateStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        def call() -> _R:
            try:
                return method(store, *args, **kwargs)
            except redis.exceptions.RedisClusterException as exc:
                raise redis.exceptions.ClusterDownError(f"Redis Cluster: {exc}") from exc

        if store._cluster_retry is None:
            return call()
        return store._cluster_retry.call_with_retry(call, lambda _error: None)

    return wrapper


class StateStore:
    """Typed access to the layer's Redis state.

    Args:
        redis_url: e.g. ``redis://127.0.0.1:6379/0``, ``redis+cluster://h1:7000,h2:7001/`` (see
            ``ordering_layer.state.client``).
        kafka_config: confluent-kafka settings of the layer's cluster; with them, subscription
            settings also have a durable copy in Kafka (``state.durable``), written on creation,
            tombstoned on deletion and read back when Redis has lost them. None: Redis alone.

    Raises:
        AuthenticationError: Redis refused the credentials or the TLS handshake.
        ConfigError: the URL is malformed.
    """

    def __init__(self, redis_url: str, *, kafka_config: Mapping[str, Any] | None = None) -> None:
        verify_redis(redis_url)
        self._durable = SettingsLog(kafka_config) if kafka_config is not None else None
        self.client = redis_client(redis_url)
        self._cluster_retry = retry_policy() if isinstance(self.client, RedisCluster) else None
        self._url = mask_url(redis_url)
        self._scripts = {name: _script(name) for name in ("apply", "claim", "seek_post", "seek_applied")}
        self._shas = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in self._scripts.items()}

    def __repr__(self) -> str:
        return f"StateStore({self._url})"

    # -- subscription settings -------------------------------------------------------------------
    def create_subscription(self, subscription: str, settings: SubscriptionSettings) -> bool:
        """Store a new subscription's settings, and their durable copy, unless it exists; True when created.

        The durable copy is written after Redis accepted the settings; when that write fails the
        settings are removed from Redis again, so that no subscription exists without its copy.

        Raises:
            PublishError, TopicError: the durable copy could not be written.
        """
        if not self.create_settings(subscription, settings):
            return False
        if self._durable is not None:
            try:
                self._durable.write(subscription, settings)
            except OrderingLayerError:
                self._delete_settings(subscription)
                raise
        return True

    @_redis_call
    def create_settings(self, subscription: str, settings: SubscriptionSettings) -> bool:
        """Put settings into Redis unless it has some; True when put (the durable copy is left alone)."""
        return bool(self.client.set(settings_key(subscription), settings.to_json(), nx=True))

    def write_durable_copy(self, subscription: str, settings: SubscriptionSettings) -> None:
        """Write the durable copy of existing settings again (no-op without a Kafka config).

        Raises:
            PublishError, TopicError: the copy could not be written.
        """
        if self._durable is not None:
            self._durable.write(subscription, settings)

    def settings(self, subscription: str) -> SubscriptionSettings:
        """The stored settings; when Redis has none, the durable copy, which is written back to Redis.

        Raises:
            SubscriptionNotFoundError: neither Redis nor the durable copy knows the subscription
                (never created, or deleted).
            TopicError: Redis had no settings and the durable copy could not be read.
        """
        raw = self._get_settings(subscription)
        if raw is not None:
            return SubscriptionSettings.from_json(raw)
        kept = self._durable.read(subscription) if self._durable is not None else None
        if kept is None:
            raise SubscriptionNotFoundError(subscription)
        _LOGGER.warning("settings of subscription %s missing in Redis %s: restored from their durable copy",
                        subscription, self._url)
        self.create_settings(subscription, kept)
        return kept

    @_redis_call
    def _get_settings(self, subscription: str) -> bytes | None:
        raw: bytes | None = self.client.get(settings_key(subscription))
        return raw

    @_redis_call
    def _delete_settings(self, subscription: str) -> int:
        return int(self.client.delete(settings_key(subscription)))

    def delete_subscription(self, subscription: str) -> int:
        """Remove the settings and every partition key of the subscription; return Redis keys removed.

        The durable copy is tombstoned first, so a failure leaves the subscription whole, and a
        deleted subscription is never read back from Kafka.

        Raises:
            PublishError, TopicError: the tombstone could not be written (nothing was removed).
        """
        if self._durable is not None:
            self._durable.forget(subscription)
        return self._delete_state(subscription)

    @_redis_call
    def _delete_state(self, subscription: str) -> int:
        # On a cluster the scan visits every primary; keys are deleted one slot at a time.
        removed = int(self.client.delete(settings_key(subscription)))
        for suffix in (":parked", ":seek", ":seek-counter"):
            removed += int(self.client.delete(f"{settings_key(subscription)}{suffix}"))
        # The glob narrows the scan; the regex keeps only this subscription's keys (a name may hold
        # glob characters or a colon, so that "a" must not match the keys of "a:1").
        match = "ol:{" + re.sub(r"([\\*?\[\]])", r"\\\1", subscription) + ":*"
        own = re.compile(r"ol:\{" + re.escape(subscription) + r":\d+\}:")
        scan: dict[str, Any] = {"target_nodes": RedisCluster.PRIMARIES} if isinstance(self.client, RedisCluster) else {}
        by_tag: dict[bytes, list[bytes]] = {}
        for key in self.client.scan_iter(match=match, count=1000, **scan):
            if own.match(key.decode(errors="replace")):
                by_tag.setdefault(key.partition(b"}")[0], []).append(key)
        for keys in by_tag.values():
            removed += int(self.client.delete(*keys))
        return removed

    # -- partitions ------------------------------------------------------------------------------
    @_redis_call
    def claim(self, subscription: str, partition: int) -> ClaimedPartition:
        """Become the owner of a partition: bump its epoch, read settled offsets and attempts; a
        pending seek (GRP-3) is applied with the claim (``ClaimedPartition.seek_offset``)."""
        [raw] = self._eval_many("claim", [(self._claim_keys(subscription, partition), ["", "", ""])])
        return parse_claim(raw)

    @_redis_call
    def claim_for_seek(self, subscription: str, epochs: Mapping[int, int], *, mark_applied: bool = False,
                       generation: int | None = None) -> dict[int, ClaimedPartition | None]:
        """Apply the pending seeks of partitions held under the given epochs (partition -> owner
        epoch, 0 for a partition never claimed), in one round trip: each such partition is claimed
        again (a new epoch fences the writes of before the seek) with the seek's settled set and
        no attempts or leases. Returns the partitions that had a seek pending (None: fenced, the
        stored epoch was another); ``mark_applied`` marks them applied at once (the caller has
        committed the targets in Kafka already); with ``generation`` only a pending seek of that
        generation is applied (a later one is left pending)."""
        order = sorted(epochs)
        args = ["1" if mark_applied else "", "" if generation is None else str(generation)]
        calls = [(self._claim_keys(subscription, p), [str(epochs[p]), *args]) for p in order]
        out: dict[int, ClaimedPartition | None] = {}
        for partition, raw in zip(order, self._eval_many("claim", calls), strict=True):
            if len(raw) > 1:
                out[partition] = parse_claim(raw)
            elif int(raw[0]) < 0:
                out[partition] = None
        return out

    @staticmethod
    def _claim_keys(subscription: str, partition: int) -> list[str]:
        return [*partition_keys(subscription, partition), seek_key(subscription, partition),
                cascades_key(subscription, partition), firsts_key(subscription, partition)]

    @_redis_call
    def apply_many(self, batches: Sequence[tuple[str, int, int, Sequence[Op]]]) -> list[ApplyResult]:
        """Apply op batches of several partitions in one pipeline (one round trip).

        Each batch is (subscription, partition, epoch, ops); ``OpKind`` names what each op does. The
        ops are packed ``"<letter>,<offset>,<value>;"`` each, and sent as the Redis command runs they
        make (``_core.command_runs``, see ``lua/apply.lua``).
        """
        return self._apply([(subscription, partition, epoch, "".join([f"{kind},{offset},{value};"
                                                                     for kind, offset, value in ops]))
                            for subscription, partition, epoch, ops in batches])

    @_redis_call
    def apply_packed(self, batches: Sequence[tuple[str, int, int, str]]) -> list[ApplyResult]:
        """``apply_many`` with each batch's ops packed already (``"<letter>,<offset>,<value>;"`` each,
        as the compiled core queues them)."""
        return self._apply(batches)

    def _apply(self, batches: Sequence[tuple[str, int, int, str]]) -> list[ApplyResult]:
        return [ApplyResult(int(r)) for r in self._eval_many("apply", self.apply_calls(batches))]

    @staticmethod
    def apply_calls(batches: Sequence[tuple[str, int, int, str]]) -> list[tuple[list[str], list[Any]]]:
        """The (keys, arguments) of ``apply.lua`` for each batch of packed ops."""
        calls = StateStore.apply_packed_calls(batches)
        return [(keys, [epoch, *_command_runs(packed)]) for keys, epoch, packed in calls]

    @staticmethod
    def apply_packed_calls(batches: Sequence[tuple[str, int, int, str]]) -> list[tuple[list[str], int, str]]:
        """The (keys, epoch, packed ops) of ``apply.lua`` for each batch, for ``evalsha_commands``."""
        return [([*partition_keys(subscription, partition), cascades_key(subscription, partition),
                  firsts_key(subscription, partition)], epoch, packed)
                for subscription, partition, epoch, packed in batches]

    @property
    def pipelines(self) -> bool:
        """Flushes can be sent back to back on one connection (``ApplyPipe``): a single server, not
        a cluster (whose client routes each call to its slot's primary)."""
        return not isinstance(self.client, RedisCluster)

    def script_sha(self, script: str) -> str:
        """The SHA1 of one of the layer's scripts (what EVALSHA names)."""
        return self._shas[script]

    def load_script(self, script: str) -> None:
        """Load one of the layer's scripts into the server (after a NOSCRIPT answer)."""
        self.client.script_load(self._scripts[script])  # type: ignore[union-attr]

    def _eval_many(self, script: str, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
        """Run one of the layer's scripts once per (keys, args) call, all in one pipeline."""
        # EVALSHA straight on the pipeline: redis-py's Script objects would add a SCRIPT EXISTS
        # round trip to every pipeline (and a cluster pipeline takes no Script). After a NOSCRIPT
        # answer (a restarted or flushed server, on a cluster maybe one primary of several) the
        # script is loaded on every primary and only the refused calls are sent again: the others
        # were run already.
        sha = self._shas[script]
        results: list[Any] = [None] * len(calls)
        pending = list(range(len(calls)))
        for reload in (False, True):
            if reload:
                self.client.script_load(self._scripts[script])  # type: ignore[union-attr]
            pipe = self.client.pipeline(transaction=False)
            for index in pending:
                keys, args = calls[index]
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
            for index, answer in zip(pending, pipe.execute(raise_on_error=False), strict=True):
                results[index] = answer
            failed = [r for r in results
                      if isinstance(r, Exception) and not isinstance(r, redis.exceptions.NoScriptError)]
            if failed:
                raise failed[0]
            pending = [i for i in pending if isinstance(results[i], redis.exceptions.NoScriptError)]
            if not pending:
                return results
        raise redis.exceptions.NoScriptError(f"{script}.lua could not be loaded")

    # -- seeks (GRP-3) ------------------------------------------------------------------------------
    @_redis_call
    def post_seek(self, subscription: str, targets: Mapping[int, tuple[int, Sequence[int]]]) -> int:
        """Record a seek: per partition the target offset and the offsets above it that count as
        settled; then announce its generation to the subscribers. Returns the generation."""
        generation = int(self.client.incr(f"{settings_key(subscription)}:seek-counter"))
        self._eval_many("seek_post", [
            ([seek_key(subscription, p)], [generation, offset, ",".join(map(str, sorted(settled)))])
            for p, (offset, settled) in sorted(targets.items())])
        self.client.set(f"{settings_key(subscription)}:seek", generation)
        return generation

    @_redis_call
    def seek_announced(self, subscription: str) -> int:
        """The latest seek generation announced for the subscription (0: none)."""
        return int(self.client.get(f"{settings_key(subscription)}:seek") or 0)

    @_redis_call
    def seek_status(self, subscription: str, partitions: Sequence[int]) -> dict[int, SeekStatus]:
        """Each partition's latest seek generation and the last one applied."""
        pipe = self.client.pipeline(transaction=False)
        for partition in partitions:
            pipe.hmget(seek_key(subscription, partition), ["gen", "applied"])
        return {p: SeekStatus(int(gen or 0), int(applied or 0))
                for p, (gen, applied) in zip(partitions, pipe.execute(), strict=True)}

    @_redis_call
    def seek_applied(self, subscription: str, partition: int, epoch: int, generation: int) -> bool:
        """The owner of ``epoch`` has committed the target of seek ``generation``: mark it applied.
        False when fenced (another owner since) or marked already."""
        keys = [partition_keys(subscription, partition)[0], seek_key(subscription, partition)]
        [answer] = self._eval_many("seek_applied", [(keys, [epoch, generation])])
        return bool(answer)

    @_redis_call
    def epochs(self, subscription: str, partitions: Sequence[int]) -> dict[int, int]:
        """Each partition's owner epoch (0: never claimed)."""
        pipe = self.client.pipeline(transaction=False)
        for partition in partitions:
            pipe.get(partition_keys(subscription, partition)[0])
        return {p: int(raw or 0) for p, raw in zip(partitions, pipe.execute(), strict=True)}

    @_redis_call
    def settled_from(self, subscription: str, committed: Mapping[int, int]) -> dict[int, tuple[int, list[int]]]:
        """Per partition, where its acked state starts and the offsets settled at or above it: the
        start is the committed offset, or the floor an owner wrote (``OpKind.FLOOR``) when that is
        higher (everything below it is settled too); the offsets ascending."""
        order = sorted(committed)
        pipe = self.client.pipeline(transaction=False)
        for partition in order:
            key = partition_keys(subscription, partition)[1]
            pipe.zscore(key, FLOOR_MEMBER)
            pipe.zrangebyscore(key, committed[partition], "+inf")
        replies = pipe.execute()
        out = {}
        for index, partition in enumerate(order):
            floor, members = replies[2 * index], replies[2 * index + 1]
            start = max(committed[partition], int(floor) if floor is not None else -1)
            out[partition] = (start, [o for o in offset_fields(members) if o >= start])
        return out

    @_redis_call
    def parked_keys(self, subscription: str) -> set[bytes]:
        """Ordering keys (record key bytes) parked by a ``park_key`` dead-letter policy (DLQ-2)."""
        return set(self.client.smembers(f"{settings_key(subscription)}:parked"))

    @_redis_call
    def park_key(self, subscription: str, ordering_key: bytes) -> None:
        """Park a key: its later messages follow its dead letter until ``release_key``."""
        self.client.sadd(f"{settings_key(subscription)}:parked", ordering_key)

    @_redis_call
    def release_key(self, subscription: str, ordering_key: str | bytes) -> bool:
        """Release a parked key (text is taken as UTF-8); True when it was parked."""
        return bool(self.client.srem(f"{settings_key(subscription)}:parked", ordering_key))
