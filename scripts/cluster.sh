#!/usr/bin/env bash
# A real Kubernetes control plane on this machine with archway installed by its Helm chart:
#
#   bash scripts/cluster.sh up [--archway-config FILE] [--values FILE]
#                                          (last line: export KUBECONFIG=...)
#   bash scripts/cluster.sh up --kwok-nodes N ... N Nodes KWOK plays, and no other
#   bash scripts/cluster.sh up --real-node ...    one real node of this machine's architecture
#   bash scripts/cluster.sh up --in-cluster ...   that node, and archway's image installed on it by helm
#   bash scripts/cluster.sh up --karpenter ...    no Nodes until Karpenter launches them (KWOK provider)
#   bash scripts/cluster.sh status
#   bash scripts/cluster.sh down
#
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl are built from the Go
# module proxy once (scripts/k8s-build.sh, cached in ~/.cache/archway/k8s/<version>/); Nodes of
# several architectures (2 amd64, 2 arm64, 1 ppc64le) are API objects, no kubelet runs. The chart
# is installed with `helm install --no-hooks`, its hooks' commands run here as their
# ServiceAccounts, and `archway serve` (webhook, extender) and the second kube-scheduler run here
# as the chart's ServiceAccounts. FILE: a YAML fragment of archway's configuration deep-merged
# over the chart's (e.g. registry.insecure_hosts). State and logs: ~/.local/state/archway/cluster
# ($ARCHWAY_CLUSTER_DIR; `up` records it, so status and down find it without). --real-node: containerd, a kubelet and kube-proxy run pods for real
# (root only). The API-only Nodes of the other architectures stay, to show archway choosing: Ready,
# schedulable, untainted, they run nothing, so a pod archway skips, or one whose image also runs
# on their architecture, may be bound to one and never start. --in-cluster: archway's image
# built from this checkout, `helm install --wait` with hooks. --kwok-nodes N: N Nodes simulated
# by KWOK (scripts/kwok-build.sh, lab/cluster/kwok.py: amd64, arm64 and some ppc64le, Ready,
# labelled archway.dev/simulated=kwok; pods bound to them become Running) in place of the
# API-only Nodes, so every Node runs its pods (with --real-node: the real node and KWOK's).
# --karpenter: none of the API-only Nodes; Karpenter's KWOK provider (scripts/karpenter-build.sh,
# lab/cluster/karpenter.py) launches Nodes for pending pods from NodePool `default` (amd64 and
# arm64, arm64 20 % cheaper), KWOK makes them Ready and runs their pods.
# Details: docs/real-control-plane.md.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
if [ "${1:-}" = up ] && [ "${ARCHWAY_SKIP_SETUP:-}" != 1 ]; then
  # What it costs, said before anything is built (measured: docs/real-control-plane.md).
  if bash scripts/k8s-build.sh --cached >/dev/null; then
    echo "cluster.sh: Kubernetes is built already (~/.cache/archway/k8s); up takes about 20 s," \
         "--in-cluster 1-2.5 min" >&2
  else
    cat >&2 <<'TEXT'
cluster.sh: a first `up` installs what the tests use (scripts/setup.sh --test: containerd,
cluster.sh: buildah, qemu, Prometheus, helm; ~0.7 GB of Debian packages) and builds Kubernetes,
cluster.sh: KWOK and Karpenter from source with Go: about 15 min on 2 cores, and about 9 GB of
cluster.sh: disk (Go's build cache up to 7 GB in ~/.cache/go-build, its modules 1 GB in ~/go,
cluster.sh: the binaries 0.8 GB in ~/.cache/archway). --in-cluster also builds archway's image
cluster.sh: (~6 min cold, 1 GB more). Later runs reuse all of it: up takes about 20 s.
TEXT
  fi
  bash scripts/setup.sh --test >&2     # the virtualenv, helm, the control plane (cached)
fi
exec "$ARCHWAY_VENV/bin/python" -m lab "$@"
