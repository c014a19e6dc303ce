#!/usr/bin/env bash
# Starts docker/compose.yaml on free ports, publishes and reads back through it with the layer's
# CLI, and takes it down again: proof that the compose file a user runs works with this library.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
cli="${CLI:-$root/.venv/bin/ordering-layer}"
py="${PYTHON:-$root/.venv/bin/python}"
if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
free_port() { "$py" -c 'from ordering_layer.stack.base import free_port; print(free_port())'; }
export KAFKA_PORT="${KAFKA_PORT:-$(free_port)}" REDIS_PORT="${REDIS_PORT:-$(free_port)}"
project="ol-compose-check-$$"
trap '"${compose[@]}" -f "$here/compose.yaml" -p "$project" down -v >/dev/null 2>&1 || true' EXIT
"${compose[@]}" -f "$here/compose.yaml" -p "$project" up -d
export ORDERING_LAYER_BOOTSTRAP="localhost:$KAFKA_PORT" ORDERING_LAYER_REDIS_URL="redis://localhost:$REDIS_PORT/0"
"$py" - <<'PY'
import os, time
import redis
from confluent_kafka.admin import AdminClient
deadline = time.monotonic() + 180
admin = AdminClient({"bootstrap.servers": os.environ["ORDERING_LAYER_BOOTSTRAP"]})
while True:
    try:
        if admin.list_topics(timeout=2).brokers and redis.Redis.from_url(os.environ["ORDERING_LAYER_REDIS_URL"]).ping():
            break
    except Exception as exc:  # not up yet
        if time.monotonic() > deadline:
            raise SystemExit(f"compose stack did not answer within 180 s: {exc}")
    time.sleep(1)
PY
"$cli" topic create compose-check --partitions 2
"$cli" subscription create compose-check-sub --topic compose-check
printf 'first\nsecond\nthird\n' | "$cli" publish compose-check --ordering-key customer-1
out="$("$cli" pull compose-check-sub --max-messages 3 --timeout 30)"
echo "$out"
# The three lines come back in publish order.
[ "$(echo "$out" | grep -o -E 'first|second|third' | tr '\n' ' ')" = "first second third " ] \
  || { echo "compose check: wrong order or missing messages" >&2; exit 1; }
echo "compose check: OK (kafka localhost:$KAFKA_PORT, redis localhost:$REDIS_PORT)"
