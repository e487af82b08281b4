#!/usr/bin/env bash
# Installs the Debian packages named as arguments that are not installed yet (as root, or with
# sudo): `apt-get update` only runs when something is missing, so calling it again is cheap.
# Prints the packages it installed, one per line (apt's own output goes to stderr), so a caller
# can tell what this run installed from what was there before.
set -euo pipefail
sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
  printf '%s\n' "${missing[@]}"
fi
