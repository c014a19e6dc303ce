"""``subscription describe`` against a real subscription: outstanding messages, a parked key, owner,
epoch, offsets, backlog and oldest unacked age, as ``Admin.describe_subscription``, CLI ``--json``
and the table."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner

from ordering_layer import Admin, DeadLetterPolicy, Message, Subscriber
from ordering_layer.cli import main
from ordering_layer.kafka.partitioner import murmur2
from tests.checker import wait_until
from tests.integration.conftest import cli_servers, publish_keys

pytestmark = pytest.mark.integration


def test_describe_shows_outstanding_held_and_parked(admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
                                                    subscription: Callable[..., tuple[str, str]],
                                                    unique_name: Callable[[str], str]) -> None:
    """DLQ-2, ACK-4: describe reports per partition what the subscription's state is: the held
    (leased, unacked) messages and their keys, the key parked by a park_key dead letter, the owner
    and its epoch, committed offset, log end, backlog and the oldest unacked message's age."""
    topic, name = subscription(partitions=2, dead_letter_policy=DeadLetterPolicy(
        unique_name("dlq"), max_delivery_attempts=5, mode="park_key"))
    publish_keys(kafka_config, topic, keys=1, per_key=1, prefix="poison")
    publish_keys(kafka_config, topic, keys=3, per_key=2, prefix="held")
    store = admin.store
    held: dict[str, list[Message]] = {}
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        def step() -> bool:
            for message in subscriber.pull(name, max_messages=100, timeout=0.5):
                if message.ordering_key == "poison-0":
                    message.nack()
                else:
                    held.setdefault(message.ordering_key, []).append(message)
            return b"poison-0" in store.parked_keys(name) and len(held) == 3

        wait_until(step, 60, "the poison key parked and a message of each held key pulled")
        outstanding = sum(len(messages) for messages in held.values())
        # Settles reach Redis in the engine's next batch: the dead letter's lease may still be there.
        wait_until(lambda: admin.describe_subscription(name).outstanding == outstanding, 30,
                   "the dead letter settled in Redis")
        started = time.monotonic()
        described = admin.describe_subscription(name)
        took = time.monotonic() - started

        assert described.topic == topic and described.parked_keys == ("poison-0",)
        assert described.outstanding == outstanding
        assert described.backlog >= outstanding  # held messages are not settled: the commit stays below them
        assert sum(p.held_keys for p in described.partitions) == 3
        assert sum(p.parked_keys for p in described.partitions) == 1
        parked_partition = (murmur2(b"poison-0") & 0x7FFFFFFF) % 2
        assert described.partitions[parked_partition].parked_keys == 1
        for row in described.partitions:
            assert row.owner is not None and row.owner_host is not None
            assert row.epoch is not None and row.epoch >= 1
            assert row.log_end == row.backlog + (row.committed or 0)
            assert row.held_keys_complete
            if row.outstanding:
                assert row.oldest_unacked_age is not None and 0 <= row.oldest_unacked_age < 120
        assert took < 15

        runner = CliRunner()
        servers = cli_servers(endpoints)
        result = runner.invoke(main, ["subscription", "describe", name, "--json", *servers])
        assert result.exit_code == 0, result.output
        printed = json.loads(result.output)
        assert printed["parked_keys"] == ["poison-0"] and printed["outstanding"] == outstanding
        assert printed["settings"]["dead_letter_policy"]["mode"] == "park_key"
        assert [(p["partition"], p["epoch"], p["held_keys"], p["outstanding"], p["log_end"])
                for p in printed["partitions"]] == [
            (p.partition, p.epoch, p.held_keys, p.outstanding, p.log_end) for p in described.partitions]

        table = runner.invoke(main, ["subscription", "describe", name, *servers])
        assert table.exit_code == 0, table.output
        lines = table.output.splitlines()
        assert lines[0].startswith(f"subscription {name}  topic {topic}")
        assert "parked keys 1 (poison-0)" in table.output
        header = lines.index(next(line for line in lines if line.startswith("partition")))
        rows = [line.split() for line in lines[header + 1:]]
        assert [row[0] for row in rows] == ["0", "1"]
        assert sum(int(row[6]) for row in rows) == outstanding  # the outstanding column
        for messages in held.values():
            Subscriber.acknowledge(messages)
