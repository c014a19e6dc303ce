"""``ordering-layer schedule`` (publish at a time, ``cancel``, ``list``) and ``ordering-layer scheduler``."""

from __future__ import annotations

import signal
import threading
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO

import click

from ordering_layer.cli.servers import ENV_BOOTSTRAP, ENV_REDIS, render_table, resolve_endpoints
from ordering_layer.config import DEFAULT_SCHEDULE_TOPIC
from ordering_layer.errors import OrderingLayerError
from ordering_layer.publisher import OrderedProducer
from ordering_layer.publisher.activation import Scheduler
from ordering_layer.record import display_key
from ordering_layer.scheduler.book import ScheduleBook
from ordering_layer.scheduler.settings import SchedulerSettings
from ordering_layer.stack import Endpoints


def _options(func: Any) -> Any:
    func = click.option("--schedule-topic", default=DEFAULT_SCHEDULE_TOPIC, show_default=True,
                        help="The compacted topic of scheduled messages.")(func)
    func = click.option("--bootstrap", envvar=ENV_BOOTSTRAP, default=None,
                        help=f"Kafka bootstrap servers (default: ${ENV_BOOTSTRAP}, then the local stack).")(func)
    return click.option("--redis-url", envvar=ENV_REDIS, default=None,
                        help=f"Redis URL (default: ${ENV_REDIS}, then the local stack).")(func)


def _endpoints(bootstrap: str | None, redis_url: str | None) -> Endpoints:
    endpoints = resolve_endpoints(bootstrap, redis_url)
    if not endpoints.redis_url:
        raise click.ClickException(f"scheduled messages need Redis: --redis-url or ${ENV_REDIS}")
    return endpoints


def _book(bootstrap: str | None, redis_url: str | None, schedule_topic: str) -> ScheduleBook:
    endpoints = _endpoints(bootstrap, redis_url)
    return ScheduleBook(endpoints.kafka_config(), endpoints.redis_url,
                        SchedulerSettings(schedule_topic=schedule_topic))


def parse_when(at: str | None, delay: float | None, now: datetime) -> datetime:
    """``--at`` (ISO 8601; without a zone it is UTC) or ``--in`` seconds from ``now``; exactly one."""
    if (at is None) == (delay is None):
        raise click.UsageError("give exactly one of --at and --in")
    if delay is not None:
        return now + timedelta(seconds=delay)
    assert at is not None
    try:
        when = datetime.fromisoformat(at)
    except ValueError as exc:
        raise click.BadParameter(f"not an ISO 8601 time: {at!r}", param_hint="--at") from exc
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


class _PublishByDefault(click.Group):
    """``schedule TOPIC ...`` means ``schedule publish TOPIC ...``; ``cancel`` and ``list`` are subcommands."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["publish", *args]
        return super().parse_args(ctx, args)


@click.group("schedule", cls=_PublishByDefault)
def schedule() -> None:
    """Scheduled messages: `schedule TOPIC --in 60 --data ...`, `schedule cancel ID`, `schedule list`."""


@schedule.command("publish")
@click.argument("topic_name")
@click.option("--at", default=None, help="When to publish, ISO 8601 (UTC when no zone is given).")
@click.option("--in", "delay", type=float, default=None, help="Publish this many seconds from now.")
@click.option("--data", default=None, help="The payload (UTF-8); default: read --file.")
@click.option("--file", "source", type=click.File("rb"), default="-", help="Payload file (default: stdin).")
@click.option("--ordering-key", default=None)
@click.option("--attribute", "attributes", multiple=True, help="NAME=VALUE, repeatable.")
@_options
def schedule_publish(topic_name: str, at: str | None, delay: float | None, data: str | None, source: BinaryIO,
                     ordering_key: str | None, attributes: tuple[str, ...], schedule_topic: str,
                     bootstrap: str | None, redis_url: str | None) -> None:
    """Publish a message to TOPIC_NAME at a time; print its schedule id."""
    when = parse_when(at, delay, datetime.now(UTC))
    pairs = dict(a.split("=", 1) for a in attributes if "=" in a)
    if len(pairs) != len(attributes):
        raise click.BadParameter("attributes are NAME=VALUE", param_hint="--attribute")
    payload = data.encode() if data is not None else source.read()
    endpoints = _endpoints(bootstrap, redis_url)
    try:
        with OrderedProducer(endpoints.kafka_config(), redis_url=endpoints.redis_url,
                             settings={"scheduler": False, "schedule_topic": schedule_topic}) as producer:
            schedule_id = producer.schedule(topic_name, payload, ordering_key, pairs or None, enqueue_at=when)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(schedule_id)
    click.echo(f"scheduled for {when.isoformat()}", err=True)


@schedule.command("cancel")
@click.argument("schedule_id")
@_options
def schedule_cancel(schedule_id: str, schedule_topic: str, bootstrap: str | None, redis_url: str | None) -> None:
    """Cancel scheduled message SCHEDULE_ID; exit 1 when it was already enqueued or is unknown."""
    book = _book(bootstrap, redis_url, schedule_topic)
    try:
        result = book.cancel(schedule_id)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        book.close()
    click.echo(result.value)
    if result.value != "cancelled":
        raise SystemExit(1)


@schedule.command("list")
@_options
def schedule_list(schedule_topic: str, bootstrap: str | None, redis_url: str | None) -> None:
    """The scheduled messages not yet activated nor cancelled, by enqueue time (a table)."""
    book = _book(bootstrap, redis_url, schedule_topic)
    try:
        pending = book.pending()
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        book.close()
    rows = [[m.schedule_id, m.enqueue_at.isoformat(timespec="milliseconds"), m.topic,
             display_key(m.ordering_key) or "-", "activating" if claimed else "pending", str(len(m.data))]
            for m, claimed in pending]
    click.echo(render_table(["SCHEDULE ID", "ENQUEUE AT", "TOPIC", "ORDERING KEY", "STATE", "BYTES"], rows))
    click.echo(f"{len(rows)} scheduled messages", err=True)


@click.command("scheduler")
@click.option("--lease", type=float, default=SchedulerSettings.lease, show_default=True,
              help="Seconds a claim of due messages lasts (a crashed scheduler's come back after it).")
@click.option("--batch", type=click.IntRange(min=1), default=SchedulerSettings.batch, show_default=True)
@_options
def scheduler(lease: float, batch: int, schedule_topic: str, bootstrap: str | None, redis_url: str | None) -> None:
    """Run a dedicated scheduler: activate due scheduled messages until SIGTERM or Ctrl-C."""
    endpoints = _endpoints(bootstrap, redis_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        running = Scheduler(endpoints.kafka_config(), endpoints.redis_url,
                            settings=SchedulerSettings(schedule_topic=schedule_topic, lease=lease, batch=batch))
        running.start()
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"scheduler running on {schedule_topic}", err=True)
    try:
        stop.wait()
    finally:
        running.stop()
    click.echo(f"scheduler stopped after {running.activated} activations", err=True)
