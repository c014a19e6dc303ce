#!/usr/bin/env python
"""A producer written the way confluent_kafka.aio's example is written: coroutine error_cb and
throttle_cb in the settings with a logger, AIOProducer(conf, max_workers=...) used as an async
context manager, each round of messages produced by tasks gathered together (each produce returns
the message's delivery future), then the delivery futures gathered, len(producer) and flush().

test_aio.py runs it as written and with the import line swapped for ordering_layer's.

Usage: aio_producer.py <bootstrap-brokers> <topic>   (stdin: one "key<TAB>value" per line)
"""

import asyncio
import logging
import sys

from confluent_kafka.aio import AIOProducer

logging.basicConfig()
logger = logging.getLogger('aio_producer')
logger.setLevel(logging.INFO)

ROUND = 100


async def error_cb(err):
    logger.error(f'Kafka error: {err}')


async def throttle_cb(event):
    logger.warning(f'Kafka throttle event: {event}')


async def run_producer(broker, topic, lines):
    conf = {'bootstrap.servers': broker,
            'logger': logger,
            'error_cb': error_cb,
            'throttle_cb': throttle_cb,
            'linger.ms': 20}
    delivered = 0
    failed = 0
    async with AIOProducer(conf, max_workers=2, batch_size=ROUND // 2) as producer:
        for start in range(0, len(lines), ROUND):
            produce_futures = [asyncio.create_task(producer.produce(topic=topic, key=key, value=value))
                               for key, value in lines[start:start + ROUND]]
            delivery_futures = await asyncio.gather(*produce_futures)
            results = await asyncio.gather(*delivery_futures, return_exceptions=True)
            for msg in results:
                if isinstance(msg, Exception):
                    failed += 1
                    sys.stderr.write('%% Message failed delivery: %s\n' % msg)
                else:
                    delivered += 1
                    sys.stderr.write('%% Message delivered to %s [%d] @ %d\n' %
                                     (msg.topic(), msg.partition(), msg.offset()))
        sys.stderr.write('%% Waiting for %d deliveries\n' % len(producer))
        await producer.flush()
    print('delivered %d, failed %d' % (delivered, failed))


if __name__ == '__main__':
    if len(sys.argv) != 3:
        sys.stderr.write('Usage: %s <bootstrap-brokers> <topic>\n' % sys.argv[0])
        sys.exit(1)
    lines = [line.rstrip('\n').split('\t', 1) for line in sys.stdin]
    asyncio.run(run_producer(sys.argv[1], sys.argv[2], lines))
