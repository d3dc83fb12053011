#!/bin/sh
# Install the Prometheus server (and promtool) and amtool (prometheus-alertmanager) from Debian
# packages, only when missing.
# Idempotent; used by `make deps` / `make test` on fresh CI machines (run as root, or via sudo).
set -eu

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
    && command -v amtool >/dev/null 2>&1; then
    echo "prometheus: $(command -v prometheus), amtool: $(command -v amtool) (already installed)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "ensure_prometheus.sh: prometheus or amtool is missing and this is not root;" >&2
        echo "  run: apt-get update && apt-get install -y --no-install-recommends prometheus prometheus-alertmanager" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    prometheus-alertmanager

# The package's postinst may start a system prometheus on :9090 where an init system runs;
# tests start their own servers on free ports, so that one is harmless.
command -v prometheus >/dev/null 2>&1 || { echo "prometheus still missing" >&2; exit 1; }
command -v amtool >/dev/null 2>&1 || { echo "amtool still missing" >&2; exit 1; }
echo "prometheus: $(command -v prometheus), amtool: $(command -v amtool) (installed)"
