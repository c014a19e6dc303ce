#!/usr/bin/env bash
# The package installed next to an application's own pin of confluent-kafka: for each release named
# (default: the lowest of pyproject.toml's range, and another patch release than constraints.txt's),
# a fresh venv gets `pip install confluent-kafka==<release>`, then `pip install .` (with the test
# extra) of the committed tree (git HEAD), which must keep that release; then the interoperability
# and native fetch tests run against the installed package, on the session stack they start.
#
#   tests/compat/check_versions.sh [RELEASE...]      e.g. tests/compat/check_versions.sh 2.6.1 2.16.0
#
# Each install builds the compiled core (cargo on the PATH; the builds share one cargo target dir).
# Work goes to $COMPAT_DIR (default: a new folder under /tmp), removed at the end unless
# COMPAT_KEEP=1. Exits non-zero at the first release that does not install or does not pass.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
RELEASES=("$@")
[ ${#RELEASES[@]} -gt 0 ] || RELEASES=(2.6.1 2.16.0)
TESTS=(tests/integration/test_interop.py tests/integration/test_native_fetch.py)
export PATH="$HOME/.cargo/bin:$PATH"
command -v cargo >/dev/null || { echo "cargo not found: install Rust >= 1.85 (rustup) to build core/"; exit 1; }

WORK=${COMPAT_DIR:-$(mktemp -d /tmp/ordering-layer-compat.XXXXXX)}
mkdir -p "$WORK"
[ "${COMPAT_KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
export CARGO_TARGET_DIR="$WORK/target"

# The committed tree, and a folder with only its tests: run from there, the tests import the
# installed package, not the sources.
rm -rf "$WORK/src" "$WORK/run" && mkdir -p "$WORK/src" "$WORK/run"
git -C "$ROOT" archive HEAD | tar -x -C "$WORK/src"
cp -r "$WORK/src/tests" "$WORK/src/pyproject.toml" "$WORK/run/"
echo "compat: $(git -C "$ROOT" rev-parse --short HEAD) in $WORK; releases: ${RELEASES[*]}"

for release in "${RELEASES[@]}"; do
  venv="$WORK/venv-$release"
  started=$SECONDS
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "confluent-kafka==$release"
  "$venv/bin/python" -m pip install -q "$WORK/src[test]"
  "$venv/bin/python" -m pip check
  loaded=$("$venv/bin/python" -c 'import confluent_kafka as c; v = c.version(); print(v if isinstance(v, str) else v[0], c.libversion()[0])')
  [ "${loaded%% *}" = "$release" ] || { echo "compat: pip install . replaced confluent-kafka $release ($loaded)"; exit 1; }
  echo "compat: confluent-kafka $release (librdkafka ${loaded#* }) installed with the package in $((SECONDS - started)) s"
  "$venv/bin/python" -m pip freeze --exclude ordering-layer | tr '\n' ' '; echo
  "$venv/bin/python" -m ordering_layer.stack.fetch_jars >/dev/null
  (cd "$WORK/run" && "$venv/bin/python" -m pytest -ra -p no:cacheprovider "${TESTS[@]}")
  echo "compat: confluent-kafka $release passed in $((SECONDS - started)) s"
done
