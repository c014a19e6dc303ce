"""Local backend: KRaft Apache Kafka (Maven Central jars) and Debian's redis-server.

Kafka runs as one combined broker + controller node, or as three such nodes forming a three-voter
controller quorum (``up(brokers=3)``) whose topics keep three replicas. Every process is a child in
its own session on 127.0.0.1 and free ports. Everything lives in one state folder (``state.json``,
``broker-<node>/`` with each broker's config, data and log, Redis' data and log), so ``down``,
``status``, ``env`` and ``kill-broker`` of a later CLI call find a stack that an earlier one started.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import redis
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
from ordering_layer.stack.jars import cache_dir, kafka_jars

_LOGGER = logging.getLogger(__name__)

_BROKER_HEAP = "-Xmx512m"
_CLUSTER_BROKER_HEAP = "-Xmx384m"
_START_TIMEOUT = 90.0
# Three JVMs starting (or one catching up) on two busy cores take longer than one alone.
_CLUSTER_START_TIMEOUT = 180.0
_STOP_TIMEOUT = 30.0
_HOST = "127.0.0.1"

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


def new_state(brokers: int) -> dict[str, Any]:
    """The state of a stack not started yet: cluster id, Redis port, and per broker its node id,
    client and controller ports and storage directory id (all kept across restarts).

    Raises:
        StackError: ``brokers`` is not a count a stack runs.
    """
    check_broker_count(brokers)
    ports: list[int] = []
    while len(ports) < 2 * brokers + 1:
        port = free_port()
        if port not in ports:
            ports.append(port)
    nodes = [{"node": n, "port": ports[2 * n - 2], "controller_port": ports[2 * n - 1],
              "directory_id": kafka_uuid(), "pid": None} for n in range(1, brokers + 1)]
    return {"brokers": brokers, "cluster_id": kafka_uuid(), "redis_port": ports[-1], "redis_pid": None,
            "nodes": nodes}


def broker_properties(state: dict[str, Any], node: dict[str, Any], data: Path) -> dict[str, str]:
    """``server.properties`` of one combined broker + controller node of the stack in ``state``."""
    nodes = state["nodes"]
    listeners = f"PLAINTEXT://{_HOST}:{node['port']},CONTROLLER://{_HOST}:{node['controller_port']}"
    return {
        "process.roles": "broker,controller",
        "node.id": str(node["node"]),
        "controller.quorum.bootstrap.servers": ",".join(f"{_HOST}:{n['controller_port']}" for n in nodes),
        "listeners": listeners,
        "advertised.listeners": listeners,
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(data),
        **BROKER_SETTINGS,
        **(CLUSTER_SETTINGS if len(nodes) > 1 else {}),
    }


def quorum_arguments(state: dict[str, Any]) -> list[str]:
    """The storage tool's quorum arguments: a single-node dynamic quorum, or the same three initial
    voters (node id, controller address, storage directory id) on every node of a cluster."""
    nodes = state["nodes"]
    if len(nodes) == 1:
        return ["--standalone"]
    voters = ",".join(f"{n['node']}@{_HOST}:{n['controller_port']}:{n['directory_id']}" for n in nodes)
    return ["--initial-controllers", voters]


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return True


def _wait(check: Any, what: str, pid: int, log: Path, timeout: float = _START_TIMEOUT) -> None:
    """Poll ``check()`` until it is true; fail early when the process died, naming its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise StackError(f"{what} exited during start; last lines of {log}:\n{tail}")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not answering yet is the expected state here
            pass
        time.sleep(0.2)
    raise StackError(f"{what} did not answer within {timeout:.0f} s; see {log}")


class LocalStack(FolderStateBackend):
    """Kafka (one node or a three-node cluster) + Redis as local processes, state kept in ``state_dir``."""

    def __init__(self, state_dir: Path | None = None) -> None:
        super().__init__(Path(state_dir) if state_dir else default_state_dir())

    def _load(self) -> dict[str, Any]:
        state = super()._load()
        if state and "nodes" not in state:
            raise StackError(f"{self._state_file} has no broker list (written by an older ordering-layer): "
                             f"stop the processes it names and remove {self.state_dir}")
        return state

    # -- public ----------------------------------------------------------------------------------
    def up(self, brokers: int | None = None) -> Endpoints:
        """Start Redis and Kafka unless they run already; return their addresses.

        Args:
            brokers: 1 or 3; default: the count of the stack in the state folder, else 1.

        Raises:
            StackError: java, redis-server or Maven is missing, a service did not come up, or the
                state folder holds a stack of another broker count.
        """
        state = self._load()
        if not state:
            state = new_state(brokers or 1)
            self._save(state)
        elif brokers is not None and brokers != state["brokers"]:
            raise StackError(f"{self.state_dir} holds a stack of {state['brokers']} broker(s), not {brokers}: "
                             "run 'ordering-layer stack down' first")
        if not _alive(state.get("redis_pid")):
            self.start_redis()
        self.start_broker()
        return self.endpoints()

    def down(self) -> None:
        """Stop every service and remove the state folder (data included)."""
        if self._load():
            # The data goes next, so a controlled shutdown (slow once the quorum loses its majority)
            # protects nothing.
            self.stop_broker(kill=True)
            self.stop_redis()
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def endpoints(self) -> Endpoints:
        state = self._state_or_fail()
        return Endpoints(
            bootstrap=",".join(f"{_HOST}:{n['port']}" for n in state["nodes"]),
            redis_url=f"redis://{_HOST}:{state['redis_port']}/0",
        )

    def status(self) -> dict[str, Any]:
        state = self._load()
        if not state:
            return {"backend": "local", "state_dir": str(self.state_dir), "up": False}
        brokers = [{"node": n["node"], "running": _alive(n.get("pid")), "pid": n.get("pid"),
                    "address": f"{_HOST}:{n['port']}"} for n in state["nodes"]]
        kafka_up = all(broker["running"] for broker in brokers)
        redis_up = _alive(state.get("redis_pid"))
        endpoints = self.endpoints()
        return {
            "backend": "local",
            "state_dir": str(self.state_dir),
            "up": kafka_up and redis_up,
            "kafka": {"running": kafka_up, "bootstrap": endpoints.bootstrap, "brokers": brokers},
            "redis": {"running": redis_up, "pid": state.get("redis_pid"), "url": endpoints.redis_url},
        }

    # -- Redis -----------------------------------------------------------------------------------
    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise StackError("redis-server not found: apt-get install -y redis-server (or run 'make setup')")
        state = self._state_or_fail()
        if _alive(state.get("redis_pid")):
            return
        data = self.state_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        log = self.state_dir / "redis.log"
        port = int(state["redis_port"])
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", _HOST, "--dir", str(data),
                 "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                 "--daemonize", "no", "--protected-mode", "no"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        state["redis_pid"] = proc.pid
        self._save(state)
        client = redis.Redis(host=_HOST, port=port, socket_timeout=1.0)
        try:
            _wait(lambda: client.ping(), "redis-server", proc.pid, log)
        finally:
            client.close()

    def stop_redis(self, *, kill: bool = False) -> None:
        state = self._load()
        if state:
            _terminate([state.get("redis_pid")], kill=kill)
            state["redis_pid"] = None
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

    def _java(self, state: dict[str, Any]) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise StackError("java not found: Kafka 4 needs Java 17 (apt-get install -y openjdk-17-jre-headless)")
        heap = _BROKER_HEAP if state["brokers"] == 1 else _CLUSTER_BROKER_HEAP
        return [java, heap, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.state_dir / 'log4j2.properties'}",
                "-cp", f"{kafka_jars()}/*"]

    def _spawn(self, state: dict[str, Any], entry: dict[str, Any]) -> bool:
        """Start one broker process unless it runs; format its storage on the first start."""
        if _alive(entry.get("pid")):
            return False
        folder = self._broker_dir(entry["node"])
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / "data"
        config = folder / "server.properties"
        config.write_text("".join(f"{k}={v}\n" for k, v in broker_properties(state, entry, data).items()))
        (self.state_dir / "log4j2.properties").write_text(_LOG4J2)
        java = self._java(state)
        if not (data / "meta.properties").exists():
            result = subprocess.run(
                [*java, "kafka.tools.StorageTool", "format", "-t", state["cluster_id"], "-c", str(config),
                 *quorum_arguments(state)],
                capture_output=True, text=True, check=False,
            )
            if result.returncode != 0:
                raise StackError(f"formatting Kafka storage of broker {entry['node']} failed:\n"
                                 f"{result.stdout}{result.stderr}")
        with open(folder / "kafka.log", "ab") as out:
            proc = subprocess.Popen(
                [*java, "kafka.Kafka", str(config)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        entry["pid"] = proc.pid
        self._save(state)
        return True

    def _await_broker(self, state: dict[str, Any], entry: dict[str, Any]) -> None:
        """Wait until the broker lists itself as alive (registered and unfenced) with a controller."""
        admin = AdminClient({"bootstrap.servers": f"{_HOST}:{entry['port']}",
                             "logger": logging.getLogger("ordering_layer.kafka.client")})  # type: ignore[dict-item]

        def answers() -> bool:
            metadata = admin.list_topics(timeout=2)
            return entry["node"] in metadata.brokers and metadata.controller_id >= 0

        single = state["brokers"] == 1
        _wait(answers, "Kafka broker" if single else f"Kafka broker {entry['node']}", entry["pid"],
              self._broker_dir(entry["node"]) / "kafka.log", _START_TIMEOUT if single else _CLUSTER_START_TIMEOUT)


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
    live = [pid for pid in pids if pid is not None and _alive(pid)]
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT
    for pid in live:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)
        _reap(pid)


def _reap(pid: int) -> None:
    """Collect the exit status when the process is our child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
