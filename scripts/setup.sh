#!/usr/bin/env bash
# Installs what archway needs on a Debian 12 machine (as root, or with sudo):
#   scripts/setup.sh          archway itself, in a virtual environment
#   scripts/setup.sh --demo   also Debian's docker-registry, all that scripts/demo.py starts
#   scripts/setup.sh --test   also what the tests start (below) and the test-only Python packages
# Debian's python3 is externally managed (PEP 668): archway goes into the virtual environment
# $ARCHWAY_VENV (default: .venv in the checkout), made with Debian's /usr/bin/python3 when it is
# there, else the first python3 >= 3.11 on PATH ($ARCHWAY_PYTHON chooses one). Every step skips
# what is already done, so running it again is cheap. Services are left alone, except those of
# packages this very run installed (Debian starts them; the tests start their own).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
for_tests=false; for_demo=false
case "${1:-}" in
  --test) for_tests=true ;;
  --demo) for_demo=true ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--demo|--test]" >&2; exit 2 ;;
esac

# === What the tests start ======================================================================
# One line per server or tool the tests run (each installer skips what is there already).
install_what_the_tests_start() {
  apt_install docker-registry apache2-utils            # registries: TLS, basic and token auth
  apt_install prometheus prometheus-node-exporter      # the extender's traffic data
  apt_install tinyproxy                                # an egress proxy
  apt_install siftool squashfs-tools e2fsprogs         # SIF images
  apt_install openssl wrk zsh                          # certificates, load, shell completion
  apt_install buildah mmdebstrap qemu-user-static binfmt-support arch-test   # the image
  apt_install containerd runc containernetworking-plugins iptables   # a real node (kubelet)
  apt_install qemu-system-arm                          # a VM node of another architecture
  $sudo bash scripts/install-helm.sh "$ARCHWAY_VENV/bin/python"             # helm v3
  bash scripts/k8s-build.sh >/dev/null     # etcd, kube-apiserver, ..., kubelet from source (cached)
  bash scripts/kwok-build.sh >/dev/null    # KWOK: simulated Nodes at scale (cached)
  bash scripts/karpenter-build.sh >/dev/null   # Karpenter's KWOK provider: autoscaling (cached)
  "$ARCHWAY_VENV/bin/python" -m lab vm-image arm64 >/dev/null   # the arm64 VM node's disk and kubelet (cached)
}
# ===============================================================================================

installed=()
apt_install() {
  local line
  while read -r line; do [ -z "$line" ] || installed+=("$line"); done \
    < <(bash scripts/apt-install.sh "$@")
}

python_at_least_3_11() {
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null
}

pick_python() {
  if [ -n "${ARCHWAY_PYTHON:-}" ]; then
    python_at_least_3_11 "$ARCHWAY_PYTHON" && { echo "$ARCHWAY_PYTHON"; return; }
    echo "setup.sh: ARCHWAY_PYTHON=$ARCHWAY_PYTHON is not a python >= 3.11" >&2; exit 1
  fi
  local candidate
  for candidate in /usr/bin/python3 $(type -ap python3 python3.13 python3.12 python3.11); do
    python_at_least_3_11 "$candidate" && { echo "$candidate"; return; }
  done
  echo "setup.sh: no python3 >= 3.11 (apt-get install python3, or set ARCHWAY_PYTHON)" >&2
  exit 1
}

# python3-venv: Debian's venv module without it cannot install pip into a new environment.
apt_install python3 python3-venv ca-certificates
if ! python_at_least_3_11 "$ARCHWAY_VENV/bin/python"; then
  python=$(pick_python)
  echo "setup.sh: creating the virtual environment $ARCHWAY_VENV ($python)" >&2
  "$python" -m venv --clear "$ARCHWAY_VENV"
fi

# Installed again only when pyproject.toml (the dependencies), the checkout or the extras
# change; an install with the test extras also serves plain setup.sh. The tests draw the bench's
# plots too, so they install its optional plotting library (the bench extra).
extras=""; $for_tests && extras="[test,bench]"
installed_for="$(sha256sum pyproject.toml | cut -d' ' -f1) $PWD"
stamp="$ARCHWAY_VENV/.archway-installed"
case "$(cat "$stamp" 2>/dev/null)" in
  "$installed_for [test,bench]") up_to_date=true ;;
  "$installed_for ") [ -z "$extras" ] && up_to_date=true || up_to_date=false ;;
  *) up_to_date=false ;;
esac
if ! $up_to_date || ! "$ARCHWAY_VENV/bin/archway" --version >/dev/null 2>&1; then
  "$ARCHWAY_VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".$extras"
  echo "$installed_for $extras" >"$stamp"
fi

if $for_tests; then
  install_what_the_tests_start
elif $for_demo; then
  apt_install docker-registry      # the demo's local registry (scripts/demo.py)
fi

# Debian starts the servers it installs where an init system runs; the tests start their own
# instances. Stop only those whose package this run installed: one that was there before may
# be the user's own.
for service in docker-registry prometheus prometheus-node-exporter tinyproxy containerd; do
  for package in "${installed[@]}"; do
    if [ "$package" = "$service" ]; then
      $sudo service "$service" stop >/dev/null 2>&1 || true
    fi
  done
done
