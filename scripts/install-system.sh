#!/usr/bin/env bash
# System packages the test suite needs (Debian): headless Chromium for the dashboard test.
# Installs only what is missing; needs root (CI runs as root).
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-system: chromium is missing; run: sudo apt-get install chromium" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
