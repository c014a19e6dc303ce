"""Publishing with ordering keys."""

from ordering_layer.publisher.producer import OrderedProducer, PublishResult, sequence_number

__all__ = ["OrderedProducer", "PublishResult", "sequence_number"]
