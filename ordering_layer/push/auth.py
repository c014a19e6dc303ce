"""The ``Authorization`` header of push requests (PSH-3): a static bearer token, or a JWT.

The JWT is signed with the subscription's private key (PyJWT): ``iss`` the configured issuer,
``sub`` the subscription, ``aud`` the endpoint, ``iat`` and a short ``exp``. One token serves
every request until half of its lifetime has passed, then a new one is signed (signing per request
would cost a millisecond of CPU each). Neither the token nor the key is ever logged; a key that
cannot be loaded is reported without its text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import jwt
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from ordering_layer.config import PushConfig
from ordering_layer.errors import ConfigError


class Authorizer:
    """Gives the ``Authorization`` header value of the next request, or None without auth.

    Args:
        config: the push settings (``bearer_token`` or ``jwt_private_key`` with its claims).
        subscription: the JWT's subject.
        clock: seconds since the epoch (tests pass their own).

    Raises:
        ConfigError: the private key cannot be loaded (not PEM, encrypted, or of another kind
            than ``jwt_algorithm`` signs with).
    """

    def __init__(self, config: PushConfig, subscription: str, clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._subscription = subscription
        self._clock = clock
        self._header: str | None = None if config.bearer_token is None else f"Bearer {config.bearer_token}"
        self._renew_at = float("inf") if config.jwt_private_key is None else 0.0
        self._key = None if config.jwt_private_key is None else self._load_key(config)

    @staticmethod
    def _load_key(config: PushConfig) -> object:
        assert config.jwt_private_key is not None
        try:
            key = load_pem_private_key(config.jwt_private_key.encode(), password=None)
            # Signs once here, so that a key of the wrong kind fails at start, not at the first request.
            jwt.encode({"check": True}, key, algorithm=config.jwt_algorithm)  # type: ignore[arg-type]
        except (ValueError, TypeError, NotImplementedError, jwt.PyJWTError) as exc:
            raise ConfigError(f"jwt_private_key cannot sign {config.jwt_algorithm} tokens "
                              f"({type(exc).__name__})") from None
        return key

    def header(self) -> str | None:
        """The header value for a request made now (None: the requests carry no Authorization)."""
        if self._key is not None:
            now = self._clock()
            if now >= self._renew_at:
                self._header = f"Bearer {self._sign(now)}"
                self._renew_at = now + self._config.jwt_lifetime / 2
        return self._header

    def _sign(self, now: float) -> str:
        config = self._config
        claims = {"iss": config.jwt_issuer, "sub": self._subscription, "aud": config.endpoint,
                  "iat": int(now), "exp": int(now + config.jwt_lifetime), "jti": uuid.uuid4().hex}
        headers = {"kid": config.jwt_key_id} if config.jwt_key_id else None
        return jwt.encode(claims, self._key, algorithm=config.jwt_algorithm, headers=headers)  # type: ignore[arg-type]
