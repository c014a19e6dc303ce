"""The Redis state store's fence against real Redis: epochs across a loss of Redis state (ACK-5, SUB-3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import Op, OpKind, partition_keys

pytestmark = pytest.mark.integration


def test_after_a_loss_of_redis_state_only_the_latest_owner_writes(endpoints: Any,
                                                                  unique_name: Callable[[str], str]) -> None:
    """ACK-5, SUB-3: a zombie (an earlier owner that lives on) and the current owner keep writing after
    Redis lost the partition's keys. Whoever writes first, the zombie is fenced from the owner's
    next write on, for good, and the owner is never fenced (before, the first writer's epoch was
    adopted and the other one was fenced: the zombie could fence the real owner out)."""
    store = StateStore(endpoints.redis_url)
    name = unique_name("fence")
    ops: list[Op] = [(OpKind.DELIVERED, 7, 1)]
    zombie = store.claim(name, 0).epoch
    owner = store.claim(name, 0).epoch
    assert owner > zombie
    assert store.apply_many([(name, 0, zombie, ops)]) == [ApplyResult.FENCED]

    store.client.delete(*partition_keys(name, 0))  # Redis lost the partition's state
    assert store.apply_many([(name, 0, zombie, ops)]) == [ApplyResult.ADOPTED]  # the zombie writes first
    assert store.apply_many([(name, 0, owner, ops)]) == [ApplyResult.ADOPTED]
    for _ in range(3):
        assert store.apply_many([(name, 0, zombie, ops)]) == [ApplyResult.FENCED]
        assert store.apply_many([(name, 0, owner, ops)]) == [ApplyResult.APPLIED]

    store.client.delete(*partition_keys(name, 0))  # the owner writes first this time
    assert store.apply_many([(name, 0, owner, ops)]) == [ApplyResult.ADOPTED]
    assert store.apply_many([(name, 0, zombie, ops)]) == [ApplyResult.FENCED]


def test_a_claim_after_a_loss_of_redis_state_fences_every_earlier_owner(endpoints: Any,
                                                                        unique_name: Callable[[str], str]) -> None:
    """ACK-5: a claim made after Redis lost the epoch key still hands out an epoch above every one
    handed out before, so earlier owners stay fenced whatever order they write in."""
    store = StateStore(endpoints.redis_url)
    name = unique_name("reclaim")
    earlier = [store.claim(name, 0).epoch for _ in range(3)]
    store.client.delete(*partition_keys(name, 0))
    latest = store.claim(name, 0).epoch
    assert latest > max(earlier)
    ops: list[Op] = [(OpKind.SETTLED, 3, 0)]
    for epoch in earlier:
        assert store.apply_many([(name, 0, epoch, ops)]) == [ApplyResult.FENCED]
    assert store.apply_many([(name, 0, latest, ops)]) == [ApplyResult.APPLIED]
