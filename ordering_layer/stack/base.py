"""The seam between the layer's tooling and whatever runs Kafka + Redis for it.

A backend starts Kafka (a single node, or with the local backend a replicated three-node cluster)
and a Redis server, hands out their addresses, and can stop and restart any broker or Redis alone,
keeping its data (the chaos tests rely on that). The local backend runs the processes directly; a
container backend runs a single node behind testcontainers.
"""

from __future__ import annotations

import json
import random
import shlex
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ordering_layer.config import read_kafka_properties
from ordering_layer.errors import StackError
from ordering_layer.stack.processes import write_private
from ordering_layer.state.client import mask_url

#: Broker settings every backend's single-node Kafka uses (besides its listeners and log folder).
BROKER_SETTINGS: dict[str, str] = {
    "num.partitions": "1",
    "auto.create.topics.enable": "false",
    # A small __consumer_offsets keeps the first group join fast on a 2-core machine.
    "offsets.topic.num.partitions": "4",
    "offsets.topic.replication.factor": "1",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    # Lets tests use short session timeouts to detect a killed subscriber quickly.
    "group.min.session.timeout.ms": "1000",
}

#: Broker counts a stack can run: one node, or a three-voter quorum that survives one broker loss.
BROKER_COUNTS = (1, 3)

#: What a three-broker cluster changes in ``BROKER_SETTINGS``: every topic, the internal ones
#: included, keeps 3 replicas and takes writes while 2 of them are in sync, so one broker can die.
CLUSTER_SETTINGS: dict[str, str] = {
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
    # A killed broker is fenced, and its partitions get new leaders, after 6 s instead of 9 s.
    "broker.heartbeat.interval.ms": "1000",
    "broker.session.timeout.ms": "6000",
}


def check_broker_count(brokers: int) -> None:
    """Raise ``StackError`` unless ``brokers`` is a count a stack can run (``BROKER_COUNTS``)."""
    if brokers not in BROKER_COUNTS:
        raise StackError(f"a stack runs 1 broker or a 3-broker cluster, not {brokers}")


_LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_SERVICE_PORT = 10_000


def ephemeral_ports() -> range | None:
    """The ports the kernel gives outgoing connections (Linux), None when unknown."""
    try:
        low, high = (int(part) for part in _LOCAL_PORT_RANGE.read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, below the kernel's ephemeral range when it can be.

    A service of the stack listens on its port again after a restart (a killed broker or Redis): a
    port from the ephemeral range may meanwhile be the local port of an outgoing connection (the
    clients reconnecting to it make many), and the restart then fails with "address in use".
    """
    ephemeral = ephemeral_ports()
    if ephemeral is not None and ephemeral.start > _LOWEST_SERVICE_PORT:
        for _ in range(200):
            port = random.randrange(_LOWEST_SERVICE_PORT, ephemeral.start)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Endpoints:
    """Where a running stack answers, and how to talk to it.

    ``redis_url`` may carry a password; ``kafka_config_file`` names a properties file of the Kafka
    client settings besides ``bootstrap.servers`` (TLS, SASL), empty for a plain broker;
    ``spark_master`` is the master URL of a Spark standalone cluster (``spark://host:port``), empty
    when none runs. ``repr`` masks the password.
    """

    bootstrap: str
    redis_url: str
    kafka_config_file: str = ""
    spark_master: str = ""

    def __repr__(self) -> str:
        return (f"Endpoints(bootstrap={self.bootstrap!r}, redis_url={mask_url(self.redis_url)!r}, "
                f"kafka_config_file={self.kafka_config_file!r}, spark_master={self.spark_master!r})")

    def kafka_config(self) -> dict[str, Any]:
        """A confluent-kafka config for this stack: ``bootstrap.servers`` plus the file's settings."""
        settings = read_kafka_properties(Path(self.kafka_config_file)) if self.kafka_config_file else {}
        return {**settings, "bootstrap.servers": self.bootstrap}

    def env_lines(self) -> list[str]:
        """Shell ``export`` lines naming this stack for the CLI, tests and benchmarks (the Redis URL
        with its password: the lines are what a client needs)."""
        lines = [
            f"export ORDERING_LAYER_BOOTSTRAP={shlex.quote(self.bootstrap)}",
            f"export ORDERING_LAYER_REDIS_URL={shlex.quote(self.redis_url)}",
        ]
        if self.kafka_config_file:
            lines.append(f"export ORDERING_LAYER_KAFKA_CONFIG={shlex.quote(self.kafka_config_file)}")
        if self.spark_master:
            lines.append(f"export ORDERING_LAYER_SPARK_MASTER={shlex.quote(self.spark_master)}")
        return lines


class StackBackend(ABC):
    """A Kafka + Redis pair that can be started, stopped and partly restarted."""

    @abstractmethod
    def up(self, brokers: int | None = None) -> Endpoints:
        """Start Kafka and Redis (harmless when they run already) and wait until they answer.

        Args:
            brokers: 1 (a single node) or 3 (a replicated cluster); default: what runs already, else 1.

        Raises:
            StackError: a service did not come up, or a stack of another broker count runs here.
        """

    @abstractmethod
    def down(self) -> None:
        """Stop both services and drop their data."""

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """A description of each service: running or not, address, process or container id."""

    @abstractmethod
    def endpoints(self) -> Endpoints:
        """The addresses of the running stack. Raises ``StackError`` when it is not up."""

    @abstractmethod
    def stop_broker(self, *, node: int | None = None, kill: bool = False) -> None:
        """Stop broker ``node`` (1-based; default: every broker), SIGKILL when ``kill``, keeping its data.

        Raises:
            StackError: no stack runs, or it has no broker ``node``.
        """

    @abstractmethod
    def start_broker(self, *, node: int | None = None) -> None:
        """Start broker ``node`` (default: every stopped broker) again with its id, address and data,
        and wait until it answers.

        Raises:
            StackError: no stack runs, it has no broker ``node``, or the broker did not come up.
        """

    @abstractmethod
    def stop_redis(self, *, kill: bool = False) -> None:
        """Stop Redis (SIGKILL when ``kill``), keeping its append-only file."""

    @abstractmethod
    def start_redis(self) -> None:
        """Start Redis again on the same address and wait until it answers PING."""

    def redis_node_count(self) -> int:
        """How many Redis servers run (the masters of a Redis Cluster, else 1)."""
        return 1

    def stop_redis_node(self, index: int, *, kill: bool = False) -> None:
        """Stop one Redis server (a cluster master) keeping its data. Raises ``StackError`` when
        the backend runs no Redis Cluster."""
        raise StackError(f"{type(self).__name__} runs no Redis Cluster")

    def start_redis_node(self, index: int) -> None:
        """Start one Redis server again and wait until the cluster serves every slot."""
        raise StackError(f"{type(self).__name__} runs no Redis Cluster")

    def start_spark(self) -> str:
        """Start a Spark standalone master and worker beside Kafka and Redis (harmless when they run);
        return the master URL, which ``endpoints().spark_master`` gives from then on.

        Raises:
            StackError: the backend runs no Spark, no stack runs, or Spark did not come up.
        """
        raise StackError(f"{type(self).__name__} runs no Spark cluster: use the local backend")

    def stop_spark(self) -> None:
        """Stop the Spark master and worker started by ``start_spark`` (``down`` stops them too)."""
        raise StackError(f"{type(self).__name__} runs no Spark cluster: use the local backend")


class FolderStateBackend(StackBackend, ABC):
    """A backend that keeps its state (ports, process or container ids) in ``state_dir/state.json``,
    so that ``down``, ``status`` and ``env`` of a later CLI call find what ``up`` started."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._state_file = state_dir / "state.json"

    # -- state -----------------------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        if not self._state_file.exists():
            return {}
        loaded: dict[str, Any] = json.loads(self._state_file.read_text())
        return loaded

    def _save(self, state: dict[str, Any]) -> None:
        # Owner-only: a secured stack keeps its generated passwords here.
        write_private(self._state_file, json.dumps(state, indent=2))

    def _state_or_fail(self) -> dict[str, Any]:
        state = self._load()
        if not state:
            raise StackError(f"no stack in {self.state_dir}: run 'ordering-layer stack up'")
        return state
