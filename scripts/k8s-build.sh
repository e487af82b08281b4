#!/usr/bin/env bash
# Builds a real Kubernetes control plane and node from the Go module proxy and prints the folder
# that holds it: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet
# and kube-proxy, cached under ~/.cache/archway/k8s/<version>/ (a second run builds nothing; a
# cache missing some of them builds only those).
#   scripts/k8s-build.sh            the pinned version below
#   ARCHWAY_K8S_VERSION=v1.36.3 ARCHWAY_ETCD_VERSION=v3.6.16 scripts/k8s-build.sh
#   scripts/k8s-build.sh --node-arch arm64   a node's kubelet and kube-proxy for another
#                                            architecture (cross-compiled), in <version>/linux-arm64/,
#                                            with kube-scheduler (archway's second scheduler there)
#   scripts/k8s-build.sh --cached   builds nothing: exit 0 (and the folder) when all are built, 1 if not
# `go install k8s.io/kubernetes/cmd/...@v` refuses the module (its go.mod replaces every staging
# module by a folder), so a wrapper module requires it and replaces each staging module by its
# published v0.<minor>.<patch> instead; etcd's server gets the same treatment. Notes and measured
# costs: docs/real-control-plane.md.
set -euo pipefail
K8S=${ARCHWAY_K8S_VERSION:-v1.37.2}
ETCD=${ARCHWAY_ETCD_VERSION:-v3.7.3}
CACHE=${ARCHWAY_K8S_CACHE:-$HOME/.cache/archway/k8s}
out="$CACHE/$K8S"
kube_binaries=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)
etcd_binaries=(etcd)
cross=()
if [ "${1:-}" = "--node-arch" ]; then
  # Go cross-compiles these without a C toolchain (CGO_ENABLED=0 below).
  cross=(GOARCH="${2:?--node-arch needs an architecture (arm64, ppc64le, s390x)}")
  out="$CACHE/$K8S/linux-$2"
  kube_binaries=(kubelet kube-proxy kube-scheduler)
  etcd_binaries=()
fi

missing() { for b in "$@"; do [ -x "$out/$b" ] || echo "$b"; done; }
find_missing() {
  mapfile -t missing_kube < <(missing "${kube_binaries[@]}")
  mapfile -t missing_etcd < <(missing "${etcd_binaries[@]}")
  ((${#missing_kube[@]} + ${#missing_etcd[@]} > 0))
}
find_missing || { echo "$out"; exit 0; }
[ "${1:-}" != --cached ] || exit 1
# One build at a time: a second caller (another `up`, a test starting a control plane) waits
# for the first and then finds the binaries built instead of building them again beside it.
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
flock 9
find_missing || { echo "$out"; exit 0; }

say() { echo "k8s-build: $*" >&2; }
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-mod=mod CGO_ENABLED=0
mkdir -p "$CACHE"
work=$(mktemp -d "$CACHE/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
log="$CACHE/build-$K8S.log"
: >"$log"
step() {  # step NAME CMD...: runs CMD in the wrapper folder, its output into the build log
  say "$1 (log: $log)"
  if ! (cd "$work/$mod" && "${@:2}") >>"$log" 2>&1; then
    say "FAILED: $1 — last lines of $log:"; tail -n 25 "$log" >&2; exit 1
  fi
}

# --- kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet, kube-proxy ----
mkdir -p "$work/bin"
mod=k8s; mkdir -p "$work/$mod"
# Any go reads the module's go.mod; the build needs one at least as new as its `go` line.
any_go=$(command -v go || echo /usr/local/go/bin/go)
[ -x "$any_go" ] || any_go=$(bash "$(dirname "$0")/go-toolchain.sh" 1.21)
upstream=$("$any_go" mod download -json "k8s.io/kubernetes@$K8S" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
[ -n "$upstream" ] || { say "the module proxy does not serve k8s.io/kubernetes@$K8S"; exit 1; }
go=$(bash "$(dirname "$0")/go-toolchain.sh" "$(sed -n 's/^go //p' "$upstream")")
PATH="$(dirname "$go"):$PATH"
minor_patch=${K8S#v1.}                       # 37.2
staging_version="v0.$minor_patch"
{
  echo "module archway.local/k8s"
  grep -E '^(go|godebug) ' "$upstream"
  echo "require k8s.io/kubernetes $K8S"
  echo "replace ("
  sed -n 's|^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/.*|\t\1 => \1 '"$staging_version"'|p' "$upstream"
  echo ")"
} >"$work/$mod/go.mod"
cat >"$work/$mod/tools.go" <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
EOF
# The version stamp hack/lib/version.sh writes: without it /version says v0.0.0-master, helm's
# kubeVersion checks fail and feature-gate defaults follow the wrong release.
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$K8S -X $pkg.gitMajor=1 -X $pkg.gitMinor=${minor_patch%%.*}"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
done
if ((${#missing_kube[@]})); then
  step "resolving k8s.io/kubernetes $K8S and its staging modules ($staging_version)" go mod tidy -e
  step "building ${missing_kube[*]}" \
    env "${cross[@]}" go build -trimpath -tags selinux,notest,grpcnotrace -ldflags "$ldflags" -o "$work/bin/" \
    "${missing_kube[@]/#/k8s.io/kubernetes/cmd/}"
fi

# --- etcd ------------------------------------------------------------------------------------
if ((${#missing_etcd[@]})); then
mod=etcd; mkdir -p "$work/$mod"
etcd_mod=$(go mod download -json "go.etcd.io/etcd/server/v3@$ETCD" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
[ -n "$etcd_mod" ] || { say "the module proxy does not serve go.etcd.io/etcd/server/v3@$ETCD"; exit 1; }
{
  echo "module archway.local/etcd"
  grep -E '^go ' "$etcd_mod"
  echo "require go.etcd.io/etcd/server/v3 $ETCD"
  echo "replace ("
  # ../api, ../client/pkg, ...: the sibling modules, published at the same version; etcd 3.5's
  # client/v2 module numbers it v2.3<minor, 2 digits>.<patch> (v3.5.35 -> v2.305.35).
  etcd_v2=$(echo "$ETCD" | awk -F'[v.]' '{printf "v2.3%02d.%s", $3, $4}')
  sed -n 's|^[[:space:]]*\(go\.etcd\.io/etcd/[a-z0-9/]*\) => \.\./.*|\1|p' "$etcd_mod" |
    while read -r module; do
      case "$module" in */v2) printf '\t%s => %s %s\n' "$module" "$module" "$etcd_v2" ;;
                        *) printf '\t%s => %s %s\n' "$module" "$module" "$ETCD" ;; esac
    done
  echo ")"
} >"$work/$mod/go.mod"
cat >"$work/$mod/main.go" <<'EOF'
// etcd's own main: server/main.go calls etcdmain.Main the same way.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
step "resolving go.etcd.io/etcd/server/v3 $ETCD" go mod tidy -e
step "building etcd" go build -trimpath -ldflags "-s -w" -o "$work/bin/etcd" .
fi

mkdir -p "$out"
for b in "${missing_kube[@]}" "${missing_etcd[@]}"; do mv "$work/bin/$b" "$out/$b"; done
say "built ${missing_kube[*]} ${missing_etcd[*]} into $out"
echo "$out"
