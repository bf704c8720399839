# Sourced by scripts/test.sh: Debian's Chromium for the browser toolset's tests (hermes-batch-toolbox).
#
# Playwright drives it through executable_path; Playwright's own browser download is never used.
# Quiet and idempotent: nothing happens when /usr/bin/chromium is already there.

HERMES_CHROMIUM=${HERMES_CHROMIUM:-/usr/bin/chromium}

ensure_chromium() {
    if [ -x "$HERMES_CHROMIUM" ]; then
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "chromium.sh: no $HERMES_CHROMIUM and no apt-get; the browser tests will be skipped" >&2
        return 0
    fi
    local sudo=
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    echo "chromium.sh: installing chromium with apt-get" >&2
    $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null \
        && DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
            --no-install-recommends chromium >/dev/null \
        || { echo "chromium.sh: could not install chromium" >&2; return 1; }
}
