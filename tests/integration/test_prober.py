"""The ordering prober end to end against the real broker and Redis (SUB-1, SUB-3, SUB-4, SUB-5, ACK-6)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from ordering_layer import OrderedProducer, RetryPolicy
from ordering_layer.cli import main
from ordering_layer.prober import HandlerPlan, ProbeOptions, ProbeRun, PublishPlan
from ordering_layer.prober.events import ATTR_PUBLISHED, ATTR_RUN, ATTR_SEQ
from ordering_layer.pytest_plugin import CreatedSubscription

pytestmark = pytest.mark.integration

NO_BACKOFF = RetryPolicy(minimum_backoff=0, maximum_backoff=0)


def prober(kafka_bootstrap: str, redis_url: str, *args: str) -> tuple[Result, dict[str, Any]]:
    """Run ``ordering-layer prober ARGS`` in-process; return the result and the JSON summary (from
    stdout, or from the ``--summary`` file)."""
    result = CliRunner().invoke(main, ["prober", "--bootstrap", kafka_bootstrap, "--redis-url", redis_url, *args])
    assert result.exit_code in (0, 1), (result.exit_code, result.output, result.exception)
    if "--summary" in args:
        return result, json.loads(Path(args[args.index("--summary") + 1]).read_text())
    return result, json.loads(result.stdout)


@pytest.mark.parametrize("front_end", ["callback", "pull", "consumer"])
def test_prober_finds_no_violation_with_random_nacks(kafka_config: dict[str, Any], redis_url: str,
                                                     subscription_factory: Callable[..., CreatedSubscription],
                                                     front_end: str) -> None:
    """SUB-1, SUB-3, SUB-4, SUB-5, ACK-6: 3,000 messages over 50 keys and 3 partitions, 5 % random
    nacks and a 0-2 ms handler: every message acked, cascades after every nack, no violation."""
    created = subscription_factory(partitions=3, retry_policy=NO_BACKOFF)
    options = ProbeOptions(publish=PublishPlan(created.topic, keys=50, messages=3000),
                           subscription=created.subscription, front_end=front_end,
                           handler=HandlerPlan(nack_rate=0.05, delay=(0.0, 0.002), seed=7),
                           idle_timeout=60)
    summary = ProbeRun(kafka_config, redis_url, options).run()
    verdict = summary["verdict"]
    assert summary["ok"], json.dumps(verdict, indent=1)
    assert verdict["violations"] == {} and verdict["lost_messages"] == 0
    assert verdict["expected_messages"] == verdict["acked_messages"] == 3000
    assert verdict["first_deliveries"] == 3000 and verdict["latency"]["count"] == 3000
    assert verdict["nacks"] > 50 and verdict["restarts"] >= verdict["nacks"] - verdict["dead_lettered"]
    assert summary["publish"]["published"] == 3000 and summary["publish"]["failures"] == 0


def test_prober_cli_full_run_prints_summary(kafka_bootstrap: str, redis_url: str,
                                            subscription_factory: Callable[..., CreatedSubscription]) -> None:
    """SUB-1, SUB-3, SUB-4: the CLI's full mode in pull mode with nacks and a slow key: exit status 0
    and a JSON summary with the verdict, the latency percentiles and the options."""
    created = subscription_factory(partitions=2, retry_policy=NO_BACKOFF)
    result, summary = prober(kafka_bootstrap, redis_url, "--topic", created.topic, "--subscription",
                             created.subscription, "--keys", "20", "--messages", "1000", "--front-end", "pull",
                             "--nack-rate", "0.05", "--delay-ms", "0-1", "--slow-keys", "key-3", "--slow-delay-ms",
                             "20", "--batch-size", "10", "--progress-interval", "1")
    assert result.exit_code == 0
    assert summary["ok"] and summary["mode"] == "full" and summary["run_id"]
    verdict = summary["verdict"]
    assert verdict["violations"] == {} and verdict["acked_messages"] == 1000 and verdict["keys"] == 20
    assert set(verdict["latency"]) == {"count", "p50_ms", "p90_ms", "p99_ms", "max_ms"}
    assert summary["options"]["handler"]["slow_keys"] == ["key-3"]
    assert "published" in result.stderr  # the plain progress line (stderr is not a terminal)


def test_prober_checks_records_another_process_published(
        kafka_bootstrap: str, redis_url: str, subscription_factory: Callable[..., CreatedSubscription],
        tmp_path: Path) -> None:
    """SUB-1, SUB-3: a publish-only run writes its per-key counts; a check-only run consumes the
    records and verifies them against those counts."""
    created = subscription_factory(partitions=3, retry_policy=NO_BACKOFF)
    published = tmp_path / "published.json"
    result, expected = prober(kafka_bootstrap, redis_url, "--mode", "publish", "--topic", created.topic, "--keys",
                              "10", "--messages", "500", "--rate", "2000", "--summary", str(published), "--no-progress")
    assert result.exit_code == 0 and expected["ok"] and not result.stdout
    assert sum(next(iter(expected["expected"].values())).values()) == 500
    assert expected["publish"]["rate_per_s"] <= 2000 * 1.1
    result, summary = prober(kafka_bootstrap, redis_url, "--mode", "check", "--subscription", created.subscription,
                             "--expect", str(published), "--nack-rate", "0.05", "--no-progress")
    assert result.exit_code == 0, summary["verdict"]["examples"]
    assert summary["verdict"]["acked_messages"] == 500 and summary["verdict"]["expected_messages"] == 500


def test_prober_checks_the_event_files_of_subscriber_processes(
        kafka_bootstrap: str, redis_url: str, subscription_factory: Callable[..., CreatedSubscription],
        tmp_path: Path) -> None:
    """SUB-1, SUB-3, SUB-4: the multi-process path: a publisher writes its counts and a consume-only
    subscriber its deliveries to an events folder; a check-only run verifies the folder."""
    created = subscription_factory(partitions=2, retry_policy=NO_BACKOFF)
    events = tmp_path / "events"
    common = ["--topic", created.topic, "--subscription", created.subscription, "--events", str(events),
              "--no-progress"]
    result, _ = prober(kafka_bootstrap, redis_url, "--mode", "publish", "--keys", "10", "--messages", "400", *common)
    assert result.exit_code == 0
    result, consumed = prober(kafka_bootstrap, redis_url, "--mode", "consume", "--subscriber-id", "sub-a",
                              "--nack-rate", "0.05", "--idle-timeout", "6", *common)
    assert result.exit_code == 0 and consumed["consume"]["deliveries"] >= 400
    assert (events / "sub-a.jsonl").stat().st_size > 0
    result, summary = prober(kafka_bootstrap, redis_url, "--mode", "check", "--from-events", str(events), "--lag",
                             "0", "--idle-timeout", "5", "--no-progress")
    assert result.exit_code == 0, summary["verdict"]["examples"]
    assert summary["verdict"]["acked_messages"] == summary["verdict"]["expected_messages"] == 400
    assert summary["verdict"]["nacks"] > 0 and summary["events"]["malformed"] == 0


def test_prober_fails_on_records_out_of_order(kafka_config: dict[str, Any], kafka_bootstrap: str, redis_url: str,
                                              subscription_factory: Callable[..., CreatedSubscription],
                                              tmp_path: Path) -> None:
    """SUB-1: a key whose records were written in the order 0, 1, 3, 2 (and 5 expected): the check
    reports a gap, a reorder and a lost message and exits with status 1."""
    created = subscription_factory(partitions=1, retry_policy=NO_BACKOFF)
    with OrderedProducer(kafka_config) as producer:
        for seq in (0, 1, 3, 2):
            producer.publish(created.topic, b"x", ordering_key="key-0",
                             attributes={ATTR_RUN: "broken", ATTR_SEQ: str(seq), ATTR_PUBLISHED: "0"}).result(30)
    expect = tmp_path / "expect.json"
    expect.write_text(json.dumps({"expected": {"broken": {"key-0": 5}}}))
    result, summary = prober(kafka_bootstrap, redis_url, "--mode", "check", "--subscription", created.subscription,
                             "--expect", str(expect), "--idle-timeout", "5", "--no-progress")
    assert result.exit_code == 1
    assert not summary["ok"]
    assert summary["verdict"]["violations"] == {"gap": 1, "reorder": 1, "lost": 1}
