#!/usr/bin/env bash
# Builds KWOK (sigs.k8s.io/kwok: simulated Nodes and pod lifecycles against a real apiserver, no
# kubelet) from the Go module proxy and prints the folder that holds it, cached under
# ~/.cache/archway/kwok/<version>/ (a second run builds nothing):
#   <folder>/kwok     the binary (`go install sigs.k8s.io/kwok/cmd/kwok@<version>`, ~2.5 min cold)
#   <folder>/stage/   the module's own Stages (kustomize/stage: node-initialize, heartbeat, pod-ready,
#                     ...), which lab/cluster/kwok.py writes into KWOK's configuration file
#   scripts/kwok-build.sh                      the pinned version below
#   ARCHWAY_KWOK_VERSION=v0.7.0 scripts/kwok-build.sh
set -euo pipefail
NAME=kwok
KWOK=${ARCHWAY_KWOK_VERSION:-v0.8.0}
CACHE=${ARCHWAY_KWOK_CACHE:-$HOME/.cache/archway/kwok}
out="$CACHE/$KWOK"
built() { [ -x "$out/kwok" ] && [ -d "$out/stage" ]; }
. "$(dirname "$0")/lib/go-module-build.sh"

gomodule_begin "sigs.k8s.io/kwok@$KWOK"
[ -d "$module_dir/kustomize/stage" ] || { say "sigs.k8s.io/kwok@$KWOK holds no kustomize/stage"; exit 1; }
gomodule_install "sigs.k8s.io/kwok/cmd/kwok@$KWOK"
mkdir -p "$out"
rm -rf "$out/stage"
cp -r "$module_dir/kustomize/stage" "$out/stage"
chmod -R u+w "$out/stage"
mv "$work/bin/kwok" "$out/kwok"
say "built kwok into $out"
echo "$out"
