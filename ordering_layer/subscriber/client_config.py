"""The subscriber's Kafka settings: as its consumer takes them, as other clients of it take them; the
credential check and the layer's Redis URL.

The subscriber's settings feed its consumer; the dead-letter producer and the credential probe take
only their ``connection_settings``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ordering_layer.errors import ConfigError
from ordering_layer.kafka.auth import verify_kafka
from ordering_layer.kafka_config import connection_settings, read_kafka_config
from ordering_layer.scheduler.settings import REDIS_URL_ENV, redis_url_or_env

# librdkafka's fetch.queue.backoff.ms (default 1000): how long it postpones the next fetch of a
# partition once its local queue was over queued.min.messages. A consumer that drains the queue
# faster than that waits the rest of the second with an empty queue (measured: the history of
# bench/RESULTS.md); 10 ms refetches as soon as the subscriber has taken what was prefetched. A value in
# the user's settings wins.
FETCH_QUEUE_BACKOFF_MS = 10

# librdkafka's topic.metadata.refresh.interval.ms (default 300,000): partitions added to the topic
# are consumed only once the consumer's metadata shows them (SUB-8: within 15 s of a growth made by
# anyone; a moved key's new messages cannot go out before). A metadata request every 2 s per
# consumer; a value in the user's settings wins.
METADATA_REFRESH_MS = 2000

# librdkafka's max.partition.fetch.bytes (default 1 MiB): what one fetch response carries of each
# partition. A response's batches enter the fetch queue partition after partition, and the engine
# stops taking records at its buffer bound (``flow.FlowGate.max_buffered``): with 1 MiB, a backlog of
# small records in the first partitions of a response filled the buffer, and the keys of the later
# partitions got nothing until it drained (bench (f): 100 keys over 6 partitions started in four
# waves 0.5 s apart, 11,000 msg/s; with 256 KiB all started at once, 15,700). A single partition
# reads a little slower (one hot key: 203k vs 216k msg/s, within the noise of three rounds). A
# value in the user's settings wins.
MAX_PARTITION_FETCH_BYTES = 256 * 1024

# librdkafka's queued.max.messages.kbytes (default 64 MiB): how far it prefetches. It bounds the one
# consumer queue, but each partition queue on its own once the partitions' queues are apart, as the
# native fetch keeps them (``native_fetch``). The subscriber splits 64 MiB over the topic's
# partitions, at least 1 MiB each (4 fetch responses of ``MAX_PARTITION_FETCH_BYTES``), 8 MiB each
# when the count is not known. Less prefetch cost bench (a) throughput: callback 262k msg/s at 2 MiB
# a partition, 298-316k at 8 MiB and 302-347k at 64 MiB, over 6 partitions. A value in the user's
# settings wins (and queued.min.messages, librdkafka's 100,000 records, then applies per partition).
PREFETCH_KBYTES = 64 * 1024
MIN_PARTITION_PREFETCH_KBYTES = 1024
UNKNOWN_PARTITION_PREFETCH_KBYTES = 8 * 1024


def prefetch_kbytes(partitions: int | None) -> int:
    """queued.max.messages.kbytes for a topic of ``partitions`` partitions (None: not known)."""
    if not partitions:
        return UNKNOWN_PARTITION_PREFETCH_KBYTES
    return max(MIN_PARTITION_PREFETCH_KBYTES, PREFETCH_KBYTES // partitions)


def consumer_settings(kafka_config: Mapping[str, Any], subscription: str,
                      partitions: int | None = None) -> dict[str, Any]:
    """The engine's consumer settings: the user's (read as librdkafka reads them), with the group,
    commits, start and assignor the engine needs, and the layer's defaults for what the user did not
    set; ``partitions``: the topic's partition count, when known (``prefetch_kbytes``)."""
    conf = read_kafka_config(kafka_config)
    conf.update({"group.id": subscription, "enable.auto.commit": False, "enable.auto.offset.store": False,
                 "auto.offset.reset": "earliest", "partition.assignment.strategy": "cooperative-sticky"})
    conf.setdefault("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS)
    conf.setdefault("topic.metadata.refresh.interval.ms", METADATA_REFRESH_MS)
    conf.setdefault("max.partition.fetch.bytes", MAX_PARTITION_FETCH_BYTES)
    conf.setdefault("queued.max.messages.kbytes", prefetch_kbytes(partitions))
    conf.setdefault("logger", logging.getLogger("ordering_layer.kafka.consumer"))
    return conf


def verify_credentials(kafka_config: Mapping[str, Any]) -> None:
    """Fail fast when the brokers refuse the SASL login or the TLS handshake (see ``verify_kafka``).

    Raises:
        AuthenticationError: ``server="kafka"``: a broker refused the login or the handshake.
        ConfigError: confluent-kafka refused the config itself.
    """
    verify_kafka(connection_settings(kafka_config))


def redis_url_from(redis_url: str | None) -> str:
    """``redis_url`` or ``$ORDERING_LAYER_REDIS_URL``; ConfigError when neither is set."""
    url = redis_url_or_env(redis_url)
    if url is None:
        raise ConfigError(f"the layer's Redis is needed: pass redis_url= or set ${REDIS_URL_ENV}")
    return url
