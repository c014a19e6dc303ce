"""Scheduled messages (PUB-5): schedule records in Kafka, a time index in Redis, and schedulers.

Submodules are imported where used (``publisher.producer`` imports the light ``settings`` and
``participant`` modules; ``book`` imports ``publisher.producer``).
"""
