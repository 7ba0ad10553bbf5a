#!/usr/bin/env bash
# System packages the test suite needs (Debian): headless Chromium for the dashboard test,
# coturn (a TURN server the relay tests start on 127.0.0.1), iproute2 and util-linux for
# the loopback-only network namespaces of the libwebrtc tests.
# Installs only what is missing; needs root (CI runs as root).
set -euo pipefail
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v turnserver >/dev/null 2>&1 || missing+=(coturn)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v unshare >/dev/null 2>&1 || missing+=(util-linux)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-system: missing ${missing[*]}; run: sudo apt-get install ${missing[*]}" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
