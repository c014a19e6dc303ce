"""Container backend: Kafka (KRaft) and Redis in containers started by testcontainers.

``ORDERING_LAYER_STACK=testcontainers`` selects it. Images default to the ones ``make images`` builds
here without a registry (``ordering-layer/kafka:<version>``, ``ordering-layer/redis:7``); when those
are absent the official names (``apache/kafka:<version>``, ``redis:7``) are pulled. Both are
configured the same way: the broker through ``KAFKA_*`` environment variables (the convention of the
official apache/kafka image, which the local image's entrypoint follows), Redis by its command line.
``ORDERING_LAYER_KAFKA_IMAGE`` and ``ORDERING_LAYER_REDIS_IMAGE`` name other images.

Each container publishes its port on the same free host port across restarts, so stopping and
starting the broker or Redis (the chaos tests do) keeps the address; the data stays in the
container's own file system. Container ids are kept in the state folder, so ``down`` of a later CLI
call finds the containers that ``up`` started. The containers are removed by ``down`` (the test
fixture calls it at the end of the session), not by Ryuk: they must outlive ``ordering-layer stack
up``, and Ryuk's image cannot be pulled on a machine without a registry.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from ordering_layer.errors import StackError
from ordering_layer.stack.base import BROKER_SETTINGS, Endpoints, FolderStateBackend, free_port
from ordering_layer.stack.jars import cache_dir, kafka_version
from ordering_layer.state.client import redis_client

_LOGGER = logging.getLogger(__name__)

_START_TIMEOUT = 180.0
_STOP_TIMEOUT = 30
_KAFKA_PORT = 9092
_REDIS_PORT = 6379
_CLUSTER_ID = "5L6g3nShT-eMCtK--X86sw"
_LABEL = "ordering-layer.stack"

REDIS_COMMAND = ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no",
                 "--appendonly", "yes", "--dir", "/data"]


def local_images() -> dict[str, str]:
    """The image names ``make images`` builds (``docker/build-images.sh``)."""
    return {"kafka": f"ordering-layer/kafka:{kafka_version()}", "redis": "ordering-layer/redis:7"}


def official_images() -> dict[str, str]:
    """The official image names, used when the local images are absent and a registry answers."""
    return {"kafka": f"apache/kafka:{kafka_version()}", "redis": "redis:7"}


def default_state_dir() -> Path:
    """``$ORDERING_LAYER_STACK_DIR`` or ``<cache>/stack-containers``."""
    configured = os.environ.get("ORDERING_LAYER_STACK_DIR")
    return Path(configured) if configured else cache_dir() / "stack-containers"


def kafka_environment(host: str, port: int) -> dict[str, str]:
    """``KAFKA_*`` variables for a single-node KRaft broker answering clients at ``host:port``.

    Inside the container the broker listens on the same port number as the host publishes, so the
    advertised address works from the host and from the broker itself.
    """
    props = {
        "node.id": "1",
        "process.roles": "broker,controller",
        "listeners": f"PLAINTEXT://0.0.0.0:{port},CONTROLLER://localhost:9093",
        "advertised.listeners": f"PLAINTEXT://{host}:{port}",
        "controller.listener.names": "CONTROLLER",
        "controller.quorum.voters": "1@localhost:9093",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": "/var/lib/kafka/data",
        **BROKER_SETTINGS,
    }
    env = {"KAFKA_" + key.replace("_", "__").replace(".", "_").upper(): value for key, value in props.items()}
    env["CLUSTER_ID"] = _CLUSTER_ID
    env["KAFKA_HEAP_OPTS"] = "-Xmx512m -Xms256m"
    return env


def _single_broker(number: int | None) -> None:
    """Refuse a broker count or node other than 1: this backend runs a single-node broker."""
    if number not in (None, 1):
        raise StackError(f"the testcontainers backend runs a single broker (asked for {number}); "
                         "a 3-broker cluster runs with the local backend: --backend local")


@contextmanager
def _without_ryuk() -> Iterator[None]:
    from testcontainers.core.config import testcontainers_config  # optional: the test extra

    previous = testcontainers_config.ryuk_disabled
    testcontainers_config.ryuk_disabled = True
    try:
        yield
    finally:
        testcontainers_config.ryuk_disabled = previous


class ContainerStack(FolderStateBackend):
    """Kafka + Redis in two containers started by testcontainers, state kept in ``state_dir``."""

    def __init__(self, state_dir: Path | None = None) -> None:
        super().__init__(Path(state_dir) if state_dir else default_state_dir())

    @staticmethod
    def _client() -> Any:
        try:
            import testcontainers  # noqa: F401 - checked here so a missing extra is named early

            import docker
        except ImportError as exc:
            raise StackError("the testcontainers backend needs the test extra: "
                             "pip install 'ordering-layer[test]'") from exc
        try:
            client = docker.from_env()
            client.ping()
        except Exception as exc:  # docker raises several unrelated types when no engine answers
            raise StackError(
                f"no Docker engine answers ({exc}); start one with docker/engine.sh or 'make docker-engine'"
            ) from exc
        return client

    def _container(self, state: dict[str, Any], service: str) -> Any:
        import docker.errors  # optional: the test extra (docker comes with testcontainers)

        try:
            return self._client().containers.get(state[service]["id"])
        except docker.errors.NotFound as exc:
            raise StackError(f"the {service} container {state[service]['id'][:12]} is gone; "
                             "run 'ordering-layer stack down' then 'up'") from exc

    def _image(self, service: str) -> str:
        import docker.errors  # optional: the test extra (docker comes with testcontainers)

        configured = os.environ.get(f"ORDERING_LAYER_{service.upper()}_IMAGE")
        if configured:
            return configured
        client = self._client()
        local = local_images()[service]
        try:
            client.images.get(local)
            return local
        except docker.errors.ImageNotFound:
            pass
        official = official_images()[service]
        try:
            client.images.get(official)
        except docker.errors.ImageNotFound:
            try:
                client.images.pull(official)
            except docker.errors.APIError as exc:
                raise StackError(f"neither {local} (build it with 'make images') nor {official} "
                                 f"(pull failed: {exc}) is available") from exc
        return official

    # -- lifecycle -------------------------------------------------------------------------------
    def up(self, brokers: int | None = None) -> Endpoints:
        _single_broker(brokers)
        state = self._load()
        if not state:
            state = {"backend": "testcontainers", "host": "127.0.0.1",
                     "kafka": {"port": free_port()}, "redis": {"port": free_port()}}
            self._save(state)
        if not state["redis"].get("id"):
            state["redis"].update(self._run_redis(state))
            self._save(state)
        self.start_redis()
        if not state["kafka"].get("id"):
            state["kafka"].update(self._run_kafka(state))
            self._save(state)
        self.start_broker()
        return self.endpoints()

    def _run_redis(self, state: dict[str, Any]) -> dict[str, Any]:
        from testcontainers.community.redis import RedisContainer  # optional: the test extra

        image = self._image("redis")
        container = RedisContainer(image).with_command(REDIS_COMMAND)
        container.with_bind_ports(_REDIS_PORT, state["redis"]["port"])
        container.with_kwargs(labels={_LABEL: str(self.state_dir)})
        with _without_ryuk():
            container.start()  # waits for PING
        return {"id": container.get_container_id(), "image": image}

    def _run_kafka(self, state: dict[str, Any]) -> dict[str, Any]:
        from testcontainers.core.container import DockerContainer  # optional: the test extra

        image = self._image("kafka")
        port = state["kafka"]["port"]
        container = DockerContainer(image, env=kafka_environment(state["host"], port))
        container.with_bind_ports(port, port)
        container.with_kwargs(labels={_LABEL: str(self.state_dir)})
        with _without_ryuk():
            container.start()
        return {"id": container.get_container_id(), "image": image}

    def down(self) -> None:
        import docker.errors  # optional: the test extra (docker comes with testcontainers)

        state = self._load()
        for service in ("kafka", "redis"):
            container_id = state.get(service, {}).get("id")
            if container_id:
                with suppress(docker.errors.NotFound):
                    self._client().containers.get(container_id).remove(force=True, v=True)
        if self._state_file.exists():
            self._state_file.unlink()

    def endpoints(self) -> Endpoints:
        state = self._state_or_fail()
        return Endpoints(bootstrap=f"{state['host']}:{state['kafka']['port']}",
                         redis_url=f"redis://{state['host']}:{state['redis']['port']}/0")

    def status(self) -> dict[str, Any]:
        state = self._load()
        if not state:
            return {"backend": "testcontainers", "state_dir": str(self.state_dir), "up": False}
        services: dict[str, Any] = {}
        for service in ("kafka", "redis"):
            info = dict(state[service])
            if info.get("id"):
                try:
                    info["running"] = self._container(state, service).status == "running"
                except StackError:
                    info["running"] = False
            services[service] = info
        endpoints = self.endpoints()
        return {"backend": "testcontainers", "state_dir": str(self.state_dir),
                "up": all(s.get("running") for s in services.values()),
                "bootstrap": endpoints.bootstrap, "redis_url": endpoints.redis_url, **services}

    def _stop(self, service: str, *, kill: bool) -> None:
        container = self._container(self._state_or_fail(), service)
        if kill:
            container.kill()
        else:
            container.stop(timeout=_STOP_TIMEOUT)
        container.wait(timeout=_STOP_TIMEOUT + 30)

    def _start(self, service: str, answers: Callable[[], bool]) -> None:
        container = self._container(self._state_or_fail(), service)
        container.reload()
        if container.status != "running":
            container.start()
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            try:
                if answers():
                    return
            except Exception as exc:  # noqa: BLE001 - not answering yet is the expected state here
                _LOGGER.debug("%s not ready: %s", service, exc)
            container.reload()
            if container.status not in ("running", "created", "restarting"):
                logs = container.logs(tail=40).decode(errors="replace")
                raise StackError(f"the {service} container stopped ({container.status}):\n{logs}")
            if time.monotonic() > deadline:
                logs = container.logs(tail=40).decode(errors="replace")
                raise StackError(f"{service} did not answer within {_START_TIMEOUT:.0f} s:\n{logs}")
            time.sleep(0.5)

    def stop_broker(self, *, node: int | None = None, kill: bool = False) -> None:
        _single_broker(node)
        self._stop("kafka", kill=kill)

    def start_broker(self, *, node: int | None = None) -> None:
        _single_broker(node)
        bootstrap = self.endpoints().bootstrap
        admin = AdminClient({"bootstrap.servers": bootstrap,
                             "logger": logging.getLogger("ordering_layer.kafka.client")})  # type: ignore[dict-item]

        def answers() -> bool:
            metadata = admin.list_topics(timeout=2)
            return bool(metadata.brokers) and metadata.controller_id >= 0

        self._start("kafka", answers)

    def stop_redis(self, *, kill: bool = False) -> None:
        self._stop("redis", kill=kill)

    def start_redis(self) -> None:
        client = redis_client(self.endpoints().redis_url)

        def answers() -> bool:
            return bool(client.ping())

        try:
            self._start("redis", answers)
        finally:
            client.close()
