"""The ordering prober (``ordering-layer prober``): publishes per-key sequences, consumes them like a
user would (random nacks, delays, slow keys), and verifies online that SUB-1, SUB-3, SUB-4, SUB-5
and ACK-6 held. ``verifier`` is the pure judge; ``events``/``eventlog`` the stream that lets several
subscriber processes feed one checker.
"""

from ordering_layer.prober.consumer import HandlerPlan, ProbeConsumer
from ordering_layer.prober.events import Delivery, Expectation, Fault, Settlement
from ordering_layer.prober.options import ProbeOptions, SubscriptionPlan
from ordering_layer.prober.publisher import ProbePublisher, PublishPlan
from ordering_layer.prober.runner import ProbeRun
from ordering_layer.prober.verifier import Verifier, Violation

__all__ = ["Delivery", "Expectation", "Fault", "HandlerPlan", "ProbeConsumer", "ProbeOptions", "ProbePublisher",
           "ProbeRun", "PublishPlan", "Settlement", "SubscriptionPlan", "Verifier", "Violation"]
