"""Generated records and user actions for the subscriber fuzz test (``test_fuzz.py``).

Hypothesis draws a small ``Profile`` per example (shares of each kind of key, value and header,
subscription flags, a seed); ``build`` expands it with ``random.Random(seed)`` into hundreds of
records, so an example stays a handful of choices however large its batch is, and the printed
profile reproduces the batch exactly. Each record carries the script of what user code does on
its n-th delivery.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, NamedTuple

from confluent_kafka import Producer
from hypothesis import strategies as st

from ordering_layer import OrderedProducer
from ordering_layer.record import HeaderPairs

#: Largest value written: a record must also fit, with its headers, in the dead-letter topic.
MAX_VALUE = 900_000
SHARES = (0.0, 0.05, 0.2, 0.5, 1.0)

#: What user code does with a delivery. The last action of a script repeats for later attempts.
SETTLING = ("ack", "ack_with_response", "double_ack", "deadline_then_ack")
FAILING = ("nack", "deadline_zero", "ack_after_nack", "raise")

#: ``ol-`` headers no layer writes: each must be ignored, never refuse or settle the record (DLQ-4).
MALFORMED: list[tuple[str, str | bytes | None]] = [
    ("ol-partition-count", b"x"), ("ol-partition-count", b"0"), ("ol-partition-count", b"-3"),
    ("ol-partition-count", b"99999999999999999999999"), ("ol-partition-count", None), ("ol-partition-count", b""),
    ("ol-message-id", b"\xff"), ("ol-message-id", b""), ("ol-message-id", b"i" * 300), ("ol-message-id", None),
    ("ol-unknown", b"\x00"), ("ol-", b"?"),
]


class Profile(NamedTuple):
    """One example: the subscription and the mix of records and actions, expanded from ``seed``."""

    seed: int
    records: int
    partitions: int
    ordered: bool
    dead_letter: bool
    pull: bool
    keys: int  # size of the UTF-8 key pool
    plain_share: float  # written by a plain confluent-kafka Producer, the rest by OrderedProducer
    unkeyed_share: float  # no key (absent, or empty from the plain producer)
    odd_key_share: float  # plain records keyed by a non-UTF-8 or 1-2 KiB key
    header_share: float  # plain records with many, huge, binary or null headers
    malformed_share: float  # plain records with malformed ol- headers
    big_values: int  # values of 800-900 KB
    failing_share: float  # records whose first deliveries fail (1-3 times)
    poison_share: float  # records that always fail (dead-letter subscriptions only)


def profiles(records: tuple[int, int]) -> st.SearchStrategy[Profile]:
    """Profiles with ``records`` (min, max) records each."""
    share = st.sampled_from(SHARES)
    return st.builds(
        Profile, seed=st.integers(0, 2**32 - 1), records=st.integers(*records), partitions=st.integers(1, 4),
        ordered=st.booleans(), dead_letter=st.booleans(), pull=st.booleans(), keys=st.integers(1, 200),
        plain_share=share, unkeyed_share=share, odd_key_share=share, header_share=share, malformed_share=share,
        big_values=st.integers(0, 3), failing_share=share, poison_share=st.sampled_from((0.0, 0.01, 0.05)))


class Planned(NamedTuple):
    """A record to write and the script of user actions for its deliveries."""

    plain: bool
    key: bytes | None  # plain: the record key as written; layer: the ordering key's UTF-8 bytes
    value: bytes | None
    headers: list[tuple[str, str | bytes | None]]  # plain: headers; layer: attributes
    message_id: str | None  # layer only
    script: tuple[str, ...]
    deadline: float  # seconds for modify_ack_deadline in "deadline_then_ack"


class Written(NamedTuple):
    """A record as the broker stored it."""

    partition: int
    offset: int
    planned: Planned


def build(profile: Profile) -> list[Planned]:
    """The records of one example, in write order."""
    rng = random.Random(profile.seed)
    pool = [f"key-{n}" if n % 3 else f"ключ-{n}-🔑" for n in range(profile.keys)]
    odd = [b"\xff\xfe" + rng.randbytes(8), b"\xc3(" + b"z" * 5, b"K" * 1500, rng.randbytes(2048),
           "é".encode() * 600]
    big = set(rng.sample(range(profile.records), min(profile.big_values, profile.records)))
    return [_planned(rng, profile, pool, odd, i in big) for i in range(profile.records)]


def _planned(rng: random.Random, p: Profile, pool: list[str], odd: list[bytes], big: bool) -> Planned:
    plain = rng.random() < p.plain_share
    key: bytes | None = rng.choice(pool).encode()
    if rng.random() < p.unkeyed_share:
        key = rng.choice((None, b"")) if plain else None
    elif plain and rng.random() < p.odd_key_share:
        key = rng.choice(odd)
    value = _value(rng, plain, big)
    headers: list[tuple[str, str | bytes | None]] = []
    if plain and rng.random() < p.header_share:
        headers = _headers(rng, small=big)
    elif not plain and rng.random() < p.header_share:
        headers = [(f"a{i}", f"v{i}-é") for i in range(rng.randint(1, 30))]
    if plain and rng.random() < p.malformed_share:
        headers += rng.sample(MALFORMED, rng.randint(1, 4))
        rng.shuffle(headers)
    message_id = rng.choice((None, None, f"id-{rng.randrange(50)}")) if not plain else None
    return Planned(plain, key, value, headers, message_id, _script(rng, p), float(rng.randint(1, 600)))


def _value(rng: random.Random, plain: bool, big: bool) -> bytes | None:
    if big:
        return rng.randbytes(rng.randint(800_000, MAX_VALUE))
    kind = rng.random()
    if kind < 0.1:
        return None if plain else b""
    if kind < 0.2:
        return b""
    if kind < 0.25:
        return rng.randbytes(rng.randint(1_000, 64_000))
    return rng.randbytes(rng.randint(1, 200))


def _headers(rng: random.Random, small: bool) -> list[tuple[str, str | bytes | None]]:
    kind = rng.randrange(3) if not small else 2
    if kind == 0:  # many
        return [(f"h{i}", f"v{i}") for i in range(rng.randint(20, 300))]
    if kind == 1:  # huge
        return [(f"big{i}", rng.randbytes(rng.randint(1_000, 8_000))) for i in range(rng.randint(1, 10))]
    # binary, null, repeated and empty names and values
    odd: list[tuple[str, str | bytes | None]] = [
        ("bin", b"\xff\x00\xfe"), ("nil", None), ("dup", b"1"), ("dup", b"2"), ("", b"empty-name"), ("text", "é"),
        ("empty", b"")]
    return odd[:rng.randint(1, 7)]


def _script(rng: random.Random, p: Profile) -> tuple[str, ...]:
    if p.dead_letter and rng.random() < p.poison_share:
        return tuple(rng.choice(FAILING) for _ in range(rng.randint(1, 3)))
    failures = rng.randint(1, 3) if rng.random() < p.failing_share else 0
    return (*(rng.choice(FAILING) for _ in range(failures)), rng.choice(SETTLING))


def write(kafka_config: dict[str, Any], topic: str, planned: list[Planned]) -> dict[tuple[int, int], Written]:
    """Write the records with both producers, interleaved; return them by (partition, offset)."""
    written: dict[tuple[int, int], Written] = {}
    failures: list[str] = []
    # murmur2_random is the Java client's partitioner, which OrderedProducer uses too: a key's
    # records from both producers land in one partition, so its order is defined by offset.
    plain = Producer({**kafka_config, "partitioner": "murmur2_random", "enable.idempotence": True,
                      "linger.ms": 5})

    def recorder(item: Planned) -> Callable[[Any, Any], None]:
        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                failures.append(str(err))
            else:
                written[(msg.partition(), msg.offset())] = Written(msg.partition(), msg.offset(), item)
        return delivered

    futures = []
    with OrderedProducer(kafka_config) as layer:
        for item in planned:
            if item.plain:
                plain.produce(topic, item.value, item.key, headers=item.headers, on_delivery=recorder(item))
                plain.poll(0)
            else:
                key = item.key.decode() if item.key is not None else None
                attributes = {name: str(value) for name, value in item.headers}
                futures.append((item, layer.publish(topic, item.value or b"", key, attributes,
                                                    message_id=item.message_id)))
        for item, future in futures:
            result = future.result(timeout=60)
            written[(result.partition, result.offset)] = Written(result.partition, result.offset, item)
    assert plain.flush(60) == 0 and not failures, failures
    assert len(written) == len(planned)
    return written


def expected_headers(item: Planned) -> HeaderPairs | None:
    """The headers a plain record is fetched with (None when written without any)."""
    return list(item.headers) if item.headers else None
