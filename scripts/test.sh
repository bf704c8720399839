#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run it.
# Usage: scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh
. scripts/docker.sh
. scripts/apptainer.sh

VENV=${HERMES_BATCH_VENV:-.venv}
ensure_venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check \
    -e '.[test]' \
    -e plugins/hermes_batch_example \
    -e hermes_batch_docker \
    -e hermes_batch_singularity \
    -e hermes_batch_modal
ensure_docker_for_tests
ensure_apptainer_for_tests

export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
exec "$VENV/bin/python" -m pytest "$@"
