"""The seam between the layer's tooling and whatever runs Kafka + Redis for it.

A backend starts a single-node Kafka broker and a Redis server, hands out their addresses, and can
stop and restart either one alone, keeping its data (the chaos tests rely on that). The local
backend runs the processes directly; a container backend runs the same behind testcontainers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Endpoints:
    """Where a running stack answers."""

    bootstrap: str
    redis_url: str

    def env_lines(self) -> list[str]:
        """Shell ``export`` lines naming this stack for the CLI, tests and benchmarks."""
        return [
            f"export ORDERING_LAYER_BOOTSTRAP={self.bootstrap}",
            f"export ORDERING_LAYER_REDIS_URL={self.redis_url}",
        ]


class StackBackend(ABC):
    """A Kafka + Redis pair that can be started, stopped and partly restarted."""

    @abstractmethod
    def up(self) -> Endpoints:
        """Start both services (harmless when they run already) and wait until they answer."""

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
    def stop_broker(self, *, kill: bool = False) -> None:
        """Stop the Kafka broker (SIGKILL when ``kill``), keeping its log directory."""

    @abstractmethod
    def start_broker(self) -> None:
        """Start the broker again on the same address and wait until it answers."""

    @abstractmethod
    def stop_redis(self, *, kill: bool = False) -> None:
        """Stop Redis (SIGKILL when ``kill``), keeping its append-only file."""

    @abstractmethod
    def start_redis(self) -> None:
        """Start Redis again on the same address and wait until it answers PING."""
