"""``ordering-layer prober``: publish per-key sequences, consume them, verify SUB-1..SUB-5 and ACK-6.

Registered on the main command group by ``ordering_layer.cli`` through ``prober_command``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from confluent_kafka import KafkaException
from redis.exceptions import RedisError

from ordering_layer.errors import OrderingLayerError
from ordering_layer.prober.consumer import FRONT_ENDS, HandlerPlan
from ordering_layer.prober.events import POISONS
from ordering_layer.prober.options import MODES, ProbeOptions, SubscriptionPlan, load_expectations
from ordering_layer.prober.progress import ProgressLine
from ordering_layer.prober.publisher import PublishPlan
from ordering_layer.prober.runner import ProbeRun
from ordering_layer.stack import Endpoints


class ProbeError(click.ClickException):
    """The run could not be made (exit status 2; 1 means the run found violations)."""

    exit_code = 2


def _delay_range(text: str) -> tuple[float, float]:
    """``"5"`` -> (0.005, 0.005); ``"1-20"`` -> (0.001, 0.02) (milliseconds in, seconds out)."""
    low, _, high = text.partition("-")
    try:
        bounds = (float(low) / 1000, float(high or low) / 1000)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not MS or LOW-HIGH milliseconds") from exc
    if not 0 <= bounds[0] <= bounds[1]:
        raise click.BadParameter(f"{text!r}: need 0 <= LOW <= HIGH")
    return bounds


def _kafka_settings(pairs: tuple[str, ...]) -> dict[str, str]:
    settings = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="-X")
        settings[name.strip()] = value.strip()
    return settings


_OPTIONS = [
    click.option("--mode", type=click.Choice(MODES), default="full", show_default=True,
                 help="full: publish, consume and verify; publish: publish only; consume: consume and write "
                      "events to --events; check: verify records another process wrote (consuming here, or "
                      "reading --from-events)."),
    click.option("--run-id", default=None, help="Run id in the prober-run header (default: random)."),
    click.option("--topic", default=None, help="Topic (default prober-<run id>; created when missing)."),
    click.option("--subscription", default=None, help="Subscription (default <topic>-prober; created when missing)."),
    click.option("--partitions", type=click.IntRange(min=1), default=6, show_default=True, help="For a new topic."),
    click.option("--keys", type=click.IntRange(min=1), default=100, show_default=True, help="Ordering keys."),
    click.option("--key-prefix", default="key", show_default=True, help="Keys are <prefix>-0, <prefix>-1, ..."),
    click.option("--messages", type=click.IntRange(min=0), default=10_000, show_default=True,
                 help="Messages in all (0: no limit, use --duration)."),
    click.option("--duration", type=click.FloatRange(min=0), default=0.0,
                 help="Seconds of publishing (full, publish) or of the whole run (consume, check); 0: no limit."),
    click.option("--rate", type=click.FloatRange(min=0), default=0.0,
                 help="Messages per second (0: as fast as possible)."),
    click.option("--payload-size", type=click.IntRange(min=0), default=100, show_default=True,
                 help="Bytes per message."),
    click.option("--poison", type=click.Choice(POISONS), multiple=True,
                 help="Publish one poison message of this kind first, on key <prefix>-poison-<kind> (repeatable): "
                      "nack (nacked on every delivery), exit (its handler ends the process: publish mode only), "
                      "hold (held --poison-hold-ms, past its lease, then acked)."),
    click.option("--poison-hold-ms", type=click.FloatRange(min=0), default=60_000.0, show_default=True,
                 help="How long the handler holds a 'hold' poison message."),
    click.option("--front-end", type=click.Choice(FRONT_ENDS), default="callback", show_default=True,
                 help="Subscriber.subscribe, Subscriber.pull or OrderedConsumer."),
    click.option("--nack-rate", type=click.FloatRange(0, 1), default=0.0, show_default=True,
                 help="Probability of nacking a delivery."),
    click.option("--delay-ms", default="0", show_default=True,
                 help="Handler time per message: MS or LOW-HIGH (random)."),
    click.option("--slow-keys", default="", help="Comma-separated ordering keys whose handler takes --slow-delay-ms."),
    click.option("--slow-delay-ms", type=click.FloatRange(min=0), default=1000.0, show_default=True),
    click.option("--seed", type=int, default=None, help="Seed of the random nacks and delays."),
    click.option("--workers", type=click.IntRange(min=1), default=10, show_default=True, help="Handler threads."),
    click.option("--batch-size", type=click.IntRange(min=1), default=100, show_default=True, help="Messages per pull."),
    click.option("--max-outstanding", type=click.IntRange(min=1), default=1000, show_default=True,
                 help="Flow control: messages outstanding at this subscriber."),
    click.option("--ack-deadline", type=float, default=10.0, show_default=True, help="For a new subscription."),
    click.option("--min-backoff", type=float, default=0.0, show_default=True, help="For a new subscription."),
    click.option("--max-backoff", type=float, default=0.0, show_default=True, help="For a new subscription."),
    click.option("--dead-letter-topic", default=None, help="For a new subscription (no dead-lettering without)."),
    click.option("--max-delivery-attempts", type=click.IntRange(5, 100), default=5, show_default=True),
    click.option("--subscriber-id", default=None, help="This subscriber in the records (default <host>-<pid>)."),
    click.option("--events", "events_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                 help="Append deliveries and settlements to <DIR>/<subscriber id>.jsonl (publish mode: the "
                      "per-key counts to <DIR>/publisher-<run id>.jsonl)."),
    click.option("--from-events", type=click.Path(file_okay=False, path_type=Path), default=None,
                 help="check mode: verify the *.jsonl event files in DIR instead of consuming."),
    click.option("--expect", "expect_file", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
                 help="check mode: a publish-mode JSON summary giving each key's published count."),
    click.option("--idle-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
                 help="End when nothing new came for this long after publishing (0: never)."),
    click.option("--lag", type=click.FloatRange(min=0), default=2.0, show_default=True,
                 help="--from-events: seconds events are held back to merge the files in time order."),
    click.option("--max-examples", type=click.IntRange(min=0), default=20, show_default=True,
                 help="Violation examples kept per kind."),
    click.option("-X", "--kafka-setting", "kafka_settings", multiple=True, metavar="NAME=VALUE",
                 help="A confluent-kafka setting for the producer and the subscriber (repeatable), for example "
                      "-X session.timeout.ms=6000."),
    click.option("--summary", "summary_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="Write the JSON summary here instead of stdout."),
    click.option("--progress/--no-progress", default=True, show_default=True,
                 help="Progress on stderr: a live line on a terminal, else a plain line every --progress-interval."),
    click.option("--progress-interval", type=click.FloatRange(min=0.1), default=5.0, show_default=True),
]


def prober_command(server_options: Callable[[Any], Any]) -> click.Command:
    """The ``prober`` command, with the main CLI's server options (``--bootstrap``, ``--redis-url``,
    ``--kafka-config``), passed in: the main CLI imports this module to register the command. They
    reach the command as ``servers``, whose ``endpoints()`` resolves them."""

    def prober(servers: Any, **options: Any) -> None:
        """Publish per-key sequences, subscribe with random nacks and delays, and verify per-key order
        (SUB-1), cascades (SUB-4), affinity (SUB-5), nothing lost (SUB-3) and attempts (ACK-6).

        Prints a JSON summary; exit status 0 when every property held, 1 on any violation or loss,
        2 when the run could not be made.
        """
        _run(servers.endpoints(), **options)

    command: Any = server_options(prober)
    for option in reversed(_OPTIONS):
        command = option(command)
    return click.command("prober")(command)


def _run(endpoints: Endpoints, summary_file: Path | None, progress: bool, progress_interval: float,
         expect_file: Path | None, delay_ms: str, slow_keys: str, slow_delay_ms: float, nack_rate: float,
         seed: int | None, poison: tuple[str, ...], poison_hold_ms: float, ack_deadline: float,
         min_backoff: float, max_backoff: float,
         dead_letter_topic: str | None, max_delivery_attempts: int, subscriber_id: str | None,
         run_id: str | None, topic: str | None, keys: int, key_prefix: str, messages: int, duration: float,
         rate: float, payload_size: int, kafka_settings: tuple[str, ...], **options: Any) -> None:
    """Run the prober with the parsed options; exit as the command's help says."""
    if not endpoints.redis_url and options["mode"] != "publish" and options["from_events"] is None:
        raise ProbeError("subscribing needs Redis: --redis-url or $ORDERING_LAYER_REDIS_URL")
    try:
        named_run = {"run_id": run_id} if run_id else {}
        opts = ProbeOptions(
            **options,
            publish=PublishPlan(topic, **named_run, keys=keys, key_prefix=key_prefix, messages=messages,
                                duration=duration, rate=rate, payload_size=payload_size,
                                poison=tuple(dict.fromkeys(poison))),
            handler=HandlerPlan(nack_rate=nack_rate, delay=_delay_range(delay_ms),
                                slow_keys=frozenset(k for k in slow_keys.split(",") if k),
                                slow_delay=slow_delay_ms / 1000, seed=seed, poison_hold=poison_hold_ms / 1000),
            subscription_plan=SubscriptionPlan(ack_deadline, min_backoff, max_backoff, dead_letter_topic,
                                               max_delivery_attempts),
            subscriber_id=subscriber_id or f"{socket.gethostname()}-{os.getpid()}",
            expect=load_expectations(expect_file) if expect_file else None)
        line = ProgressLine(interval=progress_interval) if progress else None
        kafka = {**endpoints.kafka_config(), **_kafka_settings(kafka_settings),
                 "bootstrap.servers": endpoints.bootstrap}
        run = ProbeRun(kafka,
                       endpoints.redis_url, opts,
                       progress=line.update if line else None)
        with _stopping_on_signals(run.stop):
            try:
                summary = run.run()
            finally:
                if line:
                    line.close()
    except (OrderingLayerError, RedisError, KafkaException) as exc:  # the servers' errors too: exit status 2
        raise ProbeError(f"{type(exc).__name__}: {exc}") from exc
    text = json.dumps(summary, indent=2)
    if summary_file is not None:
        summary_file.write_text(text + "\n")
        verdict = summary.get("verdict", {})
        click.echo(f"{'OK' if summary['ok'] else 'FAILED'}: violations {verdict.get('violations', {})}, "
                   f"lost {verdict.get('lost_messages', 0)}; summary in {summary_file}", err=True)
    else:
        click.echo(text)
    if not summary["ok"]:
        sys.exit(1)


@contextlib.contextmanager
def _stopping_on_signals(stop: threading.Event) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM set ``stop`` (the run ends and still reports)."""
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda *_: stop.set())
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
