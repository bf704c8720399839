#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run it.
# Usage: scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh
. scripts/docker.sh
. scripts/apptainer.sh
. scripts/chromium.sh

VENV=${HERMES_BATCH_VENV:-.venv}
ensure_venv "$VENV"
quietly "$VENV/bin/pip" install --disable-pip-version-check \
    -e '.[test]' \
    -e plugins/hermes_batch_example \
    -e hermes_batch_docker \
    -e hermes_batch_singularity \
    -e hermes_batch_modal \
    -e plugins/hermes_batch_toolbox \
    -e plugins/hermes_batch_filters \
    -e plugins/hermes_batch_parquet \
    -e plugins/hermes_batch_ray \
    'duckdb>=1.1'
ensure_docker_for_tests
# The local sandbox's namespace helper is built with the machine's C compiler (its tests use it).
if ! command -v cc >/dev/null 2>&1 || [ ! -e /usr/include/stdio.h ]; then
    echo "test.sh: no C compiler here; installing gcc and libc6-dev with apt-get" >&2
    _hb_apt_install gcc libc6-dev || echo "test.sh: no C compiler: the local sandbox uses bash" >&2
fi
# The transport tests make a self-signed certificate with it.
command -v openssl >/dev/null 2>&1 || _hb_apt_install openssl
ensure_apptainer_for_tests
ensure_chromium

export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
exec "$VENV/bin/python" -m pytest "$@"
