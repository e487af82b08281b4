#!/usr/bin/env bash
# Installs what the demo uses (a local registry among them) and shows archway patching pods.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
bash scripts/setup.sh --test >/dev/null
export PATH="$ARCHWAY_VENV/bin:$PATH"
exec "$ARCHWAY_VENV/bin/python" scripts/demo.py
