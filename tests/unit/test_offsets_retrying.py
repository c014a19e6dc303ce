"""``offsets.retrying``: Kafka calls ride out a moving partition leader, other errors surface at once."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from ordering_layer.kafka.offsets import retrying


class Flaky:
    """Fails with ``code`` the first ``failures`` calls, then answers 42."""

    def __init__(self, code: int, failures: int) -> None:
        self.code = code
        self.failures = failures
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise KafkaException(KafkaError(self.code))
        return 42


def test_leader_moves_are_retried() -> None:
    """A watermark read during a failover (NOT_LEADER_FOR_PARTITION) is answered once a leader is back."""
    call = Flaky(KafkaError.NOT_LEADER_FOR_PARTITION, 3)
    assert retrying(call, timeout=10) == 42
    assert call.calls == 4


def test_other_errors_and_the_timeout_surface() -> None:
    """A non-retriable error is raised at the first call; a retriable one once the timeout passed."""
    fatal = Flaky(KafkaError.TOPIC_AUTHORIZATION_FAILED, 1)
    with pytest.raises(KafkaException):
        retrying(fatal, timeout=10)
    assert fatal.calls == 1
    stuck = Flaky(KafkaError.LEADER_NOT_AVAILABLE, 10**6)
    with pytest.raises(KafkaException):
        retrying(stuck, timeout=0.3)
    assert 1 < stuck.calls < 100
