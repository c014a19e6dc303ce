# The two commands: `make demo` and `make test`. Both install what is missing first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export PYTHONUNBUFFERED := 1

.PHONY: setup system-deps python-deps constraints core jars demo test test-unit lint docs bench soak soak-short clean \
	docker-engine images test-docker compose-check test-redis-cluster test-secure compat

setup: system-deps python-deps core jars

# Debian packages: redis-server (the local Redis), Maven (fetches the Kafka and Spark jars), Java 17,
# kcat (a Kafka client this project did not write: the interoperability tests and the README use it).
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v kcat >/dev/null || missing="$$missing kcat"; \
	command -v mvn >/dev/null || missing="$$missing maven"; \
	command -v java >/dev/null || missing="$$missing openjdk-17-jre-headless"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

python-deps: $(VENV)/.installed

# The package carries the subscriber's compiled dispatch core (core/: Rust through PyO3, abi3, as
# ordering_layer._core; pyproject.toml builds it with maturin), so installing it needs cargo; cargo
# fetches the crates from crates.io. Rust comes from rustup (~/.cargo/bin): it needs rustc >= 1.85,
# newer than Debian bookworm's.
export PATH := $(HOME)/.cargo/bin:$(PATH)

# pyproject.toml gives ranges; constraints.txt the exact release of every package the venv gets (the
# project aside), so that the demo, the tests and CI install the same.
$(VENV)/.installed: pyproject.toml constraints.txt
	@command -v cargo >/dev/null || { echo "cargo not found: install Rust >= 1.85 (rustup) to build core/"; exit 1; }
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[spark,test,dev,docs]'
	@touch $@

# constraints.txt is pip freeze of a venv that `make test` passed on. To move to other releases within
# the ranges: install them into the venv (pip install -U ...), run the tests, then `make constraints`.
constraints:
	@[ -x $(PY) ] || { echo "no $(PY): run make setup first"; exit 1; }
	{ echo "# The exact releases make and CI install (pip install -c constraints.txt), within"; \
	  echo "# pyproject.toml's ranges: pip freeze of the tested venv, the project left out (make constraints)."; \
	  $(PY) -m pip freeze --exclude-editable; } > constraints.txt

# After a change to core/ the editable install builds the extension again, in place.
CORE_SOURCES := core/Cargo.toml core/Cargo.lock $(wildcard core/src/*.rs)

core: $(VENV)/.core-built

$(VENV)/.core-built: $(VENV)/.installed $(CORE_SOURCES)
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $@

# Kafka broker jars and Spark's Kafka source, pinned in ordering_layer/stack/poms/, into the cache.
jars: python-deps
	$(PY) -m ordering_layer.stack.fetch_jars

demo: setup
	$(VENV)/bin/ordering-layer stack up
	$(VENV)/bin/ordering-layer demo

# The core's own Rust tests link the venv's Python (no extension-module feature); the differential
# tests against the Python reference are in tests/model/test_core.py.
test: setup
	PYO3_PYTHON=$(abspath $(PY)) cargo test --release --locked --quiet --manifest-path core/Cargo.toml
	$(PY) -m pytest -ra

test-unit: python-deps core
	$(PY) -m pytest -ra tests/unit

# The session's Redis is a three-master Redis Cluster (ORDERING_LAYER_REDIS_CLUSTER=1): the subscriber,
# lease/dead-letter, chaos (all masters killed and restarted) and launcher tests, and the cluster's
# own (one master killed and restarted mid-subscription, script reload, scans of every primary).
REDIS_CLUSTER_TESTS ?= tests/integration/test_subscriber.py tests/integration/test_leases_deadletters.py \
	tests/integration/test_chaos.py tests/integration/test_stack.py tests/integration/test_redis_cluster.py

test-redis-cluster: setup
	ORDERING_LAYER_REDIS_CLUSTER=1 $(PY) -m pytest -ra $(REDIS_CLUSTER_TESTS)

# The session's stack is secured (ORDERING_LAYER_SECURE=1: TLS with a CA made here, Kafka SASL/SCRAM,
# a Redis ACL user): the subscriber, lease/dead-letter and chaos tests through it, and the secrets tests.
SECURE_TESTS ?= tests/integration/test_subscriber.py tests/integration/test_leases_deadletters.py \
	tests/integration/test_chaos.py tests/integration/test_secure.py

test-secure: setup
	ORDERING_LAYER_SECURE=1 $(PY) -m pytest -ra $(SECURE_TESTS)

# pip install . into fresh venvs next to other pinned releases of confluent-kafka (by default the
# lowest of pyproject.toml's range and another patch release than constraints.txt's), then the
# interoperability and native fetch tests against each install (tests/compat/check_versions.sh).
# Each release builds the compiled core afresh (one cargo target dir for all); about 2 minutes in all
# here, so .ci/run runs it too.
COMPAT_RELEASES ?=
compat: system-deps
	tests/compat/check_versions.sh $(COMPAT_RELEASES)

lint: python-deps core
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy ordering_layer tests bench spark
	$(VENV)/bin/lint-imports --no-cache
	PYO3_PYTHON=$(abspath $(PY)) cargo clippy --release --locked --quiet --manifest-path core/Cargo.toml -- -D warnings

# The docs site (mkdocs.yml, docs/): mkdocs-material, the API reference generated from the docstrings
# by mkdocstrings; --strict makes every warning (a broken link, a docstring griffe cannot read) an error.
# Built into site/ (not tracked); `$(VENV)/bin/mkdocs serve` shows it while editing.
docs: python-deps
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# -- Docker: an engine, images built here without a registry, and the tests through testcontainers --
# Integration tests run a second time with Kafka and Redis in containers (ORDERING_LAYER_STACK):
# publisher, subscriber, chaos (kill -9, rebalance, Redis and broker restarts), launcher, plugin.
DOCKER_TESTS ?= tests/integration/test_publisher.py tests/integration/test_subscriber.py \
	tests/integration/test_chaos.py tests/integration/test_stack.py \
	tests/integration/test_pytest_plugin.py

# Starts dockerd (vfs storage) when no engine answers; installs docker.io and debootstrap if missing.
docker-engine:
	docker/engine.sh

# ordering-layer/debian (debootstrap + docker import), ordering-layer/kafka, ordering-layer/redis.
images: python-deps jars docker-engine
	PYTHON=$(abspath $(PY)) docker/build-images.sh

test-docker: setup images
	ORDERING_LAYER_STACK=testcontainers $(PY) -m pytest -ra $(DOCKER_TESTS)

# docker/compose.yaml up on free ports, a publish and an ordered pull through it, then down.
compose-check: images
	PYTHON=$(abspath $(PY)) docker/compose-check.sh

bench: setup
	$(PY) bench/bench_publish.py
	$(PY) bench/bench_subscribe.py
	$(PY) bench/bench_spark.py
	$(PY) bench/bench_tls.py
	$(PY) bench/bench_schedule.py
	$(PY) bench/bench_recovery.py

# The chaos soak (issue 12) on its own three-broker stack: figures on stderr, JSON in bench/soak-<plan>.json.
soak: setup
	$(PY) -m bench.soak --out bench/soak-full.json

soak-short: setup
	$(PY) -m bench.soak --short --out bench/soak-short.json

clean:
	-$(VENV)/bin/ordering-layer stack down
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site core/target ordering_layer/_core*.so
