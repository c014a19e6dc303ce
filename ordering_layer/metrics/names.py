"""Names, help texts and buckets of the layer's Prometheus metrics (the README has them as a table)."""

from __future__ import annotations

from typing import Final

PREFIX: Final = "ordering_layer_"

SUBSCRIPTION_LABELS: Final = ("subscription", "topic")
PARTITION_LABELS: Final = ("subscription", "topic", "partition")

# metrics_snapshot() counter field -> (metric name without _total, help)
COUNTERS: Final = {
    "delivered": ("messages_delivered", "Deliveries handed to user code (callback or pull), redeliveries included."),
    "acked": ("messages_acked", "Acks that took effect."),
    "nacked": ("messages_nacked", "Nacks (including modify_ack_deadline(0) and failed callbacks)."),
    "redelivered": ("messages_redelivered", "Deliveries with delivery_attempt > 1 (nack, lease expiry, cascade)."),
    "dead_lettered": ("messages_dead_lettered", "Messages written to the dead-letter topic."),
    "lease_extensions": ("lease_extensions", "Lease extensions made while user code held a message (ACK-2)."),
    "lease_lapses": ("lease_lapses", "Leases that reached their deadline unacked (ACK-1)."),
    "malformed_records": ("malformed_records", "Records whose ol- metadata was ignored (DLQ-4)."),
}

# metrics_snapshot() gauge field -> (metric name, help)
GAUGES: Final = {
    "outstanding": ("outstanding_messages", "Messages delivered and not yet settled at this process."),
    "held_keys": ("held_keys", "Ordering keys with a message outstanding at this process."),
}

# metrics_snapshot()["partitions"][p] field -> (metric name, help)
PARTITION_GAUGES: Final = {
    "outstanding": ("partition_outstanding_messages", "Messages of the partition outstanding at this process."),
    "buffered": ("partition_buffered_records", "Records fetched and waiting for release (held behind their key)."),
    "held_keys": ("partition_held_keys", "Ordering keys of the partition with a message outstanding."),
    "moved_keys_held": ("partition_moved_keys_held",
                        "Keys moved into the partition by a growth, waiting for their old partitions (SUB-8)."),
    "oldest_unacked_seconds": ("partition_oldest_unacked_age_seconds",
                               "Age of the partition's oldest unacked message at this process."),
}

BACKLOG: Final = ("partition_backlog_messages",
                  "Log end minus committed offset, for the partitions this process owns (read from Kafka, cached).")
PAUSED_KEYS: Final = ("paused_ordering_keys", "Ordering keys whose publishing is paused after a failure (PUB-2).")

_LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# metrics_snapshot() list field -> (histogram name, help, finite bucket bounds)
ENGINE_HISTOGRAMS: Final = {
    "ack_latency_seconds": ("ack_latency_seconds", "Delivery to ack, per acked message.",
                            (*_LATENCY_BUCKETS, 30.0, 60.0, 120.0, 300.0, 600.0)),
    "redis_flush_seconds": ("redis_flush_seconds", "One Redis pipeline of state writes (attempts, leases, acks).",
                            (0.0005, *_LATENCY_BUCKETS[:10])),
}
PUBLISH_LATENCY: Final = ("publish_latency_seconds",
                          "produce() to broker acknowledgement; sampled: records whose offset is a multiple of 64.",
                          (*_LATENCY_BUCKETS, 30.0))

# Pushers (ordering_layer.push): metrics_snapshot() with requests, keys_waiting, in_flight and
# request_latency_seconds; labels SUBSCRIPTION_LABELS, plus status_class for the requests.
PUSH_REQUESTS: Final = ("push_requests", "Push requests by outcome: status class 1xx..5xx, timeout, or error "
                                         "(no answer: connection refused or reset).")
PUSH_GAUGES: Final = {
    "keys_waiting": ("push_keys_waiting",
                     "Messages handed to the pusher and not yet sent (with ordering: one per key)."),
    "in_flight": ("push_requests_in_flight", "Push requests sent and not yet answered."),
}
PUSH_LATENCY: Final = ("push_request_latency_seconds", "One push request, sent to answered (or failed).",
                       (*_LATENCY_BUCKETS, 30.0, 60.0))
