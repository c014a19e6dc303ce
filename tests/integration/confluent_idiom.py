"""A program in confluent-kafka's own idiom (DRP-1, DRP-2), run by test_interop.py twice: as it is,
and with its import line swapped for ``ordering_layer``'s wrappers. Nothing else changes.

Usage: python confluent_idiom.py BOOTSTRAP TOPIC GROUP COUNT  (prints one JSON line)
"""

import json
import sys

from confluent_kafka import Consumer, Producer

bootstrap, topic, group, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
failures = []
delivered = []


def delivery_report(err, msg):
    if err is not None:
        failures.append(str(err))
    else:
        delivered.append((msg.topic(), msg.partition(), msg.offset()))


producer = Producer(**{"bootstrap.servers": bootstrap, "linger.ms": 5})
for i in range(count):
    producer.produce(topic, f"value-{i}".encode(), f"key-{i % 10}", callback=delivery_report,
                     headers=[("n", str(i).encode())])
    producer.poll(0)
queued = len(producer)
left = producer.flush(30)

assigned = []


def on_assign(consumer, partitions):
    assigned.extend(tp.partition for tp in partitions)


consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest"})
consumer.subscribe([topic], on_assign=on_assign)
seen = []
while len(seen) < count:
    msg = consumer.poll(timeout=1.0)
    if msg is None:
        continue
    if msg.error():
        raise SystemExit(f"consumer error: {msg.error()}")
    headers = dict(msg.headers() or [])
    seen.append([msg.key().decode(), msg.value().decode(), int(headers["n"]), msg.partition(), msg.offset(),
                 msg.topic(), msg.timestamp()[1] > 0])
assignment = sorted(tp.partition for tp in consumer.assignment())
consumer.close()
print(json.dumps({"queued_before_flush": queued, "left": left, "failures": failures, "delivered": len(delivered),
                  "assigned": sorted(assigned), "assignment": assignment, "seen": seen}))
