#!/usr/bin/env bash
# Sets up a fresh machine for the tests (idempotent) and runs them. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec python3 -m pytest "$@"
