#!/usr/bin/env bash
# Installs what archway needs on a fresh Debian 12 machine (as root, or with sudo).
#   scripts/setup.sh          archway itself (Python packages)
#   scripts/setup.sh --test   also what the tests start: a real registry, Prometheus,
#                             node_exporter, siftool, a forward proxy (tinyproxy), helm, the
#                             image build tools (buildah, mmdebstrap, qemu-user-static), and
#                             the test-only Python packages
# Every step skips what is already installed, so running it again is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"

if [ "${1:-}" = "--test" ]; then
  # buildah & co: tests/test_image.py builds and runs the image (scripts/build-image.sh).
  bash scripts/apt-install.sh docker-registry apache2-utils prometheus prometheus-node-exporter \
    siftool squashfs-tools e2fsprogs openssl ca-certificates wrk tinyproxy \
    buildah mmdebstrap qemu-user-static binfmt-support arch-test
  # Debian starts these where an init system runs; the tests start their own instances.
  for svc in docker-registry prometheus prometheus-node-exporter tinyproxy; do
    $sudo service "$svc" stop >/dev/null 2>&1 || true
  done
  $sudo bash scripts/install-helm.sh
  python3 -m pip install -q --disable-pip-version-check -e '.[test]'
else
  python3 -m pip install -q --disable-pip-version-check -e .
fi
