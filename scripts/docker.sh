#!/usr/bin/env bash
# A Docker engine and the test images of the docker sandbox's tests, on a fresh machine.
#
#   scripts/docker.sh          install docker.io if there is no engine, start dockerd, build the images
#   scripts/docker.sh images   only build the busybox test images (the engine must answer)
#   scripts/docker.sh python-image   only build the Debian test image with python3 and pytest
#
# Sourced by scripts/test.sh (it calls ensure_docker_for_tests, and stop_started_docker_engine when
# the tests end) or run on its own.  No image registry is needed: the images are built locally from
# busybox-static (and the Python one debootstrapped from the Debian mirror of apt) and fed to
# `docker import`, so nothing is pulled.  An engine this script starts is
# noted in HB_STARTED_DOCKERD (its pid); one it found answering is never stopped by it.

. "$(dirname "${BASH_SOURCE[0]}")/python.sh"  # quietly

HERMES_DOCKERD_LOG=${HERMES_DOCKERD_LOG:-/tmp/hermes-batch-dockerd.log}
HERMES_DOCKERD_PIDFILE=${HERMES_DOCKERD_PIDFILE:-/var/run/docker.pid}
HB_STARTED_DOCKERD=  # the pid of the engine this script started, if it started one
HERMES_TEST_IMAGES=(hermes-batch-test/busybox-a:1 hermes-batch-test/busybox-b:1)
# A minimal Debian with python3 and pytest: the Python cases of the reward-hack corpus (hermes_batch.testing).
HERMES_PYTHON_TEST_IMAGE=${HERMES_PYTHON_TEST_IMAGE:-hermes-batch-test/python:1}

_hb_say() { echo "docker.sh: $*" >&2; }

_hb_as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"; else return 1; fi
}

_hb_engine_answers() { docker info >/dev/null 2>&1; }

_hb_apt_updated=
_hb_apt_install() {
    command -v apt-get >/dev/null 2>&1 || return 1
    if [ -z "$_hb_apt_updated" ]; then
        quietly _hb_as_root apt-get -o DPkg::Lock::Timeout=600 update -qq || return 1
        _hb_apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive quietly _hb_as_root apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$@"
}

# ensure_docker_engine: an engine that answers `docker info`, installed and started if needed.
ensure_docker_engine() {
    if command -v docker >/dev/null 2>&1 && _hb_engine_answers; then
        return 0
    fi
    if ! command -v dockerd >/dev/null 2>&1; then
        _hb_say "no Docker engine here; installing docker.io with apt-get"
        _hb_apt_install docker.io || { _hb_say "could not install docker.io"; return 1; }
    fi
    if ! _hb_engine_answers; then
        _hb_say "starting dockerd in the background (log: $HERMES_DOCKERD_LOG)"
        # its own session, so a Ctrl-C of the tests does not stop the engine before the tests have cleaned up
        _hb_as_root setsid dockerd --pidfile "$HERMES_DOCKERD_PIDFILE" >"$HERMES_DOCKERD_LOG" 2>&1 < /dev/null 9>&- &
        local waited=0
        until _hb_engine_answers; do
            if [ "$waited" -ge 60 ]; then
                _hb_say "dockerd did not answer within 60 s; the end of its log:"
                tail -n 20 "$HERMES_DOCKERD_LOG" >&2 || true
                return 1
            fi
            sleep 1
            waited=$((waited + 1))
        done
        HB_STARTED_DOCKERD=$(_hb_as_root cat "$HERMES_DOCKERD_PIDFILE" 2>/dev/null)
    fi
}

# stop_started_docker_engine: stop the engine ensure_docker_engine started (none found running is touched).
stop_started_docker_engine() {
    local pid=$HB_STARTED_DOCKERD waited=0
    [ -n "$pid" ] || return 0
    HB_STARTED_DOCKERD=
    _hb_say "stopping the dockerd it started (pid $pid)"
    _hb_as_root kill -TERM "$pid" 2>/dev/null || return 0
    while _hb_as_root kill -0 "$pid" 2>/dev/null; do
        if [ "$waited" -ge 60 ]; then
            _hb_say "dockerd (pid $pid) has not stopped after 30 s; it is left running"
            return 1
        fi
        sleep 0.5
        waited=$((waited + 1))
    done
}

# _hb_static_busybox: the path of a statically linked busybox (from busybox-static).
_hb_static_busybox() {
    local candidate
    for candidate in /bin/busybox /usr/bin/busybox; do
        if [ -x "$candidate" ] && ! ldd "$candidate" >/dev/null 2>&1; then  # ldd fails on static binaries
            echo "$candidate"
            return 0
        fi
    done
    _hb_apt_install busybox-static || return 1
    for candidate in /bin/busybox /usr/bin/busybox; do
        if [ -x "$candidate" ] && ! ldd "$candidate" >/dev/null 2>&1; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

# _hb_import_image TAG BUSYBOX: a busybox root file system whose /etc/hermes-image names TAG.
_hb_import_image() {
    local tag=$1 busybox=$2 root applet
    root=$(mktemp -d /tmp/hermes-batch-rootfs.XXXXXX) || return 1
    case "$root" in /tmp/hermes-batch-rootfs.*) ;; *) _hb_say "unexpected temporary folder '$root'"; return 1;; esac
    mkdir -p "$root/bin" "$root/etc" "$root/root" "$root/tmp" "$root/usr"
    chmod 1777 "$root/tmp"
    cp "$busybox" "$root/bin/busybox"
    for applet in $("$root/bin/busybox" --list); do
        [ "$applet" = busybox ] || ln -sf busybox "$root/bin/$applet"
    done
    ln -s ../bin "$root/usr/bin"
    ln -s bin "$root/sbin"
    echo "$tag" >"$root/etc/hermes-image"
    echo "root:x:0:0:root:/root:/bin/sh" >"$root/etc/passwd"
    echo "root:x:0:" >"$root/etc/group"
    tar --numeric-owner --owner=0 --group=0 -C "$root" -c . \
        | docker import \
            -c 'ENV PATH=/bin' \
            -c 'CMD ["/bin/sh"]' \
            -c 'LABEL org.hermes-batch.test-image=1' \
            - "$tag" >/dev/null
    local status=$?
    rm -rf -- "$root"
    return $status
}

# ensure_test_images: build the test images that are missing (an existing tag is kept).
ensure_test_images() {
    local tag busybox=
    for tag in "${HERMES_TEST_IMAGES[@]}"; do
        docker image inspect "$tag" >/dev/null 2>&1 && continue
        if [ -z "$busybox" ]; then
            busybox=$(_hb_static_busybox) || { _hb_say "no static busybox (apt-get install busybox-static)"; return 1; }
        fi
        _hb_say "building the test image $tag from $busybox"
        _hb_import_image "$tag" "$busybox" || { _hb_say "could not build $tag"; return 1; }
    done
}

# _hb_debian: "MIRROR SUITE" for debootstrap: the Debian mirror of this machine's apt sources (not the security
# archive) and this machine's release, else deb.debian.org and stable.
_hb_debian() {
    local uri suite=stable
    uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | grep -v '^[[:space:]]*#' \
        | grep -oE '(https?|file)://[^[:space:]]+/debian/?([[:space:]]|$)' \
        | tr -d '[:space:]' | head -n 1)
    if [ -r /etc/os-release ] && grep -qx 'ID=debian' /etc/os-release; then
        suite=$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release)
    fi
    echo "${uri:-http://deb.debian.org/debian} ${suite:-stable}"
}

# ensure_python_test_image: build $HERMES_PYTHON_TEST_IMAGE when missing: a debootstrap of Debian (minbase) with
# python3 and python3-pytest, without apt's lists, documentation and locales (about a minute and 130 MB, once per
# machine; a lock keeps two test runs from building it at once).
ensure_python_test_image() {
    docker image inspect "$HERMES_PYTHON_TEST_IMAGE" >/dev/null 2>&1 && return 0
    local lock=${TMPDIR:-/tmp}/hermes-batch-python-image.lock
    (
        command -v flock >/dev/null 2>&1 && flock -x 9
        docker image inspect "$HERMES_PYTHON_TEST_IMAGE" >/dev/null 2>&1 && exit 0
        if ! command -v debootstrap >/dev/null 2>&1; then
            _hb_apt_install debootstrap || { _hb_say "could not install debootstrap"; exit 1; }
        fi
        local root mirror suite status
        read -r mirror suite <<<"$(_hb_debian)"
        root=$(mktemp -d /var/tmp/hermes-batch-python-root.XXXXXX) || exit 1
        case "$root" in /var/tmp/hermes-batch-python-root.*) ;; *) _hb_say "unexpected folder '$root'"; exit 1;; esac
        _hb_say "building the test image $HERMES_PYTHON_TEST_IMAGE: debootstrap of Debian $suite with python3 and pytest from $mirror (once per machine)"
        if ! _hb_as_root debootstrap --variant=minbase --include=python3,python3-pytest "$suite" "$root" "$mirror" \
                >"$root.log" 2>&1; then
            _hb_say "debootstrap failed; the end of its log ($root.log):"
            tail -n 15 "$root.log" >&2
            _hb_as_root rm -rf -- "$root"
            exit 1
        fi
        _hb_as_root rm -rf -- "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
            "$root"/usr/share/locale/* "$root"/usr/share/man/*
        _hb_as_root tar --numeric-owner -C "$root" -c . \
            | docker import \
                -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
                -c 'CMD ["/bin/sh"]' \
                -c 'LABEL org.hermes-batch.test-image=1' \
                - "$HERMES_PYTHON_TEST_IMAGE" >/dev/null
        status=$?
        _hb_as_root rm -rf -- "$root" "$root.log"
        exit $status
    ) 9>>"$lock"
}

# ensure_docker_for_tests: engine and images; in CI a failure stops the tests, elsewhere they skip.
ensure_docker_for_tests() {
    local started=$SECONDS
    if ensure_docker_engine && ensure_test_images; then
        if ! ensure_python_test_image; then
            [ "${CI:-}" = true ] && { _hb_say "the Python test image is not available, and CI needs it"; return 1; }
            _hb_say "no Python test image: the tests that need it will be skipped"
        fi
        # quiet when there was nothing to do; the steps that did something said so
        [ $((SECONDS - started)) -lt 2 ] || _hb_say "Docker engine and test images ready ($((SECONDS - started)) s)"
        return 0
    fi
    if [ "${CI:-}" = true ]; then
        _hb_say "the Docker engine or the test images are not available, and CI needs them"
        return 1
    fi
    _hb_say "no Docker engine: the docker sandbox tests will be skipped"
    return 0
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    case "${1:-all}" in
        images) ensure_test_images ;;
        python-image) ensure_python_test_image ;;
        all) ensure_docker_engine && ensure_test_images && ensure_python_test_image ;;
        *) echo "usage: $0 [all|images|python-image]" >&2; exit 2 ;;
    esac
fi
