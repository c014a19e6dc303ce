"""Typed settings with documented defaults and units, and checks of Kafka config dicts.

Kafka's own config dict passes through to confluent-kafka untouched (the wrappers stay drop-in);
the layer's settings are separate typed objects, and unknown layer keys are refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from ordering_layer.errors import ConfigError

MAX_ORDERING_KEY_BYTES = 1024

_T = TypeVar("_T")


def from_mapping(cls: type[_T], values: Mapping[str, Any] | _T | None) -> _T:
    """Build the settings dataclass ``cls`` from a mapping, refusing keys it does not define.

    Raises:
        ConfigError: with ``unknown`` naming every key the dataclass does not have.
    """
    if values is None:
        return cls()
    if isinstance(values, cls):
        return values
    assert isinstance(values, Mapping)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = tuple(sorted(set(values) - known))
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}",
            unknown=unknown,
        )
    return cls(**values)


def require_bootstrap(config: Mapping[str, Any]) -> None:
    """Refuse a Kafka config without ``bootstrap.servers``."""
    if not str(config.get("bootstrap.servers") or "").strip():
        raise ConfigError("Kafka config needs 'bootstrap.servers' (for example '127.0.0.1:9092')")


@dataclasses.dataclass(frozen=True)
class PublisherSettings:
    """Layer settings of ``OrderedProducer`` (Kafka's own settings go in the config dict).

    Attributes:
        max_message_bytes: largest encoded record (value, key and headers) accepted, in bytes;
            larger ones are refused before sending (PUB-4). Keep it at or below the topic's
            ``max.message.bytes``.
        metadata_max_age: seconds a topic's partition count is cached before it is read again;
            the count routes ordering keys and is stamped into every record (PUB-6).
    """

    max_message_bytes: int = 1_000_000
    metadata_max_age: float = 30.0

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0:
            raise ConfigError(f"max_message_bytes must be > 0, got {self.max_message_bytes}")
        if self.metadata_max_age <= 0:
            raise ConfigError(f"metadata_max_age must be > 0, got {self.metadata_max_age}")
