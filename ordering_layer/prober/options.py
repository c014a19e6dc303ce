"""The prober's run options (what the CLI parses) and the expected counts of a publish summary."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ordering_layer.errors import ConfigError
from ordering_layer.prober.consumer import HandlerPlan
from ordering_layer.prober.events import POISON_EXIT
from ordering_layer.prober.publisher import PublishPlan

MODES = ("full", "publish", "consume", "check")


@dataclass(frozen=True)
class SubscriptionPlan:
    """Settings of the subscription the prober creates when it does not exist (ordering on)."""

    ack_deadline: float = 10.0
    minimum_backoff: float = 0.0
    maximum_backoff: float = 0.0
    dead_letter_topic: str | None = None
    max_delivery_attempts: int = 5


@dataclass(frozen=True)
class ProbeOptions:
    """Everything a prober run needs besides the servers (see the CLI's help for each).

    ``publish`` is what the publishing side sends (full and publish modes); its topic and run id
    name the run in every mode, and its ``duration`` bounds the whole run in consume and check modes.
    """

    mode: str = "full"
    publish: PublishPlan = field(default_factory=PublishPlan)
    subscription: str | None = None
    partitions: int = 6
    front_end: str = "callback"
    handler: HandlerPlan = field(default_factory=HandlerPlan)
    workers: int = 10
    batch_size: int = 100
    max_outstanding: int = 1000
    subscription_plan: SubscriptionPlan = field(default_factory=SubscriptionPlan)
    subscriber_id: str = "prober"
    events_dir: Path | None = None
    from_events: Path | None = None
    expect: Mapping[str, Mapping[str, int]] | None = None
    idle_timeout: float = 30.0
    lag: float = 2.0
    max_examples: int = 20

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "consume" and self.events_dir is None:
            raise ConfigError("consume mode writes its records to an events folder: give events_dir")
        if self.from_events is not None and self.mode != "check":
            raise ConfigError("from_events is for check mode")
        if self.mode in ("full", "publish") and not (self.publish.messages or self.publish.duration):
            raise ConfigError("publishing needs a message count or a duration")
        if self.mode == "full" and POISON_EXIT in self.publish.poison:
            raise ConfigError("an 'exit' poison message ends the process consuming it: publish it in publish "
                              "mode, to consume-mode subscriber processes that a harness restarts")

    @property
    def run_id(self) -> str:
        """The run's id (the publish plan's)."""
        return self.publish.run_id

    @property
    def topic_name(self) -> str:
        """The topic (default ``prober-<run id>``)."""
        return self.publish.topic_name

    @property
    def subscription_name(self) -> str:
        """The subscription (default ``<topic>-prober``)."""
        return self.subscription or f"{self.topic_name}-prober"


def load_expectations(path: Path) -> dict[str, dict[str, int]]:
    """The per-run, per-key counts in a publish-mode summary file (``{"expected": {run: {key: n}}}``).

    Raises:
        ConfigError: the file is not such a summary.
    """
    try:
        expected = json.loads(path.read_text())["expected"]
        return {str(run): {str(k): int(n) for k, n in keys.items()} for run, keys in expected.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: not a prober publish summary with 'expected' counts ({exc})") from exc
