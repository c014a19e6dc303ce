"""Kafka itself: topics, the layer's compacted topics, committed offsets and the key partitioner.

The layers above (state, scheduler, publisher, subscriber, admin) use Kafka through these modules
and the record format (``ordering_layer.record``); nothing here knows about Redis or subscriptions.
"""
