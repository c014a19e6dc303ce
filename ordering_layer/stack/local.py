"""Local backend: a single-node KRaft Apache Kafka (Maven Central jars) and Debian's redis-server.

Both run as child processes in their own session on 127.0.0.1 and free ports. Everything lives in
one state folder (``state.json``, configs, data, logs), so ``down``, ``status`` and ``env`` of a
later CLI call find a stack that an earlier one started.

Two variants, chosen when the stack is first started and kept in its state:

- ``redis_cluster``: Redis is a Redis Cluster of three masters (``redis+cluster://`` URL).
- ``secure``: a CA and a server certificate are made for 127.0.0.1/localhost; the broker's client
  listener is SASL_SSL with SCRAM-SHA-512 (users created when the storage is formatted), Redis
  speaks TLS only and admits one ACL user with a password. The controller listener stays plaintext
  on the loopback interface (KRaft cannot authenticate it with SCRAM). Clients find their settings
  in ``client.properties`` and the ``rediss://`` URL (``ordering-layer stack env``).
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from ordering_layer.errors import StackError
from ordering_layer.stack.base import BROKER_SETTINGS, Endpoints, FolderStateBackend, free_port
from ordering_layer.stack.certs import TlsFiles, make_certificates
from ordering_layer.stack.jars import cache_dir, kafka_jars
from ordering_layer.stack.processes import alive, spawn, stop, wait_until, write_private
from ordering_layer.stack.redis_nodes import RedisAccess, RedisNodes
from ordering_layer.state.client import mask_url

_LOGGER = logging.getLogger(__name__)

_BROKER_HEAP = "-Xmx512m"
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


class LocalStack(FolderStateBackend):
    """Kafka + Redis as local processes, state kept in ``state_dir``.

    Args:
        state_dir: the state folder (default ``default_state_dir()``).
        redis_cluster: run Redis as a three-master Redis Cluster. None: as the running stack was
            started, else ``$ORDERING_LAYER_REDIS_CLUSTER`` (``1`` for yes), else no.
        secure: TLS and authentication on Kafka and Redis. None: as the running stack was started,
            else ``$ORDERING_LAYER_SECURE``, else no.
    """

    def __init__(self, state_dir: Path | None = None, *, redis_cluster: bool | None = None,
                 secure: bool | None = None) -> None:
        super().__init__(Path(state_dir) if state_dir else default_state_dir())
        self._requested = {"redis_cluster": redis_cluster, "secure": secure}

    # -- variant and secrets ---------------------------------------------------------------------
    def _new_state(self) -> dict[str, Any]:
        variant = {name: bool(int(os.environ.get(f"ORDERING_LAYER_{name.upper()}", "0") or "0"))
                   if requested is None else requested for name, requested in self._requested.items()}
        state: dict[str, Any] = {
            "kafka_port": free_port(),
            "controller_port": free_port(),
            "cluster_id": base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="),
            **variant,
        }
        if state["secure"]:
            state["secrets"] = {name: secrets.token_urlsafe(18)
                                for name in ("kafka_broker", "kafka_client", "redis", "keystore")}
        return state

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
        cluster = bool(state.get("redis_cluster"))
        return RedisNodes(self.state_dir / "redis", count=_CLUSTER_MASTERS if cluster else 1, cluster=cluster,
                          access=access)

    # -- public ----------------------------------------------------------------------------------
    def up(self) -> Endpoints:
        """Start Redis and Kafka unless they run already; return their addresses.

        Raises:
            StackError: java, redis-server or Maven is missing, a service did not come up, or the
                running stack is another variant than the one asked for.
        """
        state = self._load()
        if not state:
            state = self._new_state()
            self._save(state)
        self._check_variant(state)
        self._redis(state).up()
        if not alive(self._load().get("kafka_pid")):
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
            redis_url=self._redis(state).url(),
            kafka_config_file=str(self._client_properties(state)) if state.get("secure") else "",
        )

    def status(self) -> dict[str, Any]:
        state = self._load()
        if not state:
            return {"backend": "local", "state_dir": str(self.state_dir), "up": False}
        kafka_up = alive(state.get("kafka_pid"))
        redis = self._redis(state)
        redis_up = all(redis.running())
        endpoints = self.endpoints()
        return {
            "backend": "local",
            "state_dir": str(self.state_dir),
            "up": kafka_up and redis_up,
            "secure": bool(state.get("secure")),
            "redis_cluster": bool(state.get("redis_cluster")),
            "kafka": {"running": kafka_up, "pid": state.get("kafka_pid"), "bootstrap": endpoints.bootstrap,
                      "config_file": endpoints.kafka_config_file or None},
            "redis": {"running": redis_up, "pid": redis.pids()[0], "pids": redis.pids(),
                      "url": mask_url(endpoints.redis_url)},
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

    # -- Kafka -----------------------------------------------------------------------------------
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

    def _listener_settings(self, state: dict[str, Any]) -> dict[str, str]:
        port, cport = state["kafka_port"], state["controller_port"]
        tls = self._tls(state)
        name = "SASL_SSL" if tls else "PLAINTEXT"
        props = {
            "listeners": f"{name}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
            "advertised.listeners": f"{name}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": name,
            "listener.security.protocol.map": f"CONTROLLER:PLAINTEXT,{name}:{name}",
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

    def _broker_config(self, state: dict[str, Any]) -> Path:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{state['controller_port']}",
            **self._listener_settings(state),
            "log.dirs": str(self.state_dir / "kafka-logs"),
            **BROKER_SETTINGS,
        }
        config = self.state_dir / "server.properties"
        write_private(config, "".join(f"{k}={v}\n" for k, v in props.items()))
        (self.state_dir / "log4j2.properties").write_text(_LOG4J2)
        return config

    def _java(self) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise StackError("java not found: Kafka 4 needs Java 17 (apt-get install -y openjdk-17-jre-headless)")
        return [java, _BROKER_HEAP, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.state_dir / 'log4j2.properties'}",
                "-cp", f"{kafka_jars()}/*"]

    def _format_storage(self, state: dict[str, Any], config: Path) -> None:
        # "--cluster-id=": a base64 id may start with "-", which argparse would take for an option.
        command = [*self._java(), "kafka.tools.StorageTool", "format", f"--cluster-id={state['cluster_id']}",
                   "-c", str(config), "--standalone"]
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
            raise StackError(f"formatting Kafka storage failed:\n{output}")

    def start_broker(self) -> None:
        state = self._state_or_fail()
        if alive(state.get("kafka_pid")):
            return
        config = self._broker_config(state)
        if not (self.state_dir / "kafka-logs" / "meta.properties").exists():
            self._format_storage(state, config)
        log = self.state_dir / "kafka.log"
        pid = spawn([*self._java(), "kafka.Kafka", str(config)], log)
        state["kafka_pid"] = pid
        self._save(state)
        admin = AdminClient({**self.endpoints().kafka_config(),
                             "logger": logging.getLogger("ordering_layer.kafka.client")})  # type: ignore[dict-item]

        def answers() -> bool:
            metadata = admin.list_topics(timeout=2)
            return bool(metadata.brokers) and metadata.controller_id >= 0

        wait_until(answers, "Kafka broker", pid, log)

    def stop_broker(self, *, kill: bool = False) -> None:
        state = self._load()
        stop(state.get("kafka_pid"), kill=kill)
        if state:
            state["kafka_pid"] = None
            self._save(state)
