"""ordering-layer: Pub/Sub-style ordered delivery on Apache Kafka + Redis."""

from ordering_layer.admin import Admin, TopicDescription
from ordering_layer.config import (
    DeadLetterPolicy,
    FlowControl,
    PublisherSettings,
    RetryPolicy,
    StartPosition,
    SubscriptionSettings,
)
from ordering_layer.publisher import OrderedProducer, PublishResult
from ordering_layer.publisher.activation import Scheduler
from ordering_layer.scheduler.records import CancelResult
from ordering_layer.scheduler.settings import SchedulerSettings
from ordering_layer.subscriber import AckResponse, Message, OrderedConsumer, StreamingPullFuture, Subscriber

__all__ = [
    "AckResponse", "Admin", "CancelResult", "DeadLetterPolicy", "FlowControl", "Message", "OrderedConsumer",
    "OrderedProducer", "PublishResult", "PublisherSettings", "RetryPolicy", "Scheduler", "SchedulerSettings",
    "StartPosition", "StreamingPullFuture", "Subscriber", "SubscriptionSettings", "TopicDescription",
]
