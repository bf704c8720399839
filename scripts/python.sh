# Sourced by the scripts: create (or repair) the project's virtual environment.

# quietly CMD...: run CMD with its output set aside, shown only if it fails, so a successful
# setup prints nothing (apt's and pip's notes and warnings included).
quietly() {
    local log
    log=$(mktemp "${TMPDIR:-/tmp}/hermes-batch-setup.XXXXXX") || return 1
    "$@" >"$log" 2>&1 && { rm -f "$log"; return 0; }
    local status=$?
    echo "failed (exit status $status): $*" >&2
    cat "$log" >&2
    rm -f "$log"
    return $status
}

# pip_install VENV PIP_ARGS...: pip install PIP_ARGS into VENV, saying what it does as it goes (each package
# it collects), everything else pip says set aside and shown only if it fails.
pip_install() {
    local venv=$1 log status
    shift
    log=$(mktemp "${TMPDIR:-/tmp}/hermes-batch-setup.XXXXXX") || return 1
    { "$venv/bin/pip" install --disable-pip-version-check "$@" 2>&1; echo "hermes-batch-pip-status $?"; } \
        | tee "$log" \
        | awk '/^(Collecting|Obtaining) / { sub(/[<>=!~;\[ ].*/, "", $2); printf "  pip: %s %s\n", tolower($1), $2; fflush() }
               /^Installing collected packages/ { print "  pip: installing what it collected"; fflush() }' >&2
    status=$(sed -n 's/^hermes-batch-pip-status //p' "$log")
    if [ "${status:-1}" != 0 ]; then
        echo "failed (exit status ${status:-unknown}): pip install $*" >&2
        grep -v '^hermes-batch-pip-status ' "$log" >&2
    fi
    rm -f "$log"
    return "${status:-1}"
}

# install_once VENV NAME PIP_ARGS...: pip install PIP_ARGS into VENV unless that was done already for the same
# arguments and pyproject.toml files (noted in VENV/.hermes-batch-NAME-install): an editable install sees the
# code's changes by itself, and a new dependency or entry point is in a pyproject.toml.
install_once() {
    local venv=$1 name=$2 digest
    shift 2
    local stamp="$venv/.hermes-batch-$name-install"
    digest=$({ printf '%s\n' "$@"; cat pyproject.toml hermes_batch_*/pyproject.toml plugins/*/pyproject.toml; } | cksum)
    [ "$(cat "$stamp" 2>/dev/null)" = "$digest" ] && return 0
    rm -f "$stamp"
    echo "${0##*/}: installing into $venv ($name): pip install $* (a minute or more the first time)" >&2
    pip_install "$venv" "$@"
    echo "$digest" >"$stamp"
}

# The first python3 that can make a venv and open TLS connections (pip needs both).
find_python() {
    for candidate in ${PYTHON:-} python3 /usr/bin/python3 python3.13 python3.12 python3.11; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import ssl, venv, ensurepip, sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    if command -v apt-get >/dev/null 2>&1; then
        quietly apt-get -o DPkg::Lock::Timeout=600 update -qq \
            && DEBIAN_FRONTEND=noninteractive quietly apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3 python3-venv
        command -v /usr/bin/python3 && return 0
    fi
    echo "no usable Python 3.11+ with venv and ssl found; set PYTHON=/path/to/python3" >&2
    return 1
}

# ensure_venv DIR: a working venv at DIR, rebuilt if its interpreter is broken.
ensure_venv() {
    if [ -x "$1/bin/python" ] && "$1/bin/python" -c 'import ssl' 2>/dev/null; then
        return 0
    fi
    rm -rf "$1"
    "$(find_python)" -m venv "$1"
}
