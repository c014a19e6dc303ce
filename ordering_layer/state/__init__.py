"""Subscriber state in Redis: settled offsets, attempts, leases, epochs, subscription settings."""

from ordering_layer.state.store import ApplyResult, ClaimedPartition, StateStore

__all__ = ["ApplyResult", "ClaimedPartition", "StateStore"]
