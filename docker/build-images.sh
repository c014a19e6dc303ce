#!/usr/bin/env bash
# Builds the stack's images with no registry: a Debian base made by debootstrap and `docker import`,
# then Kafka (Maven Central jars from the project's cache) and Redis (Debian's redis-server) on top.
# Each step is skipped or cached when nothing changed, so a second run takes seconds.
#
#   docker/build-images.sh            # needs a running Docker engine (see docker/engine.sh)
#
# Environment: ORDERING_LAYER_CACHE (jar cache, default ~/.cache/ordering-layer), PYTHON (the
# project's interpreter, default .venv/bin/python), DEBIAN_MIRROR, DEBIAN_SUITE.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
PYTHON="${PYTHON:-$root/.venv/bin/python}"
DEBIAN_SUITE="${DEBIAN_SUITE:-bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_IMAGE="ordering-layer/debian:${DEBIAN_SUITE}"
cache="${ORDERING_LAYER_CACHE:-$HOME/.cache/ordering-layer}"

docker info >/dev/null 2>&1 || { echo "no Docker engine answers: run docker/engine.sh (or 'make docker-engine')" >&2; exit 1; }

# 1. The base image: a minimal Debian root filesystem imported as an image (once).
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "base: $BASE_IMAGE present"
else
  command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }
  rootfs="$cache/rootfs-$DEBIAN_SUITE"
  rm -rf "$rootfs"
  echo "base: debootstrap $DEBIAN_SUITE from $DEBIAN_MIRROR into $rootfs"
  debootstrap --variant=minbase "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" >"$cache/debootstrap.log" 2>&1 \
    || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
  # Keep images small: no apt lists or caches, no docs.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  echo "base: $BASE_IMAGE imported"
fi

# 2. Kafka: the pinned broker jars from the project's cache (fetched by Maven when missing).
kafka_version="$("$PYTHON" -c 'from ordering_layer.stack.jars import kafka_version; print(kafka_version())')"
jars="$("$PYTHON" -c 'from ordering_layer.stack.jars import kafka_jars; print(kafka_jars())')"
mkdir -p "$here/kafka/jars"
# Mirror the jar set into the build context (gitignored); unchanged files keep the build cached.
rsync_like() {
  local src="$1" dst="$2" f
  for f in "$dst"/*.jar; do [ -e "$f" ] || continue; [ -e "$src/$(basename "$f")" ] || rm -f "$f"; done
  for f in "$src"/*.jar; do cmp -s "$f" "$dst/$(basename "$f")" || cp -p "$f" "$dst/"; done
}
rsync_like "$jars" "$here/kafka/jars"
docker build -q --build-arg "BASE=$BASE_IMAGE" -t "ordering-layer/kafka:$kafka_version" "$here/kafka" >/dev/null
echo "kafka: ordering-layer/kafka:$kafka_version"

# 3. Redis: Debian's redis-server.
docker build -q --build-arg "BASE=$BASE_IMAGE" -t "ordering-layer/redis:7" "$here/redis" >/dev/null
echo "redis: ordering-layer/redis:7"

# Earlier builds of these images, now untagged, only take disk space (a lot of it with vfs).
docker image prune -f --filter label=org.ordering-layer.image >/dev/null
