#!/usr/bin/env bash
# Installs what the demo uses (a local registry among them) and shows archway patching pods.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test >/dev/null
exec python3 scripts/demo.py
