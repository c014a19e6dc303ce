"""Local backend: KRaft Apache Kafka (Maven Central jars) and Debian's redis-server.

Kafka runs as one combined broker + controller node, or as three such nodes forming a three-voter
controller quorum (``up(brokers=3)``) whose topics keep three replicas. Every process is a child in
its own session on 127.0.0.1 and free ports. Everything lives in one state folder (``state.json``,
``broker-<node>/`` with each broker's config, data and log, ``redis/`` with each Redis server's), so
``down``, ``status``, ``env`` and ``kill-broker`` of a later CLI call find a stack that an earlier
one started.

Two variants, chosen when the stack is first started and kept in its state:

- ``redis_cluster``: Redis is a Redis Cluster of three masters (``redis+cluster://`` URL).
- ``secure`` (one broker only): a CA and a server certificate are made for 127.0.0.1/localhost; the
  broker's client listener is SASL_SSL with SCRAM-SHA-512 (users created when the storage is
  formatted), Redis speaks TLS only and admits one ACL user with a password. The controller listener
  stays plaintext on the loopback interface (KRaft cannot authenticate it with SCRAM). Clients find
  their settings in ``client.properties`` and the ``rediss://`` URL (``ordering-layer stack env``).

On request (``start_spark``, ``stack up --spark-cluster``) a Spark standalone master and worker run
beside them from the installed pyspark (``SparkCluster``, in ``spark/``); ``up`` starts them again
while the state says so, ``stop_spark`` and ``down`` stop them.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from ordering_layer.errors import StackError
from ordering_layer.stack.base import (
    BROKER_SETTINGS,
    CLUSTER_SETTINGS,
    Endpoints,
    FolderStateBackend,
    check_broker_count,
    free_port,
)
from ordering_layer.stack.certs import TlsFiles, make_certificates
from ordering_layer.stack.jars import cache_dir, kafka_jars
from ordering_layer.stack.processes import START_TIMEOUT, alive, spawn, wait_until, write_private
from ordering_layer.stack.redis_nodes import RedisAccess, RedisNodes
from ordering_layer.stack.spark_cluster import SparkCluster
from ordering_layer.state.client import mask_url

_LOGGER = logging.getLogger(__name__)

_BROKER_HEAP = "-Xmx512m"
_CLUSTER_BROKER_HEAP = "-Xmx384m"
# Three JVMs starting (or one catching up) on two busy cores take longer than one alone.
_CLUSTER_START_TIMEOUT = 180.0
_STOP_TIMEOUT = 30.0
_HOST = "127.0.0.1"
_CLUSTER_MASTERS = 3
_SCRAM = "SCRAM-SHA-512"
_KAFKA_BROKER_USER = "ol-broker"
_KAFKA_CLIENT_USER = "ol-client"
_REDIS_USER = "ol"

_LOG4J2 = """\
status = error
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def default_state_dir() -> Path:
    """``$ORDERING_LAYER_STACK_DIR`` or ``<cache>/stack``: where the CLI's stack keeps its state."""
    configured = os.environ.get("ORDERING_LAYER_STACK_DIR")
    return Path(configured) if configured else cache_dir() / "stack"


def kafka_uuid() -> str:
    """A random id in Kafka's text form (22 characters of URL-safe base64) for cluster and directory
    ids; never starting with '-', which the storage tool would take for an option."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def new_state(brokers: int, *, redis_cluster: bool = False, secure: bool = False) -> dict[str, Any]:
    """The state of a stack not started yet: cluster id, the Redis port (of a single server; a
    cluster's masters take theirs when first started), the variant, generated secrets of a secured
    stack, and per broker its node id, client and controller ports and storage directory id (all
    kept across restarts).

    Raises:
        StackError: ``brokers`` is not a count a stack runs, or a secured stack of several brokers.
    """
    check_broker_count(brokers)
    if secure and brokers > 1:
        raise StackError("a secured stack runs one broker: use --secure without --brokers 3")
    ports: list[int] = []
    while len(ports) < 2 * brokers + 1:
        port = free_port()
        if port not in ports:
            ports.append(port)
    nodes = [{"node": n, "port": ports[2 * n - 2], "controller_port": ports[2 * n - 1],
              "directory_id": kafka_uuid(), "pid": None} for n in range(1, brokers + 1)]
    state: dict[str, Any] = {"brokers": brokers, "cluster_id": kafka_uuid(), "redis_port": ports[-1],
                             "redis_cluster": redis_cluster, "secure": secure, "nodes": nodes}
    if secure:
        state["secrets"] = {name: secrets.token_urlsafe(18)
                            for name in ("kafka_broker", "kafka_client", "redis", "keystore")}
    return state


def broker_properties(state: dict[str, Any], node: dict[str, Any], data: Path,
                      tls: TlsFiles | None = None) -> dict[str, str]:
    """``server.properties`` of one combined broker + controller node of the stack in ``state``;
    with ``tls`` (a secured stack) its client and inter-broker listener is SASL_SSL."""
    nodes = state["nodes"]
    name = "SASL_SSL" if tls else "PLAINTEXT"
    listeners = f"{name}://{_HOST}:{node['port']},CONTROLLER://{_HOST}:{node['controller_port']}"
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node["node"]),
        "controller.quorum.bootstrap.servers": ",".join(f"{_HOST}:{n['controller_port']}" for n in nodes),
        "listeners": listeners,
        "advertised.listeners": listeners,
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": name,
        "listener.security.protocol.map": f"CONTROLLER:PLAINTEXT,{name}:{name}",
        "log.dirs": str(data),
        **BROKER_SETTINGS,
        **(CLUSTER_SETTINGS if len(nodes) > 1 else {}),
    }
    if tls is None:
        return props
    keystore_password = state["secrets"]["keystore"]
    jaas = (f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{_KAFKA_BROKER_USER}" '
            f'password="{state["secrets"]["kafka_broker"]}";')
    return {**props,
            "sasl.enabled.mechanisms": _SCRAM,
            "sasl.mechanism.inter.broker.protocol": _SCRAM,
            f"listener.name.sasl_ssl.{_SCRAM.lower()}.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(tls.keystore),
            "ssl.keystore.password": keystore_password,
            "ssl.key.password": keystore_password,
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(tls.ca)}


def quorum_arguments(state: dict[str, Any]) -> list[str]:
    """The storage tool's quorum arguments: a single-node dynamic quorum, or the same three initial
    voters (node id, controller address, storage directory id) on every node of a cluster."""
    nodes = state["nodes"]
    if len(nodes) == 1:
        return ["--standalone"]
    voters = ",".join(f"{n['node']}@{_HOST}:{n['controller_port']}:{n['directory_id']}" for n in nodes)
    return ["--initial-controllers", voters]


class LocalStack(FolderStateBackend):
    """Kafka (one node or a three-node cluster) + Redis as local processes, state kept in ``state_dir``.

    Args:
        state_dir: the state folder (default ``default_state_dir()``).
        redis_cluster: run Redis as a three-master Redis Cluster. None: as the running stack was
            started, else ``$ORDERING_LAYER_REDIS_CLUSTER`` (``1`` for yes), else no.
        secure: TLS and authentication on Kafka and Redis (one broker only). None: as the running
            stack was started, else ``$ORDERING_LAYER_SECURE``, else no.
    """

    def __init__(self, state_dir: Path | None = None, *, redis_cluster: bool | None = None,
                 secure: bool | None = None) -> None:
        super().__init__(Path(state_dir) if state_dir else default_state_dir())
        self._requested = {"redis_cluster": redis_cluster, "secure": secure}

    def _load(self) -> dict[str, Any]:
        state = super()._load()
        if state and "nodes" not in state:
            raise StackError(f"{self._state_file} has no broker list (written by an older ordering-layer): "
                             f"stop the processes it names and remove {self.state_dir}")
        return state

    # -- variant and secrets ---------------------------------------------------------------------
    def _variant(self) -> dict[str, bool]:
        return {name: bool(int(os.environ.get(f"ORDERING_LAYER_{name.upper()}", "0") or "0"))
                if requested is None else requested for name, requested in self._requested.items()}

    def _check_variant(self, state: dict[str, Any]) -> None:
        for name, requested in self._requested.items():
            if requested is not None and requested != bool(state.get(name)):
                raise StackError(f"the stack in {self.state_dir} runs with {name}={bool(state.get(name))}; "
                                 "stop it first ('ordering-layer stack down')")

    def _tls(self, state: dict[str, Any]) -> TlsFiles | None:
        if not state.get("secure"):
            return None
        return make_certificates(self.state_dir / "tls", state["secrets"]["keystore"])

    def _redis(self, state: dict[str, Any] | None = None) -> RedisNodes:
        state = state or self._state_or_fail()
        tls = self._tls(state)
        access = RedisAccess(tls, _REDIS_USER, state["secrets"]["redis"]) if tls else RedisAccess()
        if state.get("redis_cluster"):
            return RedisNodes(self.state_dir / "redis", count=_CLUSTER_MASTERS, cluster=True, access=access)
        return RedisNodes(self.state_dir / "redis", access=access, ports=[int(state["redis_port"])])

    # -- public ----------------------------------------------------------------------------------
    def up(self, brokers: int | None = None) -> Endpoints:
        """Start Redis and Kafka unless they run already; return their addresses.

        Args:
            brokers: 1 or 3; default: the count of the stack in the state folder, else 1.

        Raises:
            StackError: java, redis-server or Maven is missing, a service did not come up, the
                state folder holds a stack of another broker count or variant, or a secured stack
                of three brokers was asked for.
        """
        state = self._load()
        if not state:
            state = new_state(brokers or 1, **self._variant())
            self._save(state)
        elif brokers is not None and brokers != state["brokers"]:
            raise StackError(f"{self.state_dir} holds a stack of {state['brokers']} broker(s), not {brokers}: "
                             "run 'ordering-layer stack down' first")
        self._check_variant(state)
        self._redis(state).up()
        self.start_broker()
        if state.get("spark"):
            self._spark().up()
        return self.endpoints()

    def down(self) -> None:
        """Stop every service and remove the state folder (data included)."""
        if self._load():
            # The data goes next, so a controlled shutdown (slow once the quorum loses its majority)
            # protects nothing.
            self.stop_broker(kill=True)
            self.stop_redis(kill=True)
            self._spark().stop(kill=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def endpoints(self) -> Endpoints:
        state = self._state_or_fail()
        return Endpoints(
            bootstrap=",".join(f"{_HOST}:{n['port']}" for n in state["nodes"]),
            redis_url=self._redis(state).url(),
            kafka_config_file=str(self._client_properties(state)) if state.get("secure") else "",
            spark_master=self._spark().master_url() if state.get("spark") else "",
        )

    def status(self) -> dict[str, Any]:
        state = self._load()
        if not state:
            return {"backend": "local", "state_dir": str(self.state_dir), "up": False}
        brokers = [{"node": n["node"], "running": alive(n.get("pid")), "pid": n.get("pid"),
                    "address": f"{_HOST}:{n['port']}"} for n in state["nodes"]]
        kafka_up = all(broker["running"] for broker in brokers)
        redis = self._redis(state)
        redis_up = all(redis.running())
        endpoints = self.endpoints()
        spark = self._spark().status() if state.get("spark") else None
        return {
            "backend": "local",
            "state_dir": str(self.state_dir),
            "up": kafka_up and redis_up and (spark is None or spark["running"]),
            "secure": bool(state.get("secure")),
            "redis_cluster": bool(state.get("redis_cluster")),
            "kafka": {"running": kafka_up, "bootstrap": endpoints.bootstrap, "brokers": brokers,
                      "config_file": endpoints.kafka_config_file or None},
            "redis": {"running": redis_up, "pid": redis.pids()[0], "pids": redis.pids(),
                      "url": mask_url(endpoints.redis_url)},
            **({"spark": spark} if spark else {}),
        }

    # -- Redis -----------------------------------------------------------------------------------
    def start_redis(self) -> None:
        self._redis().up()

    def stop_redis(self, *, kill: bool = False) -> None:
        self._redis().stop(kill=kill)

    def redis_node_count(self) -> int:
        return self._redis().count

    def stop_redis_node(self, index: int, *, kill: bool = False) -> None:
        redis = self._redis()
        if not redis.cluster:
            super().stop_redis_node(index, kill=kill)
        redis.stop_node(index, kill=kill)

    def start_redis_node(self, index: int) -> None:
        redis = self._redis()
        if not redis.cluster:
            super().start_redis_node(index)
        redis.start_node(index)
        redis.wait_cluster_ok()

    def redis_nodes(self) -> RedisNodes:
        """The Redis servers of this stack (for tests that look at single nodes)."""
        return self._redis()

    # -- Spark -----------------------------------------------------------------------------------
    def _spark(self) -> SparkCluster:
        return SparkCluster(self.state_dir / "spark")

    def start_spark(self) -> str:
        state = self._state_or_fail()
        state["spark"] = True
        self._save(state)
        return self._spark().up()

    def stop_spark(self) -> None:
        state = self._state_or_fail()
        self._spark().stop()
        state["spark"] = False
        self._save(state)

    # -- Kafka -----------------------------------------------------------------------------------
    def start_broker(self, *, node: int | None = None) -> None:
        state = self._state_or_fail()
        # Every node starts before any is awaited: a cluster node answers only once a quorum runs.
        started = [entry for entry in _select(state, node) if self._spawn(state, entry)]
        for entry in started:
            self._await_broker(state, entry)

    def stop_broker(self, *, node: int | None = None, kill: bool = False) -> None:
        state = self._state_or_fail()
        entries = _select(state, node)
        _terminate([entry.get("pid") for entry in entries], kill=kill)
        for entry in entries:
            entry["pid"] = None
        self._save(state)

    def _broker_dir(self, node: int) -> Path:
        return self.state_dir / f"broker-{node}"

    def _client_properties(self, state: dict[str, Any]) -> Path:
        """The client settings file of a secured stack (written on first use)."""
        path = self.state_dir / "client.properties"
        if not path.exists():
            tls = self._tls(state)
            assert tls is not None
            settings = {"security.protocol": "SASL_SSL", "sasl.mechanism": _SCRAM,
                        "sasl.username": _KAFKA_CLIENT_USER, "sasl.password": state["secrets"]["kafka_client"],
                        "ssl.ca.location": str(tls.ca)}
            write_private(path, "".join(f"{k}={v}\n" for k, v in settings.items()))
        return path

    def _java(self, state: dict[str, Any]) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise StackError("java not found: Kafka 4 needs Java 17 (apt-get install -y openjdk-17-jre-headless)")
        heap = _BROKER_HEAP if state["brokers"] == 1 else _CLUSTER_BROKER_HEAP
        return [java, heap, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.state_dir / 'log4j2.properties'}",
                "-cp", f"{kafka_jars()}/*"]

    def _format_storage(self, state: dict[str, Any], entry: dict[str, Any], config: Path) -> None:
        # "--cluster-id=": a base64 id may start with "-", which argparse would take for an option.
        command = [*self._java(state), "kafka.tools.StorageTool", "format", f"--cluster-id={state['cluster_id']}",
                   "-c", str(config), *quorum_arguments(state)]
        hidden: list[str] = []
        if state.get("secure"):
            for user, secret in ((_KAFKA_BROKER_USER, "kafka_broker"), (_KAFKA_CLIENT_USER, "kafka_client")):
                password = state["secrets"][secret]
                hidden.append(password)
                command += ["--add-scram", f"{_SCRAM}=[name={user},password={password}]"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            output = result.stdout + result.stderr
            for password in hidden:
                output = output.replace(password, "***")
            raise StackError(f"formatting Kafka storage of broker {entry['node']} failed:\n{output}")

    def _spawn(self, state: dict[str, Any], entry: dict[str, Any]) -> bool:
        """Start one broker process unless it runs; format its storage on the first start."""
        if alive(entry.get("pid")):
            return False
        folder = self._broker_dir(entry["node"])
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / "data"
        config = folder / "server.properties"
        props = broker_properties(state, entry, data, self._tls(state))
        # Owner-only: a secured broker's config holds its passwords.
        write_private(config, "".join(f"{k}={v}\n" for k, v in props.items()))
        (self.state_dir / "log4j2.properties").write_text(_LOG4J2)
        if not (data / "meta.properties").exists():
            self._format_storage(state, entry, config)
        entry["pid"] = spawn([*self._java(state), "kafka.Kafka", str(config)], folder / "kafka.log")
        self._save(state)
        return True

    def _await_broker(self, state: dict[str, Any], entry: dict[str, Any]) -> None:
        """Wait until the broker lists itself as alive (registered and unfenced) with a controller."""
        settings = self.endpoints().kafka_config()
        admin = AdminClient({**settings, "bootstrap.servers": f"{_HOST}:{entry['port']}",
                             "logger": logging.getLogger("ordering_layer.kafka.client")})  # type: ignore[dict-item]

        def answers() -> bool:
            metadata = admin.list_topics(timeout=2)
            return entry["node"] in metadata.brokers and metadata.controller_id >= 0

        single = state["brokers"] == 1
        wait_until(answers, "Kafka broker" if single else f"Kafka broker {entry['node']}", entry["pid"],
                   self._broker_dir(entry["node"]) / "kafka.log", START_TIMEOUT if single else _CLUSTER_START_TIMEOUT)


def _select(state: dict[str, Any], node: int | None) -> list[dict[str, Any]]:
    """The state entries of broker ``node``, or of every broker when ``node`` is None."""
    nodes: list[dict[str, Any]] = state["nodes"]
    if node is None:
        return nodes
    if not 1 <= node <= len(nodes):
        raise StackError(f"no broker {node}: this stack has broker(s) 1..{len(nodes)}")
    return [nodes[node - 1]]


def _terminate(pids: list[int | None], *, kill: bool) -> None:
    """Signal every live process at once (SIGKILL when ``kill``), then wait for each; one that
    outlives ``_STOP_TIMEOUT`` is killed."""
    live = [pid for pid in pids if pid is not None and alive(pid)]
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT
    for pid in live:
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while alive(pid):
                time.sleep(0.05)
        # Collect the exit status when the process is our child, so it does not linger as a zombie.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
