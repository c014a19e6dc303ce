"""Local backend: a single-node KRaft Apache Kafka (Maven Central jars) and Debian's redis-server.

Both run as child processes in their own session on 127.0.0.1 and free ports. Everything lives in
one state folder (``state.json``, configs, data, logs), so ``down``, ``status`` and ``env`` of a
later CLI call find a stack that an earlier one started.
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
from ordering_layer.stack.base import BROKER_SETTINGS, Endpoints, FolderStateBackend, free_port
from ordering_layer.stack.jars import cache_dir, kafka_jars

_LOGGER = logging.getLogger(__name__)

_BROKER_HEAP = "-Xmx512m"
_START_TIMEOUT = 90.0
_STOP_TIMEOUT = 30.0

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
    """Kafka + Redis as local processes, state kept in ``state_dir``."""

    def __init__(self, state_dir: Path | None = None) -> None:
        super().__init__(Path(state_dir) if state_dir else default_state_dir())

    # -- public ----------------------------------------------------------------------------------
    def up(self) -> Endpoints:
        """Start Redis and Kafka unless they run already; return their addresses.

        Raises:
            StackError: java, redis-server or Maven is missing, or a service did not come up.
        """
        state = self._load()
        if not state:
            state = {
                "kafka_port": free_port(),
                "controller_port": free_port(),
                "redis_port": free_port(),
                "cluster_id": base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="),
            }
            self._save(state)
        if not _alive(state.get("redis_pid")):
            self.start_redis()
        if not _alive(self._load().get("kafka_pid")):
            self.start_broker()
        return self.endpoints()

    def down(self) -> None:
        """Stop both services and remove the state folder (data included)."""
        if self._load():
            self.stop_broker()
            self.stop_redis()
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def endpoints(self) -> Endpoints:
        state = self._state_or_fail()
        return Endpoints(
            bootstrap=f"127.0.0.1:{state['kafka_port']}",
            redis_url=f"redis://127.0.0.1:{state['redis_port']}/0",
        )

    def status(self) -> dict[str, Any]:
        state = self._load()
        if not state:
            return {"backend": "local", "state_dir": str(self.state_dir), "up": False}
        kafka_up = _alive(state.get("kafka_pid"))
        redis_up = _alive(state.get("redis_pid"))
        endpoints = self.endpoints()
        return {
            "backend": "local",
            "state_dir": str(self.state_dir),
            "up": kafka_up and redis_up,
            "kafka": {"running": kafka_up, "pid": state.get("kafka_pid"), "bootstrap": endpoints.bootstrap},
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
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                 "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                 "--daemonize", "no", "--protected-mode", "no"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        state["redis_pid"] = proc.pid
        self._save(state)
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0)
        try:
            _wait(lambda: client.ping(), "redis-server", proc.pid, log)
        finally:
            client.close()

    def stop_redis(self, *, kill: bool = False) -> None:
        self._stop("redis_pid", kill=kill)

    # -- Kafka -----------------------------------------------------------------------------------
    def _broker_config(self, state: dict[str, Any]) -> Path:
        port, cport = state["kafka_port"], state["controller_port"]
        data = self.state_dir / "kafka-logs"
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{cport}",
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(data),
            **BROKER_SETTINGS,
        }
        config = self.state_dir / "server.properties"
        config.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (self.state_dir / "log4j2.properties").write_text(_LOG4J2)
        return config

    def _java(self) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise StackError("java not found: Kafka 4 needs Java 17 (apt-get install -y openjdk-17-jre-headless)")
        return [java, _BROKER_HEAP, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.state_dir / 'log4j2.properties'}",
                "-cp", f"{kafka_jars()}/*"]

    def start_broker(self) -> None:
        state = self._state_or_fail()
        if _alive(state.get("kafka_pid")):
            return
        config = self._broker_config(state)
        java = self._java()
        log = self.state_dir / "kafka.log"
        if not (self.state_dir / "kafka-logs" / "meta.properties").exists():
            result = subprocess.run(
                [*java, "kafka.tools.StorageTool", "format", "-t", state["cluster_id"],
                 "-c", str(config), "--standalone"],
                capture_output=True, text=True, check=False,
            )
            if result.returncode != 0:
                raise StackError(f"formatting Kafka storage failed:\n{result.stdout}{result.stderr}")
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [*java, "kafka.Kafka", str(config)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        state["kafka_pid"] = proc.pid
        self._save(state)
        admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{state['kafka_port']}",
                             "logger": logging.getLogger("ordering_layer.kafka.client")})  # type: ignore[dict-item]

        def answers() -> bool:
            metadata = admin.list_topics(timeout=2)
            return bool(metadata.brokers) and metadata.controller_id >= 0

        _wait(answers, "Kafka broker", proc.pid, log)

    def stop_broker(self, *, kill: bool = False) -> None:
        self._stop("kafka_pid", kill=kill)

    # -- shared ----------------------------------------------------------------------------------
    def _stop(self, field: str, *, kill: bool) -> None:
        state = self._load()
        pid = state.get(field)
        if _alive(pid):
            assert pid is not None
            os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
            deadline = time.monotonic() + _STOP_TIMEOUT
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
                while _alive(pid):
                    time.sleep(0.05)
            _reap(pid)
        if state:
            state[field] = None
            self._save(state)


def _reap(pid: int) -> None:
    """Collect the exit status when the process is our child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
