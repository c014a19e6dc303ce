#!/usr/bin/env python
"""A producer written the way confluent-kafka-python's example producer is written: lines from
stdin, str keys and values, a delivery callback= that reports to stderr, a local queue small
enough to fill (BufferError handled by polling and trying again), len(p) while flushing.

test_idioms.py runs it as written and with the import line swapped for ordering_layer's.

Usage: producer.py <bootstrap-brokers> <topic>   (stdin: one "key<TAB>value" per line)
"""

import sys

from confluent_kafka import Producer

if __name__ == '__main__':
    if len(sys.argv) != 3:
        sys.stderr.write('Usage: %s <bootstrap-brokers> <topic>\n' % sys.argv[0])
        sys.exit(1)

    broker = sys.argv[1]
    topic = sys.argv[2]

    # Producer configuration; the small queue makes produce() raise BufferError now and then
    conf = {'bootstrap.servers': broker,
            'queue.buffering.max.messages': '20',
            'linger.ms': '50',
            'default.topic.config': {'acks': 'all'}}

    p = Producer(**conf)

    delivered = [0]

    # Optional per-message delivery callback (triggered by poll() or flush())
    def delivery_callback(err, msg):
        if err:
            sys.stderr.write('%% Message failed delivery: %s\n' % err)
        else:
            delivered[0] += 1
            sys.stderr.write('%% Message delivered to %s [%d] @ %d\n' %
                             (msg.topic(), msg.partition(), msg.offset()))

    full = 0
    for line in sys.stdin:
        key, _, value = line.rstrip('\n').partition('\t')
        while True:
            try:
                p.produce(topic, value, key, callback=delivery_callback)
                break
            except BufferError:
                full += 1
                sys.stderr.write('%% Local producer queue is full (%d messages awaiting delivery): '
                                 'try again\n' % len(p))
                p.poll(1)
        # Serve delivery callback queue.
        p.poll(0)

    # Wait until all messages have been delivered
    sys.stderr.write('%% Waiting for %d deliveries\n' % len(p))
    left = p.flush(30)
    print('delivered %d, left %d, queue full %d times' % (delivered[0], left, full))
