#!/usr/bin/env bash
# Builds KWOK (sigs.k8s.io/kwok: simulated Nodes and pod lifecycles against a real apiserver, no
# kubelet) from the Go module proxy and prints the folder that holds it, cached under
# ~/.cache/archway/kwok/<version>/ (a second run builds nothing):
#   <folder>/kwok     the binary (`go install sigs.k8s.io/kwok/cmd/kwok@<version>`, ~2.5 min cold)
#   <folder>/stage/   the module's own Stages (kustomize/stage: node-initialize, heartbeat, pod-ready,
#                     ...), which tests/infra/kwok.py writes into KWOK's configuration file
#   scripts/kwok-build.sh                      the pinned version below
#   ARCHWAY_KWOK_VERSION=v0.7.0 scripts/kwok-build.sh
set -euo pipefail
KWOK=${ARCHWAY_KWOK_VERSION:-v0.8.0}
CACHE=${ARCHWAY_KWOK_CACHE:-$HOME/.cache/archway/kwok}
out="$CACHE/$KWOK"
built() { [ -x "$out/kwok" ] && [ -d "$out/stage" ]; }
if built; then echo "$out"; exit 0; fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"     # one build at a time (see k8s-build.sh)
flock 9
if built; then echo "$out"; exit 0; fi

say() { echo "kwok-build: $*" >&2; }
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-mod=mod CGO_ENABLED=0
mkdir -p "$CACHE"
work=$(mktemp -d "$CACHE/.build-XXXXXX")
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
log="$CACHE/build-$KWOK.log"
: >"$log"
any_go=$(command -v go || echo /usr/local/go/bin/go)
[ -x "$any_go" ] || any_go=$(bash "$(dirname "$0")/go-toolchain.sh" 1.21)
say "downloading sigs.k8s.io/kwok@$KWOK (log: $log)"
json=$(cd "$work" && GOPATH="$work/gopath" "$any_go" mod download -json "sigs.k8s.io/kwok@$KWOK" 2>>"$log") \
  || { say "the module proxy does not serve sigs.k8s.io/kwok@$KWOK"; tail -n 5 "$log" >&2; exit 1; }
dir=$(echo "$json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
gomod=$(echo "$json" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
[ -d "$dir/kustomize/stage" ] || { say "sigs.k8s.io/kwok@$KWOK holds no kustomize/stage"; exit 1; }
go=$(bash "$(dirname "$0")/go-toolchain.sh" "$(sed -n 's/^go //p' "$gomod")")
say "building kwok $KWOK with $("$go" version | cut -d' ' -f3) (log: $log)"
if ! (cd "$work" && GOPATH="$work/gopath" GOBIN="$work/bin" \
      "$go" install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK") >>"$log" 2>&1; then
  say "FAILED — last lines of $log:"; tail -n 25 "$log" >&2; exit 1
fi
mkdir -p "$out"
rm -rf "$out/stage"
cp -r "$dir/kustomize/stage" "$out/stage"
chmod -R u+w "$out/stage"
mv "$work/bin/kwok" "$out/kwok"
say "built kwok into $out"
echo "$out"
