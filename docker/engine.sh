#!/usr/bin/env bash
# Starts a Docker engine when none answers: Debian's docker.io (with debootstrap and docker-compose
# for the images and the compose check), `dockerd --storage-driver=vfs` in
# the background (vfs needs no kernel overlay support, so it works inside a VM or a container).
# Harmless when an engine runs already. Needs root (or sudo).
set -euo pipefail
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
missing=""
command -v dockerd >/dev/null || missing="$missing docker.io"
command -v debootstrap >/dev/null || missing="$missing debootstrap"
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || missing="$missing docker-compose"
if [ -n "$missing" ]; then
  echo "installing:$missing"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi
if docker info >/dev/null 2>&1; then echo "docker engine: running"; exit 0; fi
# A daemon killed without cleanup (kill -9, the end of a session) leaves its pid file behind, and
# a new dockerd refuses to start while it exists.
pidfile=/var/run/docker.pid
if [ -f "$pidfile" ] && ! kill -0 "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null; then
  echo "docker engine: removing stale $pidfile"
  $SUDO rm -f "$pidfile"
fi
log="${DOCKERD_LOG:-/tmp/ordering-layer-dockerd.log}"
echo "docker engine: starting dockerd --storage-driver=vfs (log: $log)"
$SUDO sh -c "nohup dockerd --storage-driver=vfs >'$log' 2>&1 & echo \$! >'$log.pid'"
for _ in $(seq 1 120); do
  docker info >/dev/null 2>&1 && { echo "docker engine: running"; exit 0; }
  kill -0 "$(cat "$log.pid")" 2>/dev/null || break
  sleep 0.5
done
echo "docker engine did not start (or answer within 60 s); see $log" >&2
tail -20 "$log" >&2
exit 1
