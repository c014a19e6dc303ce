"""The two-minute chaos soak (issue 12, ``make soak-short``) on the session's three-broker cluster."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from bench.soak import SHORT, report, run_soak
from ordering_layer.stack import LocalStack

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

_LOGGER = logging.getLogger(__name__)


def test_short_soak_loses_nothing_and_keeps_every_key_in_order(kafka_cluster: LocalStack, tmp_path: Path) -> None:
    """SUB-1, SUB-3, SUB-4, SUB-5, ACK-5, ACK-6, DLQ-2, DLQ-3: 20,000 prober messages over 500 keys
    with 1 % random nacks, consumed by 3 subscriber processes while one of them is killed with
    SIGKILL every 3-5 s, the busiest partition leader is killed and restarted, Redis is killed and
    restarted and later FLUSHALL'd, and the publisher's broker connections are cut. Every message is
    acked or dead-lettered (nothing lost), no key is delivered out of order or without its cascade,
    no stale ack takes effect, and each of the three poison messages (nacked forever, os._exit on
    every delivery, held past max_lease_duration) is dead-lettered after exactly 5 attempts."""
    kafka_cluster.start_broker()  # every broker up: an earlier test may have left one down
    figures = run_soak(SHORT, kafka_cluster, tmp_path)
    _LOGGER.info("%s", report(figures))
    summary = json.dumps({k: v for k, v in figures.items() if k != "timeline"}, indent=1)
    assert figures["drained"], summary
    assert figures["published"] == figures["expected"] == SHORT.messages, summary
    assert figures["lost"] == 0, summary
    assert figures["order_violations"] == 0 and figures["cascade_violations"] == 0, summary
    assert figures["stale_acks_accepted"] == 0, summary
    assert figures["violations"] == {}, summary
    assert figures["poison_dead_lettered_exactly"] == 3, summary
    assert figures["subscriber_kills"] >= 5 and figures["connections_cut"] > 0, summary
    assert figures["ok"], summary
