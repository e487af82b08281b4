#!/usr/bin/env bash
# Installs what archway needs on a fresh Debian 12 machine (as root, or with sudo).
#   scripts/setup.sh          archway itself (Python packages)
#   scripts/setup.sh --test   also what the tests start: a real registry, Prometheus,
#                             node_exporter, siftool, a forward proxy (tinyproxy), helm, and
#                             the test-only Python packages
# Every step skips what is already installed, so running it again is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"

if [ "${1:-}" = "--test" ]; then
  apt_packages=(docker-registry apache2-utils prometheus prometheus-node-exporter siftool
                squashfs-tools e2fsprogs openssl ca-certificates wrk tinyproxy)
  missing=()
  for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
    # Debian starts these where an init system runs; the tests start their own instances.
    for svc in docker-registry prometheus prometheus-node-exporter tinyproxy; do
      $sudo service "$svc" stop >/dev/null 2>&1 || true
    done
  fi
  $sudo bash scripts/install-helm.sh
  python3 -m pip install -q --disable-pip-version-check -e '.[test]'
else
  python3 -m pip install -q --disable-pip-version-check -e .
fi
