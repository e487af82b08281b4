# Sourced by the scripts: the virtual environment archway is installed into and run from.
# Debian's python3 is externally managed (PEP 668): nothing is ever installed into it.
# ARCHWAY_VENV chooses another place (default: .venv in the checkout).
ARCHWAY_VENV="${ARCHWAY_VENV:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv}"
