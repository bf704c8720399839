#!/usr/bin/env bash
# Run the test suite.
#
#   scripts/test.sh [pytest arguments]         the contributor's run: about a minute on 2 idle cores, no root, no services
#   scripts/test.sh --all [pytest arguments]   every test, with the services they need (what .ci/run calls)
#
# Both make the virtual environment $HERMES_BATCH_VENV (default .venv) and install this checkout and its
# plugins into it, editable, with the test dependencies (pip, naming each package it collects; skipped while the
# venv holds what the pyproject.toml files ask for, noted in $VENV/.hermes-batch-*-install).  Without --all only
# what the tests it runs use: the large libraries only marked tests need (ray, playwright, duckdb) come with --all.
#
# Without --all it runs, in parallel (pytest-xdist, one process per core), every test that needs nothing
# but Python: those marked docker, apptainer, modal, ray, browser, slow or perf (the root conftest.py marks
# them) are deselected.  It installs no system package and starts nothing.  The arguments go to pytest after
# its own, so `-m docker`, `-n 0` or a path replace or narrow them.
#
# With --all it first sets up what the marked tests need, each step only when the machine lacks it
# (README.md and docs/internals.md say the same):
#   - installs system packages with apt-get when missing: docker.io, busybox-static, gcc and libc6-dev,
#     slirp4netns and passt, openssl, debootstrap, chromium (and python3-venv);
#   - starts a Docker engine (dockerd) and builds the test images hermes-batch-test/busybox-{a,b}:1
#     and, once per machine, debootstraps hermes-batch-test/python:1 (Debian with python3 and pytest)
#     (scripts/docker.sh);
#   - debootstraps the image hermes-batch-test/apptainer:2 and starts the container
#     hermes-batch-apptainer of it, with the capabilities and devices Apptainer needs and /tmp mounted,
#     whose apptainer command the singularity tests use (scripts/apptainer.sh);
# then runs pytest twice with the arguments given: every test not marked perf, modal or browser in parallel,
# then those one at a time (a -m given narrows both).  Its exit status is the first failing run's.
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

ALL=
if [ "${1:-}" = --all ]; then
    ALL=1
    shift
fi

# The distributions of this checkout that the tests import, editable, and what the tests need besides; for the
# default run without the large libraries that only its deselected (marked) tests use: ray, playwright and duckdb.
PACKAGES=(
    -e '.[test]'
    -e plugins/hermes_batch_example
    -e hermes_batch_docker
    -e hermes_batch_singularity
    -e hermes_batch_modal
    -e plugins/hermes_batch_filters
    -e plugins/hermes_batch_parquet
    # the dependencies of plugins/hermes_batch_toolbox but playwright (tests/test_scripts.py checks them)
    'aiohttp>=3.9' 'trafilatura>=1.12' lxml_html_clean
)
# installed without their dependencies: what they need besides the above is ray (hermes-batch-ray) and playwright
# (the toolbox's browser), which only the tests marked ray and browser use
WITHOUT_DEPENDENCIES=(-e plugins/hermes_batch_toolbox -e plugins/hermes_batch_ray)
# what --all adds: the same two with their dependencies, Playwright for the viewer's browser tests, DuckDB for the
# Parquet tests' queries
ALL_PACKAGES=(-e plugins/hermes_batch_toolbox -e plugins/hermes_batch_ray 'playwright>=1.49' 'duckdb>=1.1')

VENV=${HERMES_BATCH_VENV:-.venv}
ensure_venv "$VENV"
install_once "$VENV" test "${PACKAGES[@]}"
install_once "$VENV" test-plugins --no-deps "${WITHOUT_DEPENDENCIES[@]}"
if [ -n "$ALL" ]; then
    install_once "$VENV" test-all "${ALL_PACKAGES[@]}"
fi
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
# Compiled modules are kept even where PYTHONDONTWRITEBYTECODE is set, under the venv rather than beside the sources:
# without them each pytest worker compiles and assertion-rewrites every test module again (about 10 of its 25 s of
# collection on 2 busy cores), and each hermes-batch a test starts compiles the package again.
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    unset PYTHONDONTWRITEBYTECODE
    case "$VENV" in
        /*) export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$VENV/pycache} ;;
        *) export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$PWD/$VENV/pycache} ;;
    esac
fi
# what needs more than Python (the root conftest.py says which test needs what)
SERVICES='docker or apptainer or modal or ray or browser or slow or perf'

if [ -z "$ALL" ]; then
    echo "test.sh: running the tests that need nothing but Python (pytest -n auto; the marked ones left out)" >&2
    "$VENV/bin/python" -m pytest -n auto --dist loadgroup -m "not ($SERVICES)" "$@" 9>&-
    exit
fi

ensure_docker_for_tests
# The local sandbox's namespace helper is built with the machine's C compiler (its tests use it).
if ! command -v cc >/dev/null 2>&1 || [ ! -e /usr/include/stdio.h ]; then
    echo "test.sh: no C compiler here; installing gcc and libc6-dev with apt-get" >&2
    _hb_apt_install gcc libc6-dev || echo "test.sh: no C compiler: the local sandbox uses bash" >&2
fi
# The local sandbox's network of its own (-S network=nat) attaches slirp4netns or pasta (Debian's passt); its tests
# run with each.
if ! command -v slirp4netns >/dev/null 2>&1 || ! command -v pasta >/dev/null 2>&1; then
    _hb_apt_install slirp4netns passt || echo "test.sh: no slirp4netns or pasta: the local sandbox's NAT tests skip" >&2
fi
# The transport tests make a self-signed certificate with it.
command -v openssl >/dev/null 2>&1 || _hb_apt_install openssl
ensure_apptainer_for_tests
ensure_chromium

# A -m of the caller narrows both runs: (its expression) and not perf, then (its expression) and perf.
select=
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -m) select=${2:-}; shift; [ $# -gt 0 ] && shift ;;
        -m?*) select=${1#-m}; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
# pytest's status 5 is "no test selected": fine for one of the two runs (arguments may select only one kind)
status=0
"$VENV/bin/python" -m pytest -n auto --dist loadgroup -m "${select:+($select) and }not (perf or modal or browser)" ${args[@]+"${args[@]}"} 9>&- || status=$?
perf=0
"$VENV/bin/python" -m pytest -n 0 -m "${select:+($select) and }(perf or modal or browser)" ${args[@]+"${args[@]}"} 9>&- || perf=$?
if [ "$status" = 5 ] && [ "$perf" != 5 ]; then
    status=$perf
elif [ "$status" = 0 ] && [ "$perf" != 5 ]; then
    status=$perf
fi
exit "$status"
