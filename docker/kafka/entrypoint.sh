#!/bin/bash
# Writes server.properties from the defaults below and the KAFKA_* environment (the convention of
# the official apache/kafka image: strip KAFKA_, lower-case, '___' -> '-', '__' -> '_', '_' -> '.'),
# formats the log directory on first start, and runs the broker in the foreground.
set -euo pipefail
config="${KAFKA_SERVER_PROPERTIES:-/opt/kafka/config/server.properties}"
declare -A props=(
  [process.roles]="broker,controller"
  [node.id]="1"
  [controller.quorum.voters]="1@localhost:9093"
  [listeners]="PLAINTEXT://0.0.0.0:9092,CONTROLLER://localhost:9093"
  [advertised.listeners]="PLAINTEXT://localhost:9092"
  [controller.listener.names]="CONTROLLER"
  [inter.broker.listener.name]="PLAINTEXT"
  [listener.security.protocol.map]="CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
  [log.dirs]="/var/lib/kafka/data"
  [num.partitions]="1"
  [offsets.topic.replication.factor]="1"
  [transaction.state.log.replication.factor]="1"
  [transaction.state.log.min.isr]="1"
  [share.coordinator.state.topic.replication.factor]="1"
  [share.coordinator.state.topic.min.isr]="1"
  [group.initial.rebalance.delay.ms]="0"
)
skip=" KAFKA_HEAP_OPTS KAFKA_JVM_PERFORMANCE_OPTS KAFKA_OPTS KAFKA_SERVER_PROPERTIES "
while IFS='=' read -r name value; do
  [[ "$name" == KAFKA_* ]] || continue
  [[ "$skip" == *" $name "* ]] && continue
  key="${name#KAFKA_}"; key="${key,,}"
  key="${key//___/-}"; key="${key//__/@}"; key="${key//_/.}"; key="${key//@/_}"
  props[$key]="$value"
done < <(env)
: > "$config"
for key in "${!props[@]}"; do printf '%s=%s\n' "$key" "${props[$key]}" >> "$config"; done

java=(java ${KAFKA_HEAP_OPTS:-} ${KAFKA_JVM_PERFORMANCE_OPTS:--XX:+UseG1GC -XX:MaxGCPauseMillis=20}
      ${KAFKA_OPTS:-} -Djava.awt.headless=true
      -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties -cp '/opt/kafka/libs/*')
logdir="${props[log.dirs]%%,*}"
if [ ! -f "$logdir/meta.properties" ]; then
  "${java[@]}" kafka.tools.StorageTool format --ignore-formatted \
    -t "${CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}" -c "$config"
fi
exec "${java[@]}" kafka.Kafka "$config"
