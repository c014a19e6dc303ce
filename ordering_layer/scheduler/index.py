"""The time index of scheduled messages in Redis (PUB-5).

All keys share one hash tag, ``ol:{sched:<schedule topic>}:...``, so every script touches one slot
(Redis Cluster works). The index is derived state: the schedule topic in Kafka holds every
scheduled message, and a lost index (flush, restart without persistence) is rebuilt from it; the
``built`` key tells the index is complete. Every decision (claim, cancel, completion) is one Lua
script, so cancel and activation never both win.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib import resources
from typing import Any, NamedTuple

import redis

from ordering_layer.scheduler.records import CancelResult, ScheduledMessage, ScheduleState
from ordering_layer.state.client import redis_client

_LOGGER = logging.getLogger(__name__)

_REBUILD_LOCK_MS = 120_000


def _script(name: str) -> str:
    return (resources.files("ordering_layer.scheduler") / "lua" / f"{name}.lua").read_text()


def index_keys(schedule_topic: str) -> list[str]:
    """due, claimed, entries, done, done_at and built keys of a schedule topic (one hash slot)."""
    tag = f"ol:{{sched:{schedule_topic}}}"
    return [f"{tag}:{name}" for name in ("due", "claimed", "entries", "done", "done_at", "built")]


class Claim(NamedTuple):
    """What one claim returned: the claimed records and when to look again."""

    built: bool  # False: the index is missing and must be rebuilt before anything is claimed
    messages: list[ScheduledMessage]
    next_ms: int | None  # earliest enqueue_at or lease deadline left; None when nothing is left


class Cancelled(NamedTuple):
    """What the cancel script decided; ``record`` is set when it cancelled just now."""

    result: CancelResult | None  # None: the index is missing and must be rebuilt first
    record: ScheduledMessage | None


class ScheduleIndex:
    """Typed access to the Redis time index of one schedule topic.

    Args:
        redis_url: e.g. ``redis://127.0.0.1:6379/0``, ``redis+cluster://h1:7000,h2:7001/`` (see
            ``ordering_layer.state.client``).
        schedule_topic: the schedule topic the index belongs to.
    """

    def __init__(self, redis_url: str, schedule_topic: str) -> None:
        self.client = redis_client(redis_url)
        self.keys = index_keys(schedule_topic)
        self._lock_key = self.keys[0].rsplit(":", 1)[0] + ":rebuild-lock"
        self._add = self.client.register_script(_script("add"))  # type: ignore[union-attr]
        self._claim = self.client.register_script(_script("claim"))  # type: ignore[union-attr]
        self._complete = self.client.register_script(_script("complete"))  # type: ignore[union-attr]
        self._cancel = self.client.register_script(_script("cancel"))  # type: ignore[union-attr]
        self._sweep = self.client.register_script(_script("sweep"))  # type: ignore[union-attr]

    def add(self, message: ScheduledMessage) -> bool:
        """Index a PENDING message; False when the id is done or being activated already."""
        return bool(self._add(keys=self.keys, args=[message.schedule_id, message.enqueue_at_ms, message.encode()]))

    def claim(self, now_ms: int, lease_ms: int, limit: int) -> Claim:
        """Claim up to ``limit`` due messages (and expired claims) until ``now_ms + lease_ms``."""
        raw = self._claim(keys=self.keys, args=[now_ms, now_ms + lease_ms, limit])
        if int(raw[0]) == -2:
            return Claim(False, [], None)
        messages = [ScheduledMessage.decode(raw[i]) for i in range(2, len(raw), 2)]
        return Claim(True, messages, None if int(raw[0]) < 0 else int(raw[0]))

    def complete(self, ids: Sequence[str], state: ScheduleState, at_ms: int) -> list[str]:
        """Mark ``ids`` done; return those that were not done before."""
        if not ids:
            return []
        fresh = self._complete(keys=self.keys, args=[at_ms, state.value, *ids])
        return [i.decode() for i in fresh]

    def cancel(self, schedule_id: str, now_ms: int) -> Cancelled:
        """Cancel ``schedule_id`` unless it is claimed or done (one atomic decision)."""
        raw = self._cancel(keys=self.keys, args=[schedule_id, now_ms])
        verdict = raw[0].decode()
        if verdict == "REBUILD":
            return Cancelled(None, None)
        record = ScheduledMessage.decode(raw[1]) if len(raw) > 1 and raw[1] else None
        return Cancelled(CancelResult[verdict], record)

    def sweep(self, before_ms: int, limit: int) -> list[str]:
        """Forget terminal states older than ``before_ms``; return the ids forgotten."""
        return [i.decode() for i in self._sweep(keys=self.keys, args=[before_ms, limit])]

    def restore(self, messages: Sequence[ScheduledMessage]) -> None:
        """Load the last record of each id read from the topic (a rebuild), in one pipeline."""
        # A cluster pipeline takes no Script: there the scripts run one by one (a rebuild is rare).
        pipe: Any = self.client.pipeline(transaction=False) if isinstance(self.client, redis.Redis) else self.client
        for message in messages:
            if message.state is ScheduleState.PENDING:
                self._add(keys=self.keys, args=[message.schedule_id, message.enqueue_at_ms, message.encode()],
                          client=pipe)
            else:
                self._complete(keys=self.keys, args=[message.done_at_ms or 0, message.state.value,
                                                     message.schedule_id], client=pipe)
        if pipe is not self.client:
            pipe.execute()

    def is_built(self) -> bool:
        """True while the index holds every schedule the topic holds."""
        return bool(self.client.exists(self.keys[5]))

    def mark_built(self) -> None:
        """Record that a rebuild completed."""
        self.client.set(self.keys[5], b"1")

    def lock_rebuild(self) -> bool:
        """Take the rebuild lock (one scheduler rebuilds at a time); True when taken."""
        return bool(self.client.set(self._lock_key, b"1", nx=True, px=_REBUILD_LOCK_MS))

    def unlock_rebuild(self) -> None:
        """Release the rebuild lock."""
        self.client.delete(self._lock_key)

    def pending(self) -> list[tuple[ScheduledMessage, bool]]:
        """Every indexed message not yet done, with True when a scheduler has claimed it."""
        claimed, entries = self.keys[1:3]
        claimed_ids = {i.decode() for i in self.client.zrange(claimed, 0, -1)}
        records: dict[Any, Any] = self.client.hgetall(entries)
        found = [ScheduledMessage.decode(raw) for raw in records.values()]
        found.sort(key=lambda m: (m.enqueue_at_ms, m.schedule_id))
        return [(m, m.schedule_id in claimed_ids) for m in found]
