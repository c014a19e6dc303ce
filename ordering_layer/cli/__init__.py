"""The ``ordering-layer`` command line (click)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import click

from ordering_layer.admin import Admin
from ordering_layer.cli import schedule as schedule_commands
from ordering_layer.cli.seek import seek_command, snapshot_group
from ordering_layer.cli.servers import ENV_REDIS, ServerOptions, server_options
from ordering_layer.config import DEFAULT_SNAPSHOT_TOPIC, DeadLetterPolicy, PushConfig, RetryPolicy, StartPosition
from ordering_layer.demo import run as run_demo
from ordering_layer.describe_table import render_description
from ordering_layer.errors import OrderingLayerError
from ordering_layer.prober.cli import prober_command
from ordering_layer.publisher import OrderedProducer
from ordering_layer.push.cli import push_command
from ordering_layer.stack import get_backend
from ordering_layer.stack.base import BROKER_COUNTS
from ordering_layer.state.client import mask_url
from ordering_layer.subscriber import Subscriber


def _stack_option(func: Any) -> Any:
    func = click.option("--state-dir", type=click.Path(path_type=Path), default=None,
                        help="Folder of the local stack's state (default: $ORDERING_LAYER_STACK_DIR "
                             "or ~/.cache/ordering-layer/stack).")(func)
    return click.option("--backend", default=None, help="Stack backend (default: $ORDERING_LAYER_STACK or local).")(
        func)


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level.")
def main(verbose: bool) -> None:
    """ordering-layer: Pub/Sub-style ordered delivery on Apache Kafka + Redis."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# -- stack -----------------------------------------------------------------------------------------
@main.group()
def stack() -> None:
    """The local Kafka + Redis, optionally a Spark cluster (start, stop, status, env, kill and start one broker)."""


@stack.command("up")
@click.option("--brokers", type=click.Choice([str(n) for n in BROKER_COUNTS]), default=None,
              help="1 broker, or a 3-broker KRaft cluster (topics get 3 replicas, min ISR 2). "
                   "Default: the running stack's count, else 1.")
@_stack_option
@click.option("--redis-cluster", is_flag=True, default=None,
              help="Redis as a three-master Redis Cluster (default: $ORDERING_LAYER_REDIS_CLUSTER).")
@click.option("--secure", is_flag=True, default=None,
              help="TLS with a CA made here, Kafka SASL/SCRAM and a Redis ACL user; one broker only "
                   "(default: $ORDERING_LAYER_SECURE).")
@click.option("--spark-cluster", is_flag=True,
              help="Also a Spark standalone master and worker (1 core, 1g) from the installed pyspark, "
                   "for spark-submit --master; kept until 'stack down'.")
def stack_up(brokers: str | None, state_dir: Path | None, backend: str | None, redis_cluster: bool | None,
             secure: bool | None, spark_cluster: bool) -> None:
    """Start the local Kafka broker(s) and Redis (harmless when they run already)."""
    try:
        chosen = get_backend(backend, state_dir, redis_cluster=redis_cluster, secure=secure)
        endpoints = chosen.up(int(brokers) if brokers else None)
        if spark_cluster:
            chosen.start_spark()
            endpoints = chosen.endpoints()
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"Kafka  {endpoints.bootstrap}\nRedis  {mask_url(endpoints.redis_url)}")
    if endpoints.spark_master:
        click.echo(f"Spark  {endpoints.spark_master}")
    if endpoints.kafka_config_file:
        click.echo(f"Kafka client settings  {endpoints.kafka_config_file}\n"
                   "Client settings with secrets: eval \"$(ordering-layer stack env)\"")
    click.echo("Stop it with: ordering-layer stack down")


@stack.command("kill-broker")
@click.argument("node", type=click.IntRange(min=1))
@_stack_option
def stack_kill_broker(node: int, state_dir: Path | None, backend: str | None) -> None:
    """Kill broker NODE (1-based) with SIGKILL; its id, address and data stay for start-broker."""
    try:
        get_backend(backend, state_dir).stop_broker(node=node, kill=True)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"broker {node} killed")


@stack.command("start-broker")
@click.argument("node", type=click.IntRange(min=1))
@_stack_option
def stack_start_broker(node: int, state_dir: Path | None, backend: str | None) -> None:
    """Start broker NODE again (same id, address and data) and wait until it answers."""
    try:
        get_backend(backend, state_dir).start_broker(node=node)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"broker {node} runs")


@stack.command("down")
@_stack_option
def stack_down(state_dir: Path | None, backend: str | None) -> None:
    """Stop the local stack and remove its data."""
    get_backend(backend, state_dir).down()
    click.echo("stack stopped")


@stack.command("status")
@_stack_option
def stack_status(state_dir: Path | None, backend: str | None) -> None:
    """Show whether each service runs, and where (JSON)."""
    status = get_backend(backend, state_dir).status()
    click.echo(json.dumps(status, indent=2))
    if not status.get("up"):
        sys.exit(1)


@stack.command("env")
@_stack_option
def stack_env(state_dir: Path | None, backend: str | None) -> None:
    """Print export lines for ORDERING_LAYER_BOOTSTRAP, ORDERING_LAYER_REDIS_URL (with its password),
    for a secured stack ORDERING_LAYER_KAFKA_CONFIG and, with a Spark cluster, ORDERING_LAYER_SPARK_MASTER."""
    try:
        endpoints = get_backend(backend, state_dir).endpoints()
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo("\n".join(endpoints.env_lines()))


# -- topics ----------------------------------------------------------------------------------------
@main.group()
def topic() -> None:
    """Topics (created with broker append time)."""


@topic.command("create")
@click.argument("name")
@click.option("--partitions", type=click.IntRange(min=1), default=1, show_default=True)
@server_options
def topic_create(name: str, partitions: int, servers: ServerOptions) -> None:
    """Create topic NAME."""
    endpoints = servers.endpoints()
    try:
        described = Admin(endpoints.kafka_config()).create_topic(name, partitions=partitions)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"created {described.name}: {described.partitions} partitions, {described.timestamp_type}")


@topic.command("expand")
@click.argument("name")
@click.option("--partitions", type=click.IntRange(min=2), required=True, help="The new partition count.")
@server_options
def topic_expand(name: str, partitions: int, servers: ServerOptions) -> None:
    """Add partitions to topic NAME, recording the growth so that running subscribers keep each moved
    key in order (SUB-8)."""
    try:
        admin = _admin(servers)
        described = admin.add_partitions(name, partitions)
        history = admin.partition_counts(name)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{described.name}: {described.partitions} partitions (history: "
               f"{', '.join(str(count) for count, _ in history)})")


@topic.command("describe")
@click.argument("name")
@server_options
def topic_describe(name: str, servers: ServerOptions) -> None:
    """Describe topic NAME (JSON)."""
    endpoints = servers.endpoints()
    try:
        described = Admin(endpoints.kafka_config()).describe_topic(name)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps({"name": described.name, "partitions": described.partitions,
                           "replication_factor": described.replication_factor,
                           "config": described.config}, indent=2))


# -- publish ---------------------------------------------------------------------------------------
@main.command("publish")
@click.argument("topic_name")
@click.option("--file", "source", type=click.File("r"), default="-", help="Lines to publish (default: stdin).")
@click.option("--ordering-key", default=None, help="One ordering key for every line.")
@click.option("--key-separator", default=None,
              help="Split each line at the first SEPARATOR into ordering key and data (e.g. a tab).")
@server_options
def publish(topic_name: str, source: TextIO, ordering_key: str | None, key_separator: str | None,
            servers: ServerOptions) -> None:
    """Publish each line of a file or stdin as one message of TOPIC_NAME."""
    endpoints = servers.endpoints()
    count = 0
    try:
        with OrderedProducer(endpoints.kafka_config()) as producer:
            futures = []
            for line in source:
                line = line.rstrip("\n")
                key = ordering_key
                if key_separator and key_separator in line:
                    key, line = line.split(key_separator, 1)
                futures.append(producer.publish(topic_name, line.encode(), ordering_key=key))
            for future in futures:
                result = future.result()
                count += 1
                click.echo(f"{result.message_id}\tseq={result.sequence_number}\tpartition={result.partition}"
                           f"\toffset={result.offset}\t{result.enqueued_time.isoformat()}")
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"published {count} messages", err=True)


# -- demo ------------------------------------------------------------------------------------------
@main.command("demo")
@click.option("--messages", type=click.IntRange(min=1), default=20_000, show_default=True)
@click.option("--keys", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--partitions", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--spark/--no-spark", default=True, show_default=True, help="Include the Spark step.")
@server_options
def demo(messages: int, keys: int, partitions: int, spark: bool, servers: ServerOptions) -> None:
    """The main job end to end on the local stack (started if needed)."""
    if not servers.bootstrap:
        get_backend().up()
    endpoints = servers.endpoints()
    ok = run_demo(endpoints, messages=messages, keys=keys, partitions=partitions, out=click.echo, spark=spark)
    if not ok:
        sys.exit(1)


# -- subscriptions -----------------------------------------------------------------------------------
def _admin(servers: ServerOptions, snapshot_topic: str = DEFAULT_SNAPSHOT_TOPIC) -> Admin:
    endpoints = servers.endpoints()
    if not endpoints.redis_url:
        raise click.ClickException(f"subscriptions need Redis: --redis-url or ${ENV_REDIS}")
    return Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url, snapshot_topic=snapshot_topic)


@main.group()
def subscription() -> None:
    """Subscriptions: settings, backlog, outstanding, committed offsets; seek to a time or a snapshot."""


@subscription.command("create")
@click.argument("name")
@click.option("--topic", required=True)
@click.option("--ordering/--no-ordering", default=True, show_default=True, help="Per-key order (fixed).")
@click.option("--ack-deadline", type=float, default=10.0, show_default=True, help="Seconds, 10..600.")
@click.option("--min-backoff", type=float, default=10.0, show_default=True)
@click.option("--max-backoff", type=float, default=600.0, show_default=True)
@click.option("--dead-letter-topic", default=None)
@click.option("--max-delivery-attempts", type=int, default=5, show_default=True)
@click.option("--dead-letter-mode", type=click.Choice(["forward", "park_key"]), default="forward", show_default=True)
@click.option("--start", type=click.Choice(["TRIM_HORIZON", "LATEST"]), default="TRIM_HORIZON", show_default=True)
@click.option("--push-endpoint", default=None, help="Make it a push subscription: POST each message here "
              "(run the pusher with 'ordering-layer push NAME').")
@click.option("--push-no-wrapper", is_flag=True, help="POST the raw payload with attributes as headers.")
@click.option("--push-timeout", type=float, default=30.0, show_default=True, help="Seconds per request.")
@click.option("--push-concurrency", type=click.IntRange(min=1), default=100, show_default=True,
              help="Requests in flight per pusher at most.")
@click.option("--push-token-file", type=click.File("r"), default=None,
              help="File holding a static bearer token (read from a file: not in the shell history).")
@click.option("--push-jwt-key-file", type=click.File("r"), default=None,
              help="PEM private key signing a JWT per request (audience: the endpoint).")
@click.option("--push-jwt-algorithm", default="RS256", show_default=True)
@click.option("--push-jwt-issuer", default="ordering-layer", show_default=True)
@click.option("--push-jwt-key-id", default=None, help="The JWT header's kid.")
@click.option("--push-ca-bundle", type=click.File("r"), default=None,
              help="PEM CA certificates to verify the endpoint's certificate with (default: the system's).")
@server_options
def subscription_create(name: str, topic: str, ordering: bool, ack_deadline: float, min_backoff: float,
                        max_backoff: float, dead_letter_topic: str | None, max_delivery_attempts: int,
                        dead_letter_mode: str, start: str, push_endpoint: str | None, push_no_wrapper: bool,
                        push_timeout: float, push_concurrency: int, push_token_file: TextIO | None,
                        push_jwt_key_file: TextIO | None, push_jwt_algorithm: str, push_jwt_issuer: str,
                        push_jwt_key_id: str | None, push_ca_bundle: TextIO | None, servers: ServerOptions) -> None:
    """Create subscription NAME of --topic (a push subscription with --push-endpoint)."""
    try:
        push_config = PushConfig(
            push_endpoint, no_wrapper=push_no_wrapper, request_timeout=push_timeout,
            max_concurrent_requests=push_concurrency,
            bearer_token=push_token_file.read().strip() if push_token_file else None,
            jwt_private_key=push_jwt_key_file.read() if push_jwt_key_file else None,
            jwt_algorithm=push_jwt_algorithm, jwt_issuer=push_jwt_issuer, jwt_key_id=push_jwt_key_id,
            ca_bundle=push_ca_bundle.read() if push_ca_bundle else None) if push_endpoint else None
        settings = _admin(servers).create_subscription(
            name, topic=topic, enable_message_ordering=ordering, ack_deadline=ack_deadline,
            retry_policy=RetryPolicy(min_backoff, max_backoff),
            dead_letter_policy=DeadLetterPolicy(dead_letter_topic, max_delivery_attempts, dead_letter_mode)
            if dead_letter_topic else None,
            start=StartPosition.TRIM_HORIZON if start == "TRIM_HORIZON" else StartPosition.LATEST,
            push_config=push_config)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(settings.public(), sort_keys=True))


@subscription.command("describe")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@server_options
def subscription_describe(name: str, as_json: bool, servers: ServerOptions) -> None:
    """Settings and, per partition: owner, epoch, committed offset, log end, backlog, outstanding
    messages, oldest unacked age, held and parked keys."""
    try:
        described = _admin(servers).describe_subscription(name)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(described.to_json(), indent=2) if as_json else render_description(described))


@subscription.command("delete")
@click.argument("name")
@server_options
def subscription_delete(name: str, servers: ServerOptions) -> None:
    """Delete subscription NAME (its settings, state and consumer group)."""
    try:
        _admin(servers).delete_subscription(name)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"deleted {name}")


@main.command("pull")
@click.argument("subscription_name")
@click.option("--max-messages", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for messages.")
@click.option("--ack/--no-ack", default=True, show_default=True)
@server_options
def pull(subscription_name: str, max_messages: int, timeout: float, ack: bool, servers: ServerOptions) -> None:
    """Pull up to --max-messages of SUBSCRIPTION_NAME, print them, and ack them."""
    endpoints = servers.endpoints()
    try:
        with Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url) as subscriber:
            messages = subscriber.pull(subscription_name, max_messages=max_messages, timeout=timeout)
            for message in messages:
                click.echo(f"{message.ordering_key or '-'}\tseq={message.sequence_number}\t"
                           f"attempt={message.delivery_attempt}\t{message.message_id}\t"
                           f"{message.data.decode(errors='replace')}")
                if ack:
                    message.ack_with_response().result(30)
                else:
                    message.nack()
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{len(messages)} messages{' acked' if ack else ' nacked'}", err=True)


# -- dead letters ----------------------------------------------------------------------------------
@main.group()
def deadletter() -> None:
    """A subscription's dead letters."""


@deadletter.command("list")
@click.argument("subscription_name")
@server_options
def deadletter_list(subscription_name: str, servers: ServerOptions) -> None:
    """List the dead letters of SUBSCRIPTION_NAME, in order."""
    try:
        letters = _admin(servers).list_dead_letters(subscription_name)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    for letter in letters:
        click.echo(f"{letter.ordering_key or '-'}\t{letter.source_topic}:{letter.source_partition}:"
                   f"{letter.source_offset}\t{letter.reason}\tattempts={letter.delivery_attempts}\t"
                   f"{letter.last_error or ''}")
    click.echo(f"{len(letters)} dead letters", err=True)


@deadletter.command("redrive")
@click.argument("subscription_name")
@click.option("--topic", default=None, help="Republish here instead of the source topic.")
@server_options
def deadletter_redrive(subscription_name: str, topic: str | None, servers: ServerOptions) -> None:
    """Republish the dead letters not redriven yet, per key in their original order."""
    try:
        letters = _admin(servers).redrive_dead_letters(subscription_name, topic=topic)
    except OrderingLayerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"redrove {len(letters)} dead letters")


main.add_command(schedule_commands.schedule)
main.add_command(schedule_commands.scheduler)
subscription.add_command(seek_command(server_options, _admin))
main.add_command(snapshot_group(server_options, _admin))

# -- push and prober -------------------------------------------------------------------------------
main.add_command(push_command(server_options))
main.add_command(prober_command(server_options))
