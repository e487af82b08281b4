#!/usr/bin/env bash
# Installs archway (scripts/setup.sh: a virtual environment) and runs the webhook + extender on
# https://127.0.0.1:8443 with a self-signed certificate (generated once into
# ~/.local/state/archway). No cluster needed. Arguments go to `archway serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
bash scripts/setup.sh
exec "$ARCHWAY_VENV/bin/archway" serve "$@"
