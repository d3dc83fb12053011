#!/usr/bin/env bash
# Installs what the deploy/ tests need beyond the Python dev extra: `systemd-analyze` (Debian
# package `systemd`), only when it is missing. Needs root (CI and these machines run as root).
set -euo pipefail
if command -v systemd-analyze >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends systemd >/dev/null
command -v systemd-analyze >/dev/null
