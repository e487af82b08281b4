#!/usr/bin/env bash
# Builds Karpenter's KWOK cloud provider (sigs.k8s.io/karpenter/kwok: NodePools and NodeClaims
# launched as KWOK Nodes against a real apiserver) from the Go module proxy and prints the folder
# that holds it, cached under ~/.cache/archway/karpenter/<version>/ (a second run builds nothing):
#   <folder>/karpenter            the binary (the module names it `kwok`; ~3 min cold)
#   <folder>/chart/               its KWOK provider's Helm chart (kwok/charts: CRDs with the
#                                 provider's label rules, ServiceAccount, RBAC, Deployment)
#   <folder>/crds/                those CRDs and the KWOKNodeClass's (kwok/apis/crds)
#   <folder>/instance_types.json  the provider's default instance types
#   scripts/karpenter-build.sh                          the pinned version below
#   ARCHWAY_KARPENTER_VERSION=v1.14.0 scripts/karpenter-build.sh
# Its go.mod wants a Go newer than Debian's or this machine's: go-toolchain.sh fetches one.
set -euo pipefail
NAME=karpenter
KARPENTER=${ARCHWAY_KARPENTER_VERSION:-v1.15.0}
CACHE=${ARCHWAY_KARPENTER_CACHE:-$HOME/.cache/archway/karpenter}
out="$CACHE/$KARPENTER"
built() { [ -x "$out/karpenter" ] && [ -d "$out/crds" ] && [ -d "$out/chart" ] && [ -f "$out/instance_types.json" ]; }
. "$(dirname "$0")/lib/go-module-build.sh"

gomodule_begin "sigs.k8s.io/karpenter@$KARPENTER"
for part in kwok/charts/crds kwok/apis/crds kwok/cloudprovider/instance_types.json; do
  [ -e "$module_dir/$part" ] || { say "sigs.k8s.io/karpenter@$KARPENTER holds no $part"; exit 1; }
done
gomodule_install "sigs.k8s.io/karpenter/kwok@$KARPENTER"
rm -rf "$out"
mkdir -p "$out/crds"
cp -r "$module_dir/kwok/charts" "$out/chart"
cp "$module_dir"/kwok/charts/crds/*.yaml "$module_dir"/kwok/apis/crds/*.yaml "$out/crds/"
cp "$module_dir/kwok/cloudprovider/instance_types.json" "$out/"
chmod -R u+w "$out"
mv "$work/bin/kwok" "$out/karpenter"
say "built karpenter's kwok provider into $out"
echo "$out"
