# Sourced by the scripts: create (or repair) the project's virtual environment.

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
        apt-get update -qq >/dev/null && apt-get install -y -qq python3 python3-venv >/dev/null
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
