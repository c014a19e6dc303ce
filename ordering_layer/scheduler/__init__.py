"""Scheduled messages (PUB-5): schedule records in Kafka, a time index in Redis, and schedulers.

The scheduler publishes through the producer it is given (``scheduler.Publisher``);
``publisher.activation`` gives it an ``OrderedProducer``. ``settings`` and ``records`` are light:
the front ends import them for their settings and results.
"""
