#!/usr/bin/env bash
# Prints the path of a `go` command of at least version MIN (e.g. 1.26.0), getting one when
# there is none:   scripts/go-toolchain.sh MIN
# A go on PATH or in /usr/local/go that is new enough is used as it is. Otherwise any go (Debian
# 12's golang-go is 1.19: installed when there is no go at all) downloads the toolchain module
# golang.org/toolchain@v0.0.1-go<version>.linux-<arch> from the Go module proxy, the very module
# GOTOOLCHAIN switching uses, into ~/.cache/archway/go/ ($ARCHWAY_GO_TOOLCHAIN: which version,
# default go1.26.10).
set -euo pipefail
min=${1:?usage: scripts/go-toolchain.sh MIN_VERSION}
toolchain=${ARCHWAY_GO_TOOLCHAIN:-go1.26.10}
cache=${ARCHWAY_GO_CACHE:-$HOME/.cache/archway/go}

version_of() { "$1" env GOVERSION 2>/dev/null | sed 's/^go//; s/[^0-9.].*$//'; }
new_enough() {   # new_enough GO: its version >= min
  local v; v=$(version_of "$1") || return 1
  [ -n "$v" ] && [ "$(printf '%s\n%s\n' "$min" "$v" | sort -V | head -1)" = "$min" ]
}

candidates=()
command -v go >/dev/null && candidates+=("$(command -v go)")
candidates+=(/usr/local/go/bin/go "$cache/$toolchain/bin/go")
for go in "${candidates[@]}"; do
  if [ -x "$go" ] && new_enough "$go"; then echo "$go"; exit 0; fi
done

say() { echo "go-toolchain: $*" >&2; }
boot=""
for go in "${candidates[@]}" /usr/lib/go/bin/go; do [ -x "$go" ] && { boot=$go; break; }; done
if [ -z "$boot" ]; then
  say "no go at all: installing Debian's golang-go to fetch $toolchain with"
  bash "$(dirname "$0")/apt-install.sh" golang-go >&2
  boot=/usr/bin/go
fi
arch=$(uname -m); case "$arch" in x86_64) arch=amd64 ;; aarch64) arch=arm64 ;; esac
module="golang.org/toolchain@v0.0.1-$toolchain.linux-$arch"
say "fetching $module from the module proxy (with $("$boot" version | cut -d' ' -f3))"
work=$(mktemp -d)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
dir=$(cd "$work" && GOFLAGS=-mod=mod GOTOOLCHAIN=local GOPATH="$work/gopath" \
      "$boot" mod download -json "$module" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
[ -n "$dir" ] && [ -d "$dir" ] || { say "the module proxy did not serve $module"; exit 1; }
mkdir -p "$cache"
rm -rf "${cache:?}/$toolchain.tmp"
cp -r "$dir" "$cache/$toolchain.tmp"
chmod -R u+w "$cache/$toolchain.tmp"
# Module zips carry no file modes: the go command sets them when it switches toolchains; so here.
chmod +x "$cache/$toolchain.tmp"/bin/* "$cache/$toolchain.tmp"/pkg/tool/*/*
rm -rf "${cache:?}/$toolchain"
mv "$cache/$toolchain.tmp" "$cache/$toolchain"
new_enough "$cache/$toolchain/bin/go" || { say "$toolchain is older than $min"; exit 1; }
echo "$cache/$toolchain/bin/go"
