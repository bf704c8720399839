#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, run it, then stop what it started.
# Usage: scripts/test.sh [pytest arguments]
#
# What it does (each step only when the machine lacks it; README.md and docs/internals.md say the same):
#   - makes the virtual environment $HERMES_BATCH_VENV (default .venv) and installs this checkout and its
#     plugins into it, editable, with the test dependencies (pip);
#   - installs system packages with apt-get when missing: docker.io, busybox-static, gcc and libc6-dev,
#     openssl, debootstrap, chromium (and python3-venv);
#   - starts a Docker engine (dockerd) and builds the test images hermes-batch-test/busybox-{a,b}:1
#     (scripts/docker.sh);
#   - debootstraps the image hermes-batch-test/apptainer:2 and starts the container
#     hermes-batch-apptainer of it, with the capabilities and devices Apptainer needs and /tmp mounted,
#     whose apptainer command the singularity tests use (scripts/apptainer.sh);
#   - runs pytest with the arguments given.
# When the tests end (or are interrupted) it stops the engine and removes the container it started, never
# ones it found running (other test runs may use them), unless HERMES_BATCH_KEEP_SERVICES=1 (to run
# pytest directly afterwards).  Packages, images and the virtual environment stay.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh
. scripts/docker.sh
. scripts/apptainer.sh
. scripts/chromium.sh

HERMES_BATCH_SERVICES_LOCK=${HERMES_BATCH_SERVICES_LOCK:-/tmp/hermes-batch-services.lock}

# Every run of this script holds a shared lock (fd 9, which the long-lived processes it starts do not
# inherit) while it uses the engine and the container; the one that started them stops them only when it
# can take the lock alone, so it never stops them under another run.
exec 9>>"$HERMES_BATCH_SERVICES_LOCK"
command -v flock >/dev/null 2>&1 && flock -s 9

stop_what_was_started() {
    local status=$?
    trap - EXIT INT TERM
    if [ -z "$HBA_STARTED_CONTAINER$HB_STARTED_DOCKERD" ]; then
        exit "$status"
    elif [ "${HERMES_BATCH_KEEP_SERVICES:-}" = 1 ]; then
        echo "test.sh: left running as HERMES_BATCH_KEEP_SERVICES=1 asks:" \
            "${HBA_STARTED_CONTAINER:+the container $HBA_STARTED_CONTAINER}" \
            "${HB_STARTED_DOCKERD:+dockerd (pid $HB_STARTED_DOCKERD)}" >&2
    elif command -v flock >/dev/null 2>&1 && ! flock -n -x 9; then
        echo "test.sh: another scripts/test.sh is using what this one started; left running" >&2
    else
        stop_started_apptainer
        stop_started_docker_engine || true
    fi
    exit "$status"
}
trap stop_what_was_started EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

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
"$VENV/bin/python" -m pytest "$@" 9>&-
