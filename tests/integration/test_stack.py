"""The stack launcher (whichever backend ``ORDERING_LAYER_STACK`` names) and its CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from confluent_kafka import KafkaException
from redis.cluster import RedisCluster

from ordering_layer import Admin, OrderedProducer
from ordering_layer.cli import main
from ordering_layer.errors import StackError
from ordering_layer.stack import StackBackend, containers
from ordering_layer.state.client import redis_client
from tests.checker import wait_until
from tests.integration.conftest import cli_servers
from tests.kafka_helpers import end_offsets

pytestmark = pytest.mark.integration


def test_up_twice_is_harmless_and_status_env_find_it(restartable: StackBackend) -> None:
    """The launcher: a second up returns the same running services; status and env report them."""
    first = restartable.endpoints()
    assert restartable.up() == first
    status = restartable.status()
    assert status["up"] and status["kafka"]["running"] and status["redis"]["running"]
    state_dir = str(status["state_dir"])
    runner = CliRunner()
    env = runner.invoke(main, ["stack", "env", "--state-dir", state_dir])
    assert env.exit_code == 0
    assert f"export ORDERING_LAYER_BOOTSTRAP={first.bootstrap}" in env.output
    assert f"export ORDERING_LAYER_REDIS_URL={first.redis_url}" in env.output
    shown = runner.invoke(main, ["stack", "status", "--state-dir", state_dir])
    assert shown.exit_code == 0 and json.loads(shown.output)["up"] is True


def test_redis_restart_keeps_append_only_data(restartable: StackBackend) -> None:
    """The launcher restarts Redis alone with AOF on, so its data survives a kill -9 (every master of a
    Redis Cluster alike)."""
    client = redis_client(restartable.endpoints().redis_url)
    client.set("ol:test:aof", "kept")
    every_master = {"target_nodes": client.get_primaries()} if isinstance(client, RedisCluster) else {}
    client.execute_command("BGREWRITEAOF", **every_master)
    restartable.stop_redis()
    restartable.start_redis()
    client = redis_client(restartable.endpoints().redis_url)
    assert client.get("ol:test:aof") == b"kept"


def test_broker_kill_9_and_restart_keep_its_address_and_data(restartable: StackBackend,
                                                            unique_name: Callable[[str], str]) -> None:
    """The launcher restarts the broker alone after a SIGKILL, on the same address with its log."""
    endpoints = restartable.endpoints()
    topic = Admin(endpoints.kafka_config()).create_topic(unique_name("restart")).name
    with OrderedProducer(endpoints.kafka_config()) as producer:
        producer.publish(topic, b"kept", ordering_key="k").result(timeout=60)
    restartable.stop_broker(kill=True)
    assert not restartable.status()["kafka"]["running"]
    restartable.start_broker()
    assert restartable.endpoints() == endpoints

    def kept() -> bool:
        try:  # the restarted broker answers before it leads its partitions again
            return end_offsets(endpoints.kafka_config(), topic) == {0: 1}
        except KafkaException:
            return False

    wait_until(kept, 60, "the record kept, its partition led again")


def test_cli_reports_a_missing_stack(tmp_path: Path) -> None:
    """A CLI call without a stack says what to do instead of failing obscurely."""
    result = CliRunner().invoke(main, ["stack", "env", "--state-dir", str(tmp_path / "none")])
    assert result.exit_code != 0
    assert "ordering-layer stack up" in result.output


def test_cli_topic_subscription_publish_pull(endpoints: Any, unique_name: Callable[[str], str]) -> None:
    """The CLI end to end: topic create, subscription create/describe, publish from stdin, pull with ack."""
    runner = CliRunner()
    servers = cli_servers(endpoints)
    topic, name = unique_name("cli-topic"), unique_name("cli-sub")
    assert runner.invoke(main, ["topic", "create", topic, "--partitions", "2", *servers]).exit_code == 0
    created = runner.invoke(main, ["subscription", "create", name, "--topic", topic, *servers])
    assert created.exit_code == 0, created.output
    published = runner.invoke(main, ["publish", topic, "--key-separator", ":", *servers],
                              input="k1:first\nk1:second\nk2:third\n")
    assert published.exit_code == 0, published.output
    pulled = runner.invoke(main, ["pull", name, "--max-messages", "10", *servers])
    assert pulled.exit_code == 0, pulled.output
    lines = [line.split("\t") for line in pulled.output.splitlines() if line.startswith("k")]
    assert [(line[0], line[-1]) for line in lines if line[0] == "k1"] == [("k1", "first"), ("k1", "second")]
    described = runner.invoke(main, ["subscription", "describe", name, "--json", *servers])
    assert described.exit_code == 0
    assert json.loads(described.output)["backlog"] == 0


def test_container_backend_falls_back_to_official_images_and_names_the_fix(
        restartable: StackBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The testcontainers backend uses the local images, else pulls the official ones; when neither
    can be had (no registry here) it says to build them."""
    if not isinstance(restartable, containers.ContainerStack):
        pytest.skip("container backend only (ORDERING_LAYER_STACK=testcontainers)")
    assert restartable.status()["kafka"]["image"] == containers.local_images()["kafka"]
    monkeypatch.setattr(containers, "local_images", lambda: {"redis": "ordering-layer/absent:0"})
    monkeypatch.setattr(containers, "official_images", lambda: {"redis": "registry.invalid/absent:0"})
    with pytest.raises(StackError, match=r"ordering-layer/absent:0 \(build it with 'make images'\)"):
        restartable._image("redis")
    monkeypatch.setenv("ORDERING_LAYER_REDIS_IMAGE", "example/redis:7")
    assert restartable._image("redis") == "example/redis:7"
