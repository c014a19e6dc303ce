"""Local Kafka + Redis for the demo, the tests and the benchmarks, behind one backend seam."""

from __future__ import annotations

import os
from pathlib import Path

from ordering_layer.errors import ConfigError
from ordering_layer.stack.base import Endpoints, StackBackend
from ordering_layer.stack.local import LocalStack

__all__ = ["Endpoints", "LocalStack", "StackBackend", "get_backend"]

BACKENDS = ("local",)


def get_backend(kind: str | None = None, state_dir: Path | None = None) -> StackBackend:
    """The stack backend named by ``kind`` or ``$ORDERING_LAYER_STACK`` (default ``local``)."""
    kind = kind or os.environ.get("ORDERING_LAYER_STACK", "local")
    if kind == "local":
        return LocalStack(state_dir)
    raise ConfigError(f"unknown stack backend {kind!r}; known: {', '.join(BACKENDS)}")
