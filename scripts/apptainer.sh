#!/usr/bin/env bash
# A real Apptainer for the tests of the singularity sandbox, on a fresh machine.
#
#   scripts/apptainer.sh          set it up (see below) and print the folder of the `apptainer` command
#   scripts/apptainer.sh stop     stop and remove the container (the image is kept)
#
# Sourced by scripts/test.sh after scripts/docker.sh (it calls ensure_apptainer_for_tests, and
# stop_started_apptainer when the tests end), or run on its own.  Debian 12 has no Apptainer package,
# and Debian unstable's needs a newer C library, so Apptainer runs inside a Docker container:
#   1. once per machine: debootstrap a minimal Debian unstable root with apptainer in it, from the
#      Debian mirror of this machine's apt sources, and `docker import` it as $HERMES_APPTAINER_IMAGE;
#   2. one container of it running ($HERMES_APPTAINER_CONTAINER), with the capabilities and devices
#      Apptainer needs and no others (see _hba_start_container) and /tmp bind-mounted at /tmp, so the
#      files the tests make there (images, SIF caches) have the same paths on both sides; one already
#      running is used as it is (other test runs may be using it), and only one this script started
#      is noted (HBA_STARTED_CONTAINER) for stop_started_apptainer;
#   3. write `apptainer` and `singularity` commands into $HERMES_APPTAINER_HOME/bin that forward
#      their arguments, environment, working folder, standard input, exit status and signals into
#      that container with `docker exec`, running as root; and the same in user-bin/, running as
#      the ordinary user $HERMES_APPTAINER_USER (user namespaces, no setuid, as on a cluster).
#      Only the tests put these folders on their PATH.

HERMES_APPTAINER_IMAGE=${HERMES_APPTAINER_IMAGE:-hermes-batch-test/apptainer:2}
HERMES_APPTAINER_CONTAINER=${HERMES_APPTAINER_CONTAINER:-hermes-batch-apptainer}
HERMES_APPTAINER_HOME=${HERMES_APPTAINER_HOME:-/tmp/hermes-batch-apptainer}
HERMES_APPTAINER_LOOPS=${HERMES_APPTAINER_LOOPS:-32}  # loop devices given to the container
# Changes of the container's settings below change this.  A stopped container older than this is
# replaced; a running one of at least _HB_RIG_MIN_VERSION is used as it is (other test runs on the
# machine may be using it: `scripts/apptainer.sh stop` when none is, and the next run makes a new one).
_HB_RIG_VERSION=6
_HB_RIG_MIN_VERSION=5  # the oldest container the tests still work with
HBA_STARTED_CONTAINER=  # set when this script started the container
HERMES_APPTAINER_USER=hbuser  # the ordinary user of user-bin/

_hba_say() { echo "apptainer.sh: $*" >&2; }

_hba_as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"; else return 1; fi
}

# _hba_mirror: the Debian mirror named in this machine's apt sources (not the security archive).
_hba_mirror() {
    local uri
    uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | grep -v '^[[:space:]]*#' \
        | grep -oE '(https?|file)://[^[:space:]]+/debian/?([[:space:]]|$)' \
        | tr -d '[:space:]' | head -n 1)
    echo "${uri:-http://deb.debian.org/debian}"
}

# _hba_build_image: debootstrap a root with apptainer and import it (about 75 s on a quiet machine).
_hba_build_image() {
    local root mirror status
    if ! command -v debootstrap >/dev/null 2>&1; then
        _hb_apt_install debootstrap || { _hba_say "could not install debootstrap"; return 1; }
    fi
    mirror=$(_hba_mirror)
    root=$(mktemp -d /var/tmp/hermes-batch-apptainer-root.XXXXXX) || return 1
    case "$root" in /var/tmp/hermes-batch-apptainer-root.*) ;; *) _hba_say "unexpected folder '$root'"; return 1;; esac
    _hba_say "building $HERMES_APPTAINER_IMAGE: debootstrap of Debian unstable with apptainer from $mirror (once per machine)"
    # squashfuse lets an ordinary user mount a SIF (without it each instance unpacks the SIF)
    if ! _hba_as_root debootstrap --variant=minbase --include=apptainer,squashfs-tools,uidmap,ca-certificates,squashfuse \
            sid "$root" "$mirror" >"$root.log" 2>&1; then
        _hba_say "debootstrap failed; the end of its log ($root.log):"
        tail -n 15 "$root.log" >&2
        _hba_as_root rm -rf -- "$root"
        return 1
    fi
    # Instances of one SIF share a loop device, so many prompts need few of them.
    sed -i 's/^shared loop devices = no/shared loop devices = yes/' "$root/etc/apptainer/apptainer.conf"
    _hba_as_root tar --numeric-owner -C "$root" -c . \
        | docker import -c 'LABEL org.hermes-batch.test-rig=apptainer' -c 'CMD ["/bin/sleep","infinity"]' \
            - "$HERMES_APPTAINER_IMAGE" >/dev/null
    status=$?
    _hba_as_root rm -rf -- "$root" "$root.log"
    return $status
}

# _hba_loop_devices: device options for /dev/loop-control and /dev/loop0..N-1, made if missing.
_hba_loop_devices() {
    local n
    if [ ! -e /dev/loop-control ]; then
        _hba_as_root mknod -m 660 /dev/loop-control c 10 237 || return 1
    fi
    echo "--device /dev/loop-control"
    for ((n = 0; n < HERMES_APPTAINER_LOOPS; n++)); do
        if [ ! -e "/dev/loop$n" ]; then
            _hba_as_root mknod -m 660 "/dev/loop$n" b 7 "$n" || return 1
        fi
        echo "--device /dev/loop$n"
    done
}

_hba_container_ready() {
    local state
    state=$(docker inspect -f '{{.State.Running}} {{index .Config.Labels "org.hermes-batch.rig-version"}}' \
        "$HERMES_APPTAINER_CONTAINER" 2>/dev/null) || return 1
    [ "${state% *}" = true ] && [ "${state#* }" -ge "$_HB_RIG_MIN_VERSION" ] 2>/dev/null
}

# The capabilities Apptainer needs, found by trying each away (root runs a SIF from a loop device with
# --no-privs and --net --network none; an ordinary user runs it in user namespaces with squashfuse):
# SYS_ADMIN mounts and makes namespaces (and lets Docker's default seccomp profile allow those calls),
# DAC_READ_SEARCH the overlay, NET_ADMIN the loopback of --network none, MKNOD a loop device,
# SETPCAP drops root's capabilities, SETUID/SETGID/SYS_CHROOT/CHOWN/DAC_OVERRIDE/FOWNER the starter,
# KILL passes the forwarders' signals on to the ordinary user's runtime.
_HBA_CAPABILITIES=(SYS_ADMIN DAC_READ_SEARCH NET_ADMIN MKNOD SETPCAP SETUID SETGID SYS_CHROOT CHOWN DAC_OVERRIDE
    FOWNER KILL)

# _hba_start_container: one running container of the image (left running for other test runs unless
# stop_started_apptainer stops it).
_hba_start_container() {
    local devices capability security=()
    _hba_container_ready && return 0
    devices=$(_hba_loop_devices) || { _hba_say "could not make the loop devices"; return 1; }
    docker rm -f "$HERMES_APPTAINER_CONTAINER" >/dev/null 2>&1
    for capability in "${_HBA_CAPABILITIES[@]}"; do security+=(--cap-add "$capability"); done
    # Docker's AppArmor profile forbids mount; where AppArmor is on, the container goes without it.
    if [ "$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null)" = Y ]; then
        security+=(--security-opt apparmor=unconfined)
    fi
    # --init reaps the instances' processes (a stopped instance is otherwise a zombie that
    # `apptainer instance stop` waits 10 s for); systempaths=unconfined leaves /proc unmasked, which an
    # ordinary user's new /proc mount needs; Docker's default seccomp profile stays.
    # shellcheck disable=SC2086
    if ! docker run -d --init --name "$HERMES_APPTAINER_CONTAINER" \
            --label org.hermes-batch.test-rig=apptainer --label "org.hermes-batch.rig-version=$_HB_RIG_VERSION" \
            --cap-drop ALL "${security[@]}" --security-opt systempaths=unconfined \
            --device /dev/fuse $devices \
            -v /tmp:/tmp \
            "$HERMES_APPTAINER_IMAGE" sleep infinity >/dev/null 2>"$HERMES_APPTAINER_HOME/run.err"; then
        # Another test run may have started it at the same moment.
        _hba_container_ready && return 0
        _hba_say "could not start the container: $(tail -n 3 "$HERMES_APPTAINER_HOME/run.err")"
        return 1
    fi
    HBA_STARTED_CONTAINER=$HERMES_APPTAINER_CONTAINER
    docker exec "$HERMES_APPTAINER_CONTAINER" useradd -m "$HERMES_APPTAINER_USER" >/dev/null 2>&1
    docker exec "$HERMES_APPTAINER_CONTAINER" id "$HERMES_APPTAINER_USER" >/dev/null 2>&1
}

# _hba_write_forwarders: apptainer and singularity in bin/ (as root) and user-bin/ (as the user).
_hba_write_forwarders() {
    local folder bin user tool docker_host=""
    mkdir -p "$HERMES_APPTAINER_HOME/run" && chmod 1777 "$HERMES_APPTAINER_HOME/run"
    [ -n "${DOCKER_HOST:-}" ] && docker_host="export DOCKER_HOST=$(printf %q "$DOCKER_HOST")"
    for folder in bin user-bin; do
        user=root
        [ "$folder" = user-bin ] && user=$HERMES_APPTAINER_USER
        bin=$HERMES_APPTAINER_HOME/$folder
        mkdir -p "$bin"
        for tool in apptainer singularity; do
            cat >"$bin/$tool.new" <<EOF
#!/usr/bin/env bash
# Written by scripts/apptainer.sh: runs \`$tool\` as $user in the container $HERMES_APPTAINER_CONTAINER.
container=$HERMES_APPTAINER_CONTAINER
user=$user
$docker_host
EOF
            cat >>"$bin/$tool.new" <<'EOF'
tool=$(basename "$0")
# The caller's environment goes along (the runtime's own environment handling is what is tested),
# except what describes this side: its PATH, HOME, shell state and the Docker client's settings.
envs=()
while IFS= read -r name; do
    case "$name" in
        PATH|HOME|HOSTNAME|PWD|OLDPWD|SHLVL|_|BASH*|DOCKER_*|COMP_*) ;;
        *) envs+=(-e "$name") ;;
    esac
done < <(compgen -e)
# The same working folder inside when it is shared (/tmp is), else /.
workdir=/
case "$PWD" in /tmp|/tmp/*) workdir=$PWD ;; esac
# Signals reach the runtime inside: its pid is noted in a file and TERM, INT, HUP are passed on.
note=/tmp/hermes-batch-apptainer/run/$$.$RANDOM
exec 3<&0
docker exec -i -u "$user" -w "$workdir" "${envs[@]}" "$container" /bin/sh -c \
    'exec 3<&0; "$@" <&3 3<&- & p=$!; exec 3<&-; echo $p >"$0"; wait $p; s=$?; rm -f "$0"; exit $s' \
    "$note" "$tool" "$@" <&3 3<&- &
child=$!
exec 3<&-
forward() {
    local pid
    pid=$(cat "$note" 2>/dev/null) && docker exec "$container" /bin/sh -c 'kill -"$1" "$2"' sh "$1" "$pid" >/dev/null 2>&1
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward HUP' HUP
while :; do
    wait "$child"
    status=$?
    kill -0 "$child" 2>/dev/null || break  # wait was cut short by a trapped signal
done
exit "$status"
EOF
            chmod +x "$bin/$tool.new"
            mv -f "$bin/$tool.new" "$bin/$tool"
        done
    done
}

# stop_started_apptainer: remove the container _hba_start_container started (none found running).
stop_started_apptainer() {
    local container=$HBA_STARTED_CONTAINER
    [ -n "$container" ] || return 0
    HBA_STARTED_CONTAINER=
    _hba_say "removing the container $container it started (the image $HERMES_APPTAINER_IMAGE is kept)"
    docker rm -f "$container" >/dev/null 2>&1
}

# ensure_apptainer: image, container and forwarders; prints the folder of the forwarders
# (those that run as the ordinary user are in the folder user-bin beside it).
ensure_apptainer() {
    mkdir -p "$HERMES_APPTAINER_HOME" || return 1
    if ! docker info >/dev/null 2>&1; then
        _hba_say "no Docker engine answers"
        return 1
    fi
    if ! docker image inspect "$HERMES_APPTAINER_IMAGE" >/dev/null 2>&1; then
        _hba_build_image || { _hba_say "could not build $HERMES_APPTAINER_IMAGE"; return 1; }
    fi
    _hba_start_container || return 1
    # The ordinary user mounts SIFs with squashfuse: /dev/fuse must be open to all, as udev makes it on
    # Debian; some machines' /dev/fuse is root's alone (0600), and the container's copy keeps its mode.
    docker exec "$HERMES_APPTAINER_CONTAINER" chmod 0666 /dev/fuse >/dev/null 2>&1
    _hba_write_forwarders || return 1
    if ! "$HERMES_APPTAINER_HOME/bin/apptainer" --version >/dev/null 2>&1; then
        _hba_say "apptainer does not run in the container $HERMES_APPTAINER_CONTAINER"
        return 1
    fi
    echo "$HERMES_APPTAINER_HOME/bin"
}

# ensure_apptainer_for_tests: exports HERMES_APPTAINER_BIN (the forwarders' folder), or
# HERMES_APPTAINER_PROBLEM (why not); in CI a failure stops the tests, elsewhere they skip.
ensure_apptainer_for_tests() {
    local started=$SECONDS bin=$HERMES_APPTAINER_HOME/bin
    # not in a subshell: HBA_STARTED_CONTAINER must reach stop_started_apptainer
    if ensure_apptainer >/dev/null; then
        export HERMES_APPTAINER_BIN=$bin
        unset HERMES_APPTAINER_PROBLEM
        _hba_say "Apptainer $("$bin/apptainer" --version 2>/dev/null | awk '{print $NF}') ready in the container $HERMES_APPTAINER_CONTAINER ($((SECONDS - started)) s)"
        return 0
    fi
    export HERMES_APPTAINER_PROBLEM="Apptainer could not be set up in a Docker container (see the messages of scripts/apptainer.sh above)"
    if [ "${CI:-}" = true ]; then
        _hba_say "Apptainer is not available, and CI needs it"
        return 1
    fi
    _hba_say "no Apptainer: the singularity sandbox tests will be skipped"
    return 0
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -uo pipefail
    if ! declare -F _hb_apt_install >/dev/null; then
        . "$(dirname "$0")/docker.sh"
    fi
    case "${1:-all}" in
        all) ensure_apptainer ;;
        stop) docker rm -f "$HERMES_APPTAINER_CONTAINER" >/dev/null ;;
        *) echo "usage: $0 [all|stop]" >&2; exit 2 ;;
    esac
fi
