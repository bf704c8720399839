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
ensure_apptainer_for_tests
ensure_chromium

export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
exec "$VENV/bin/python" -m pytest "$@"
