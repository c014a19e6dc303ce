#!/usr/bin/env python
"""A consumer written the way confluent-kafka-python's example consumer is written: old-style
'default.topic.config' with 'smallest', session.timeout.ms, a logger= for the client's logs, an
optional stats_cb with statistics.interval.ms (-T), an on_assign that prints the partitions, a
poll(timeout=1.0) loop that prints each value, and Ctrl-C followed by close().

With -S it stores offsets itself, as the newer example does: enable.auto.offset.store false and
store_offsets(msg) once a message is processed.

test_idioms.py runs it as written and with the import line swapped for ordering_layer's.

Usage: consumer.py [-T <intvl>] [-S] <bootstrap-brokers> <group> <topic1> <topic2> ..
"""

import getopt
import json
import logging
import sys

from confluent_kafka import Consumer, KafkaException


def stats_cb(stats_json_str):
    stats_json = json.loads(stats_json_str)
    sys.stderr.write('KAFKA Stats: %s %d\n' % (stats_json['type'], len(stats_json.get('topics', {}))))


def print_usage_and_exit(program_name):
    sys.stderr.write('Usage: %s [options..] <bootstrap-brokers> <group> <topic1> <topic2> ..\n' % program_name)
    options = '''
 Options:
  -T <intvl>   Enable client statistics at specified interval (ms)
  -S           Store offsets after processing (enable.auto.offset.store=false)
'''
    sys.stderr.write(options)
    sys.exit(1)


if __name__ == '__main__':
    optlist, argv = getopt.getopt(sys.argv[1:], 'T:S')
    if len(argv) < 3:
        print_usage_and_exit(sys.argv[0])

    broker = argv[0]
    group = argv[1]
    topics = argv[2:]
    # Consumer configuration
    conf = {'bootstrap.servers': broker, 'group.id': group, 'session.timeout.ms': 6000,
            'default.topic.config': {'auto.offset.reset': 'smallest'}}
    store = False

    # Check to see if -T option exists
    for opt in optlist:
        if opt[0] == '-T':
            try:
                intval = int(opt[1])
            except ValueError:
                sys.stderr.write("Invalid option value for -T: %s\n" % opt[1])
                sys.exit(1)

            if intval <= 0:
                sys.stderr.write("-T option value needs to be larger than zero: %s\n" % opt[1])
                sys.exit(1)

            conf['stats_cb'] = stats_cb
            conf['statistics.interval.ms'] = str(intval)
        elif opt[0] == '-S':
            conf['enable.auto.offset.store'] = 'false'
            store = True

    # Create logger for consumer (logs will be emitted when poll() is called)
    logger = logging.getLogger('consumer')
    logger.setLevel(logging.DEBUG)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter('%(asctime)-15s %(levelname)-8s %(message)s'))
    logger.addHandler(handler)

    # Create Consumer instance
    # Hint: try debug='fetch' to generate some log messages
    c = Consumer(conf, logger=logger)

    def print_assignment(consumer, partitions):
        print('Assignment:', partitions)
        sys.stdout.flush()

    # Subscribe to topics
    c.subscribe(topics, on_assign=print_assignment)

    # Read messages from Kafka, print to stdout
    try:
        while True:
            msg = c.poll(timeout=1.0)
            if msg is None:
                continue
            if msg.error():
                raise KafkaException(msg.error())
            else:
                # Proper message
                sys.stderr.write('%% %s [%d] at offset %d with key %s:\n' %
                                 (msg.topic(), msg.partition(), msg.offset(), str(msg.key())))
                print('%s %s' % (msg.key().decode(), msg.value().decode()))
                sys.stdout.flush()
                if store:
                    c.store_offsets(msg)

    except KeyboardInterrupt:
        sys.stderr.write('%% Aborted by user\n')

    finally:
        # Close down consumer to commit final offsets.
        c.close()
