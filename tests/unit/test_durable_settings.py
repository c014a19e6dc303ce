"""The ``Subscription`` record of the durable settings copy (``schemas/subscription.avsc``)."""

from __future__ import annotations

import pytest

from ordering_layer.config import DeadLetterPolicy, RetryPolicy, SubscriptionSettings
from ordering_layer.errors import RecordFormatError
from ordering_layer.state.durable import decode_settings, encode_settings


@pytest.mark.parametrize("settings", [
    SubscriptionSettings(topic="orders"),
    SubscriptionSettings(topic="orders", enable_message_ordering=False, ack_deadline=42.5,
                         retry_policy=RetryPolicy(0.5, 7.0),
                         dead_letter_policy=DeadLetterPolicy("orders.dlq", 9, "park_key"),
                         max_lease_duration=120.0, min_duration_per_lease_extension=10.0,
                         max_duration_per_lease_extension=600.0),
])
def test_settings_survive_the_record(settings: SubscriptionSettings) -> None:
    """SUB-3: every setting of a subscription, dead-letter policy included, reads back equal."""
    assert decode_settings(encode_settings("orders-billing", settings)) == ("orders-billing", settings)


def test_a_foreign_value_is_refused() -> None:
    """A value that is no Subscription record raises RecordFormatError."""
    with pytest.raises(RecordFormatError):
        decode_settings(b"not a record")
