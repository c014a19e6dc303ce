"""Push subscriptions (PSH-1..3): each message POSTed to an HTTP endpoint, as Pub/Sub push does.

``request`` makes a message's request (Pub/Sub's JSON push body, or the raw payload with attribute
headers) and says which answers ack; ``auth`` the ``Authorization`` header (static bearer token, or
a short-lived JWT signed with the subscription's key); ``gate`` the backoff while the endpoint
cannot be reached; ``acks`` sends the acks of one pass of the pusher's event loop together;
``pusher`` runs it all on the subscriber engine with an asyncio HTTP client; ``stages`` marks each
message at each step, to see where time goes; ``cli`` is ``ordering-layer push SUBSCRIPTION``.
A subscription becomes a push subscription through
``Admin.create_subscription(..., push_config=PushConfig(...))``.
"""

from ordering_layer.config import PushConfig
from ordering_layer.push.pusher import Pusher

__all__ = ["PushConfig", "Pusher"]
