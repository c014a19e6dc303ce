"""The scheduler's step when Redis does not answer (PUB-5)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import pytest
import redis

from ordering_layer.scheduler.book import ScheduleBook
from ordering_layer.scheduler.index import Claim
from ordering_layer.scheduler.scheduler import REDIS_RETRY, Publisher, Scheduler


class FlakyIndex:
    """A time index whose claims fail while ``down``; nothing is ever due."""

    def __init__(self) -> None:
        self.down = True
        self.claims = 0

    def claim(self, now_ms: int, lease_ms: int, limit: int) -> Claim:
        self.claims += 1
        if self.down:
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return Claim(True, [], None)

    def sweep(self, before_ms: int, limit: int) -> list[str]:
        return []


class Book:
    """What the scheduler's step reads of a ``ScheduleBook``."""

    def __init__(self) -> None:
        self.index = FlakyIndex()
        self.log = self

    def forget(self, ids: list[str]) -> None:
        """The schedule topic's tombstones: nothing to forget here."""


def no_producer(connection: Mapping[str, Any]) -> Publisher:
    """The steps here claim nothing, so they publish nothing."""
    raise AssertionError(f"no publish expected ({connection})")


def test_redis_down_is_one_warning_per_outage_and_a_slower_step(caplog: pytest.LogCaptureFixture) -> None:
    """PUB-5: while Redis does not answer, the scheduler's step logs one warning (no traceback per
    step) and steps every ``REDIS_RETRY`` s; once Redis answers it says so and polls as usual."""
    book = Book()
    scheduler = Scheduler({"bootstrap.servers": "127.0.0.1:1"}, "redis://127.0.0.1:1/0", book=cast(ScheduleBook, book),
                          make_producer=no_producer)
    with caplog.at_level(logging.INFO, logger="ordering_layer.scheduler.scheduler"):
        assert [scheduler._step() for _ in range(3)] == [REDIS_RETRY] * 3
        book.index.down = False
        assert scheduler._step() < REDIS_RETRY
    records = [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records]
    assert [(level, exc_info) for level, _, exc_info in records] == [(logging.WARNING, None), (logging.INFO, None)]
    assert "Redis does not answer" in records[0][1] and "Connection refused" in records[0][1]
    assert book.index.claims == 4
