#!/usr/bin/env bash
# Shows archway patching pods, on one machine, with no cluster (scripts/demo.py). Installs only
# what the demo uses: archway in its virtual environment and Debian's docker-registry
# (scripts/setup.sh --demo), never what the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
cat >&2 <<TEXT
demo.sh: installs, each only if missing, archway and its Python packages into $ARCHWAY_VENV
demo.sh: (210 MB; 20 s measured with pip's cache warm) and Debian's docker-registry (5 MB
demo.sh: download, 20 MB installed). Then it runs a local registry and archway serve for a few
demo.sh: seconds (2 s measured, warm) and removes them. Nothing else is installed or left running.
TEXT
bash scripts/setup.sh --demo >/dev/null
export PATH="$ARCHWAY_VENV/bin:$PATH"
exec "$ARCHWAY_VENV/bin/python" scripts/demo.py
