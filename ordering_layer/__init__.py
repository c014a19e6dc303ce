"""ordering-layer: Pub/Sub-style ordered delivery on Apache Kafka + Redis."""

from ordering_layer.admin import Admin, TopicDescription
from ordering_layer.config import PublisherSettings
from ordering_layer.publisher import OrderedProducer, PublishResult

__all__ = ["Admin", "OrderedProducer", "PublishResult", "PublisherSettings", "TopicDescription"]
