"""Local Kafka + Redis for the demo, the tests and the benchmarks, behind one backend seam."""

from __future__ import annotations

import os
from pathlib import Path

from ordering_layer.errors import ConfigError
from ordering_layer.stack.base import Endpoints, StackBackend
from ordering_layer.stack.containers import ContainerStack
from ordering_layer.stack.local import LocalStack

__all__ = ["ContainerStack", "Endpoints", "LocalStack", "StackBackend", "get_backend"]

BACKENDS = ("local", "testcontainers")


def get_backend(kind: str | None = None, state_dir: Path | None = None) -> StackBackend:
    """The stack backend named by ``kind`` or ``$ORDERING_LAYER_STACK`` (default ``local``).

    ``local`` runs Kafka and Redis as processes of this machine; ``testcontainers`` runs them in
    containers (see ``ordering_layer.stack.containers``).
    """
    kind = kind or os.environ.get("ORDERING_LAYER_STACK", "local")
    if kind == "local":
        return LocalStack(state_dir)
    if kind == "testcontainers":
        return ContainerStack(state_dir)
    raise ConfigError(f"unknown stack backend {kind!r}; known: {', '.join(BACKENDS)}")
