#!/usr/bin/env bash
# Installs archway and runs the webhook + extender on https://127.0.0.1:8443 with a self-signed
# certificate (generated once into ~/.local/state/archway). No cluster needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec archway serve "$@"
