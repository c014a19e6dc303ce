#!/usr/bin/env python
"""A consumer written the way confluent_kafka.aio's example is written: coroutine error_cb and
stats_cb (-T) in the settings with a logger, auto commit and auto offset store off, cooperative-sticky,
coroutine on_assign (which asks for the assignment), on_revoke (which commits) and on_lost, a loop
of await poll(1.0) (or consume(num_messages=N, timeout=1.0) with -B N) that prints each message and
stores its offset, a commit every 100 messages, and, once a signal stops the loop, commit,
unsubscribe() and close().

test_aio.py runs it as written and with the import line swapped for ordering_layer's.

Usage: aio_consumer.py [-T <intvl>] [-B <n>] <bootstrap-brokers> <group> <topic>
"""

import asyncio
import getopt
import json
import logging
import signal
import sys

from confluent_kafka import KafkaException
from confluent_kafka.aio import AIOConsumer

logging.basicConfig()
logger = logging.getLogger('aio_consumer')
logger.setLevel(logging.INFO)
running = True


async def error_cb(err):
    logger.error(f'Kafka error: {err}')


async def stats_cb(stats_json_str):
    stats_json = json.loads(stats_json_str)
    sys.stderr.write('KAFKA Stats: %s %d\n' % (stats_json['type'], len(stats_json.get('topics', {}))))


def signal_handler(*_):
    global running
    logger.info('Signal received, shutting down...')
    running = False


async def run_consumer(conf, topic, batch):
    consumer = AIOConsumer(conf, max_workers=4)

    async def on_assign(consumer, partitions):
        print('Assignment:', partitions)
        print('Owned:', sorted(tp.partition for tp in await consumer.assignment()))
        sys.stdout.flush()

    async def on_revoke(consumer, partitions):
        logger.info(f'before on_revoke {partitions}')
        try:
            await consumer.commit(asynchronous=False)
        except Exception as e:  # noqa: BLE001 - as the example does
            logger.info(f'Error during commit: {e}')

    async def on_lost(consumer, partitions):
        logger.info(f'on_lost {partitions}')

    try:
        await consumer.subscribe([topic], on_assign=on_assign, on_revoke=on_revoke, on_lost=on_lost)
        i = 0
        while running:
            if batch:
                messages = await consumer.consume(num_messages=batch, timeout=1.0)
            else:
                message = await consumer.poll(1.0)
                messages = [] if message is None else [message]
            for msg in messages:
                if msg.error():
                    raise KafkaException(msg.error())
                sys.stderr.write('%% %s [%d] at offset %d with key %s\n' %
                                 (msg.topic(), msg.partition(), msg.offset(), str(msg.key())))
                print('%s %s' % (msg.key().decode(), msg.value().decode()))
                sys.stdout.flush()
                await consumer.store_offsets(message=msg)
                i += 1
                if i % 100 == 0:
                    await consumer.commit()
    finally:
        try:
            await consumer.commit(asynchronous=False)
        except KafkaException as e:
            logger.info(f'Nothing to commit: {e}')
        await consumer.unsubscribe()
        await consumer.close()
        sys.stderr.write('% Closed consumer\n')


if __name__ == '__main__':
    optlist, argv = getopt.getopt(sys.argv[1:], 'T:B:')
    if len(argv) != 3:
        sys.stderr.write('Usage: %s [-T <intvl>] [-B <n>] <bootstrap-brokers> <group> <topic>\n' % sys.argv[0])
        sys.exit(1)
    conf = {'bootstrap.servers': argv[0],
            'group.id': argv[1],
            'auto.offset.reset': 'earliest',
            'enable.auto.commit': 'false',
            'enable.auto.offset.store': 'false',
            'partition.assignment.strategy': 'cooperative-sticky',
            'session.timeout.ms': 6000,
            'logger': logger,
            'error_cb': error_cb}
    batch = 0
    for opt, value in optlist:
        if opt == '-T':
            conf['stats_cb'] = stats_cb
            conf['statistics.interval.ms'] = int(value)
        elif opt == '-B':
            batch = int(value)
    signal.signal(signal.SIGINT, signal_handler)
    signal.signal(signal.SIGTERM, signal_handler)
    asyncio.run(run_consumer(conf, argv[2], batch))
