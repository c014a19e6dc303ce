"""Typed settings with documented defaults and units, and checks of Kafka config dicts.

Kafka's own config dict passes through to confluent-kafka untouched (the wrappers stay drop-in);
the layer's settings are separate typed objects, and unknown layer keys are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

from ordering_layer.errors import ConfigError

MAX_ORDERING_KEY_BYTES = 1024
# A dead letter is the source record plus its facts, so it may be larger than anything the source
# topic took: dead-letter topics are created with room for this many bytes per record, and the
# dead-letter producer may send as much.
DEAD_LETTER_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_SCHEDULE_TOPIC = "__ordering_layer_schedules"
DEFAULT_SNAPSHOT_TOPIC = "__ordering_layer_snapshots"
DEFAULT_SNAPSHOT_TTL = 7 * 24 * 3600.0  # seconds a snapshot lasts (GRP-3; Pub/Sub keeps them up to 7 days)
# The compacted topic holding the durable copy of every subscription's settings.
SUBSCRIPTIONS_TOPIC = "__ordering_layer_subscriptions"

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


def read_kafka_properties(path: Path) -> dict[str, str]:
    """Kafka client settings from a ``key=value`` properties file (``#`` comments, blank lines).

    The format of Kafka's own ``client.properties``, restricted to one setting per line; the keys
    are librdkafka's (``security.protocol``, ``sasl.username``, ``ssl.ca.location``, ...).

    Raises:
        ConfigError: the file cannot be read or a line is not ``key=value``.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read Kafka config file {path}: {exc.strerror}") from None
    settings = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            # The line is not echoed: it may hold a password.
            raise ConfigError(f"{path}:{number}: expected key=value")
        settings[key.strip()] = value.strip()
    return settings


@dataclasses.dataclass(frozen=True)
class PublisherSettings:
    """Layer settings of ``OrderedProducer`` (Kafka's own settings go in the config dict).

    Attributes:
        max_message_bytes: largest encoded record (value, key and headers) accepted, in bytes;
            larger ones are refused before sending (PUB-4). Keep it at or below the topic's
            ``max.message.bytes``.
        metadata_max_age: seconds a topic's partition count is cached before it is read again;
            the count routes ordering keys and is stamped into every record (PUB-6). When it grew,
            the records in flight are acknowledged before the new count routes any (SUB-8).
        scheduler: take part in activating due scheduled messages while running (PUB-5; needs a
            Redis URL, and ``$ORDERING_LAYER_SCHEDULER=0`` switches it off too).
        schedule_topic: the compacted topic of scheduled messages that ``schedule`` writes to and
            activation reads.
        tracing: an OpenTelemetry span per publish, its W3C trace context in the record's headers
            (``ordering_layer.tracing``; needs ``opentelemetry-api``). None: on when
            ``$ORDERING_LAYER_TRACING`` is ``1`` (or a ``tracer_provider`` is given to the producer).
    """

    max_message_bytes: int = 1_000_000
    metadata_max_age: float = 5.0
    scheduler: bool = True
    schedule_topic: str = DEFAULT_SCHEDULE_TOPIC
    tracing: bool | None = None

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0:
            raise ConfigError(f"max_message_bytes must be > 0, got {self.max_message_bytes}")
        if self.metadata_max_age <= 0:
            raise ConfigError(f"metadata_max_age must be > 0, got {self.metadata_max_age}")


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{name} must be within {low}..{high}, got {value}")


@dataclasses.dataclass(frozen=True)
class FlowControl:
    """Limits on what is outstanding at one subscriber (SUB-7).

    The Kafka fetch is paused while either limit is reached and resumed below 80 % of both.

    Attributes:
        max_messages: most messages delivered and not yet acked or nacked.
        max_bytes: most payload bytes delivered and not yet acked or nacked.
    """

    max_messages: int = 1000
    max_bytes: int = 100 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_messages <= 0 or self.max_bytes <= 0:
            raise ConfigError(f"flow control limits must be > 0, got {self}")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Backoff between a nack or lease expiry and the redelivery (DLQ-1), in seconds (0..600)."""

    minimum_backoff: float = 10.0
    maximum_backoff: float = 600.0

    def __post_init__(self) -> None:
        _check_range("minimum_backoff", self.minimum_backoff, 0, 600)
        _check_range("maximum_backoff", self.maximum_backoff, 0, 600)
        if self.minimum_backoff > self.maximum_backoff:
            raise ConfigError("minimum_backoff must not exceed maximum_backoff")

    def backoff(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (1-based), doubling each time."""
        if failures <= 0:
            return 0.0
        return float(min(self.maximum_backoff, self.minimum_backoff * (2 ** min(failures - 1, 30))))


DEAD_LETTER_MODES = ("forward", "park_key")


@dataclasses.dataclass(frozen=True)
class DeadLetterPolicy:
    """Where messages go after too many delivery attempts (DLQ-2).

    Attributes:
        topic: the dead-letter topic.
        max_delivery_attempts: 5..100; attempt ``max_delivery_attempts + 1`` goes to the topic instead.
        mode: ``forward`` (the key goes on with its next message) or ``park_key`` (later messages of
            the key follow it into the dead-letter topic, in order, until the key is released).
    """

    topic: str
    max_delivery_attempts: int = 5
    mode: str = "forward"

    def __post_init__(self) -> None:
        if not self.topic:
            raise ConfigError("dead_letter_policy.topic is required")
        _check_range("max_delivery_attempts", self.max_delivery_attempts, 5, 100)
        if self.mode not in DEAD_LETTER_MODES:
            raise ConfigError(f"dead_letter_policy.mode must be one of {DEAD_LETTER_MODES}, got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class StartPosition:
    """Where a new subscription starts (GRP-1): ``TRIM_HORIZON``, ``LATEST`` or ``at_time(t)``."""

    kind: str
    timestamp_ms: int | None = None

    TRIM_HORIZON: ClassVar[StartPosition]
    LATEST: ClassVar[StartPosition]

    @staticmethod
    def at_time(when: datetime) -> StartPosition:
        """The first message whose enqueued time is at or after ``when`` (aware datetime)."""
        if when.tzinfo is None:
            raise ConfigError("StartPosition.at_time needs a timezone-aware datetime")
        return StartPosition("AT_TIME", int(when.timestamp() * 1000))

    def __post_init__(self) -> None:
        if self.kind not in ("TRIM_HORIZON", "LATEST", "AT_TIME"):
            raise ConfigError(f"unknown start position {self.kind!r}")
        if (self.kind == "AT_TIME") != (self.timestamp_ms is not None):
            raise ConfigError("AT_TIME needs a time; the other start positions take none")


StartPosition.TRIM_HORIZON = StartPosition("TRIM_HORIZON")
StartPosition.LATEST = StartPosition("LATEST")


PUSH_JWT_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
# Fields of PushConfig that hold secrets: never in a repr, a log line or describe's output.
PUSH_SECRETS = ("bearer_token", "jwt_private_key")


@dataclasses.dataclass(frozen=True)
class PushConfig:
    """Where and how the pusher POSTs a push subscription's messages (PSH-1..3).

    The secrets (``bearer_token``, ``jwt_private_key``) are stored with the subscription (in Redis
    and in its durable copy in Kafka, so restrict who reads those), and kept out of reprs, logs and
    ``subscription describe``.

    Attributes:
        endpoint: the ``http://`` or ``https://`` URL each message is POSTed to.
        no_wrapper: POST the raw payload with the attributes as HTTP headers, instead of Pub/Sub's
            JSON push request (``message.data`` base64, ``attributes``, ``messageId``, ...).
        request_timeout: seconds a request may take (0 < t <= 600); past it the message is nacked.
        max_concurrent_requests: requests in flight at one pusher at most (>= 1); with ordering,
            one per ordering key at most (PSH-2).
        bearer_token: a static token sent as ``Authorization: Bearer <token>``.
        jwt_private_key: a PEM private key; each request then carries ``Authorization: Bearer <JWT>``,
            a JWT signed with it (audience: ``endpoint``; subject: the subscription), renewed before
            it expires. At most one of ``bearer_token`` and ``jwt_private_key``.
        jwt_algorithm: the JWT's signing algorithm, matching the key (``PUSH_JWT_ALGORITHMS``).
        jwt_issuer: the JWT's ``iss`` claim.
        jwt_key_id: the JWT header's ``kid`` (lets the endpoint pick the public key), or None.
        jwt_lifetime: seconds a JWT is valid (10..3600; short: the default is 5 minutes).
        ca_bundle: PEM certificates of the CAs that an ``https`` endpoint's certificate is verified
            against, instead of the system's; the certificate is always verified.
    """

    endpoint: str
    no_wrapper: bool = False
    request_timeout: float = 30.0
    max_concurrent_requests: int = 100
    bearer_token: str | None = None
    jwt_private_key: str | None = None
    jwt_algorithm: str = "RS256"
    jwt_issuer: str = "ordering-layer"
    jwt_key_id: str | None = None
    jwt_lifetime: float = 300.0
    ca_bundle: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"push endpoint must be an http:// or https:// URL, got {self.display_endpoint!r}")
        if not 0 < self.request_timeout <= 600:
            raise ConfigError(f"request_timeout must be within 0..600 s (above 0), got {self.request_timeout}")
        if self.max_concurrent_requests < 1:
            raise ConfigError(f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}")
        if self.bearer_token is not None and self.jwt_private_key is not None:
            raise ConfigError("push auth takes a bearer_token or a jwt_private_key, not both")
        if self.bearer_token is not None and (not self.bearer_token or any(c in self.bearer_token for c in "\r\n")):
            raise ConfigError("bearer_token must be a non-empty single line")
        if self.jwt_private_key is not None and "PRIVATE KEY-----" not in self.jwt_private_key:
            raise ConfigError("jwt_private_key must be a PEM private key")
        if self.jwt_algorithm not in PUSH_JWT_ALGORITHMS:
            raise ConfigError(f"jwt_algorithm must be one of {PUSH_JWT_ALGORITHMS}, got {self.jwt_algorithm!r}")
        _check_range("jwt_lifetime", self.jwt_lifetime, 10, 3600)
        if self.ca_bundle is not None and "-----BEGIN CERTIFICATE-----" not in self.ca_bundle:
            raise ConfigError("ca_bundle must hold PEM certificates")

    def __repr__(self) -> str:
        # The public form (secrets and the endpoint's query left out): settings end up in logs.
        return "PushConfig(" + ", ".join(f"{name}={value!r}" for name, value in self.public().items()) + ")"

    @property
    def auth(self) -> str:
        """``bearer``, ``jwt`` or ``none``: which Authorization header the requests carry."""
        if self.bearer_token is not None:
            return "bearer"
        return "jwt" if self.jwt_private_key is not None else "none"

    @property
    def display_endpoint(self) -> str:
        """The endpoint for logs and describe: without user info, its query and fragment elided
        (Pub/Sub users often carry a token in the query)."""
        parts = urlsplit(self.endpoint)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        try:
            port = f":{parts.port}" if parts.port is not None else ""
        except ValueError:
            port = ""
        return f"{parts.scheme}://{host}{port}{parts.path}" + ("?..." if parts.query or parts.fragment else "")

    def public(self) -> dict[str, Any]:
        """The settings as a JSON-ready dict without secrets: ``endpoint`` as ``display_endpoint``,
        each secret as ``"<set>"`` or None, the CA bundle as its certificate count."""
        public = dataclasses.asdict(self)
        public["endpoint"] = self.display_endpoint
        for name in PUSH_SECRETS:
            public[name] = None if public[name] is None else "<set>"
        if self.ca_bundle is not None:
            public["ca_bundle"] = f"<{self.ca_bundle.count('-----BEGIN CERTIFICATE-----')} certificate(s)>"
        return public


@dataclasses.dataclass(frozen=True)
class SubscriptionSettings:
    """The durable settings of a subscription, stored in Redis at creation (fixed afterwards).

    Attributes:
        topic: the topic it consumes.
        enable_message_ordering: per-key order (SUB-1); fixed at creation (SUB-6).
        ack_deadline: seconds a delivery may stay unacked before redelivery (10..600, ACK-1).
        retry_policy: backoff after nacks and expiries (DLQ-1).
        dead_letter_policy: dead-letter topic and attempts (DLQ-2), or None.
        max_lease_duration: seconds of automatic lease extension at most (ACK-2).
        min_duration_per_lease_extension / max_duration_per_lease_extension: clamp of each
            extension, 0 for off, else 10..600 s (ACK-2).
        push_config: the HTTP endpoint the pusher (``ordering-layer push``) POSTs the messages to
            (PSH-1..3), or None: a pull/streaming subscription.
    """

    topic: str
    enable_message_ordering: bool = True
    ack_deadline: float = 10.0
    retry_policy: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    dead_letter_policy: DeadLetterPolicy | None = None
    max_lease_duration: float = 3600.0
    min_duration_per_lease_extension: float = 0.0
    max_duration_per_lease_extension: float = 0.0
    push_config: PushConfig | None = None

    def __post_init__(self) -> None:
        if not self.topic:
            raise ConfigError("a subscription needs a topic")
        _check_range("ack_deadline", self.ack_deadline, 10, 600)
        if self.max_lease_duration <= 0:
            raise ConfigError("max_lease_duration must be > 0")
        for name in ("min_duration_per_lease_extension", "max_duration_per_lease_extension"):
            value = getattr(self, name)
            if value != 0:
                _check_range(name, value, 10, 600)

    def to_json(self) -> str:
        """The settings as JSON, for Redis (secrets included: see ``public``)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def public(self) -> dict[str, Any]:
        """The settings as a JSON-ready dict without the push secrets (``PushConfig.public``), for
        output and logs."""
        public = dataclasses.asdict(self)
        public["push_config"] = self.push_config.public() if self.push_config is not None else None
        return public

    @classmethod
    def from_json(cls, text: str | bytes) -> SubscriptionSettings:
        """Settings read back from Redis."""
        raw = json.loads(text)
        raw["retry_policy"] = RetryPolicy(**raw["retry_policy"])
        if raw.get("dead_letter_policy"):
            raw["dead_letter_policy"] = DeadLetterPolicy(**raw["dead_letter_policy"])
        if raw.get("push_config"):
            raw["push_config"] = PushConfig(**raw["push_config"])
        return cls(**raw)
