"""Receiving with per-key order, per-message acks and cascade redelivery."""

from ordering_layer.subscriber.consumer import OrderedConsumer
from ordering_layer.subscriber.message import AckResponse, Message
from ordering_layer.subscriber.subscriber import StreamingPullFuture, Subscriber

__all__ = ["AckResponse", "Message", "OrderedConsumer", "StreamingPullFuture", "Subscriber"]
