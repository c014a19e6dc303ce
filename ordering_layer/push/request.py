"""The HTTP request of one pushed message (PSH-1), and which answers ack it.

Wrapped (the default), the body is Pub/Sub's push request: JSON with ``message`` (``data`` in
base64, ``attributes``, ``messageId``, ``publishTime``, ``orderingKey``; ``message_id`` and
``publish_time`` too, as Pub/Sub sends both spellings), ``subscription`` and ``deliveryAttempt``.
With ``no_wrapper`` the body is the payload byte for byte and each attribute is a header of the
same name; an attribute that cannot be a header (a name that is no HTTP token, a value with control
characters, a name the request itself sets such as ``Authorization``) is left out, with a debug log.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from datetime import UTC, datetime
from typing import Final, NamedTuple, Protocol

_LOGGER = logging.getLogger(__name__)

# PSH-1: the answers that ack, as Pub/Sub push counts them; any other status nacks.
ACK_STATUSES: Final = frozenset({102, 200, 201, 202, 204})

JSON_TYPE: Final = "application/json"
RAW_TYPE: Final = "application/octet-stream"

# Headers the pusher or the HTTP client sets itself; an attribute of that name is not sent.
_OWN_HEADERS: Final = frozenset({"authorization", "content-type", "content-length", "host", "transfer-encoding",
                                 "connection", "expect", "upgrade", "te", "trailer", "keep-alive",
                                 "proxy-authorization", "proxy-connection", "accept-encoding", "cookie"})
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
# One encoder for every body: ``json.dumps`` with separators makes a new one per call.
_JSON: Final = json.JSONEncoder(separators=(",", ":"))
_string: Final = _JSON.encode  # a str as a JSON string (quoted, escaped)


class PushedMessage(Protocol):
    """What a request is made of: the fields of ``ordering_layer.Message`` it reads."""

    @property
    def data(self) -> bytes: ...
    @property
    def attributes(self) -> dict[str, str]: ...
    @property
    def message_id(self) -> str: ...
    @property
    def enqueued_time(self) -> datetime: ...
    @property
    def ordering_key(self) -> str: ...
    @property
    def delivery_attempt(self) -> int: ...


class PushRequest(NamedTuple):
    """The body and headers of one request (without ``Authorization``, added when it is sent)."""

    body: bytes
    headers: dict[str, str]


def publish_time(when: datetime) -> str:
    """RFC 3339 in UTC with milliseconds and a ``Z``, as Pub/Sub writes ``publishTime``."""
    return when.astimezone(UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def wrapped(message: PushedMessage, subscription: str) -> PushRequest:
    """Pub/Sub's JSON push request of ``message`` (see the module doc)."""
    # Written piece by piece (each text JSON-escaped by the C encoder): no dict built per message.
    message_id = _string(message.message_id)
    published = f'"{publish_time(message.enqueued_time)}"'
    parts = ['{"message":{"data":"', base64.b64encode(message.data).decode("ascii"), '","messageId":', message_id,
             ',"message_id":', message_id]
    attributes = message.attributes
    if attributes:
        parts += ',"attributes":', _JSON.encode(attributes)
    parts += ',"publishTime":', published, ',"publish_time":', published
    ordering_key = message.ordering_key
    if ordering_key:
        parts += ',"orderingKey":', _string(ordering_key)
    parts += '},"subscription":', _string(subscription), ',"deliveryAttempt":', str(message.delivery_attempt), "}"
    return PushRequest("".join(parts).encode(), {"Content-Type": JSON_TYPE})


def unwrapped(message: PushedMessage) -> PushRequest:
    """The raw payload of ``message`` with its attributes as headers (``no_wrapper``)."""
    headers = {"Content-Type": RAW_TYPE}
    for name, value in message.attributes.items():
        if name.lower() in _OWN_HEADERS or not _TOKEN.fullmatch(name) or _CONTROL.search(value):
            _LOGGER.debug("attribute %r of message %s cannot be an HTTP header; not sent", name, message.message_id)
            continue
        headers[name] = value
    return PushRequest(message.data, headers)


def build(message: PushedMessage, subscription: str, no_wrapper: bool) -> PushRequest:
    """The request of ``message``: ``unwrapped`` with ``no_wrapper``, else ``wrapped``."""
    return unwrapped(message) if no_wrapper else wrapped(message, subscription)
