#!/usr/bin/env bash
# Sets up a fresh machine for the tests (idempotent: scripts/setup.sh --test) and runs them with
# the virtual environment's Python, its bin first on PATH (the tests start `archway`, helm...).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
bash scripts/setup.sh --test
export PATH="$ARCHWAY_VENV/bin:$PATH"
exec "$ARCHWAY_VENV/bin/python" -m pytest "$@"
