"""The one-machine lab's command line, behind `scripts/cluster.sh`:

    python -m lab up [--archway-config FILE] [--values FILE] [--kwok-nodes N | --real-node |
                      --in-cluster | --karpenter]      (last line: export KUBECONFIG=...)
    python -m lab status
    python -m lab down

State and logs live in $ARCHWAY_CLUSTER_DIR (default ~/.local/state/archway/cluster).
"""
import argparse
import os
import shutil
import sys

import yaml

from lab.cluster import incluster, karpenter, realnode
from lab.cluster.chart import ChartInstall, deep_merge
from lab.cluster.controlplane import ControlPlane
from lab.cluster.kwok import describe_kwok_nodes, start_kwok_nodes


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.environ.get("ARCHWAY_CLUSTER_DIR") or os.path.join(base, "archway", "cluster")


def up(args) -> int:
    state_dir = args.state_dir
    if os.path.exists(os.path.join(state_dir, "processes.json")):
        plane = ControlPlane.load(state_dir)
        if any(plane.running().values()):
            print(f"cluster.sh: a cluster is already up in {state_dir} "
                  f"(`scripts/cluster.sh down` first)", file=sys.stderr)
            return 1
        shutil.rmtree(state_dir)
    fragment = {}
    if args.archway_config:
        with open(args.archway_config) as f:
            fragment = yaml.safe_load(f) or {}
        if not isinstance(fragment, dict):
            print(f"cluster.sh: {args.archway_config} must hold a YAML mapping (archway's "
                  f"configuration keys)", file=sys.stderr)
            return 2
    values = {}
    for path in args.values or []:
        with open(path) as f:
            values = deep_merge(values, yaml.safe_load(f) or {})
    args.real_node = args.real_node or args.in_cluster
    if args.karpenter and (args.real_node or args.kwok_nodes):
        print("cluster.sh: --karpenter makes its own Nodes: it goes with neither --real-node, "
              "--in-cluster nor --kwok-nodes", file=sys.stderr)
        return 2
    plane = ControlPlane(state_dir, **realnode.plane_options(args.real_node),
                         **karpenter.plane_options(args.karpenter))
    step = "control plane"
    try:
        print("cluster.sh: building or finding the control plane binaries ...", file=sys.stderr)
        plane.start()
        node = simulated = None
        if args.real_node:
            step = "real node (containerd, kubelet, kube-proxy)"
            node = realnode.start_for(plane, fragment)
        if args.kwok_nodes:
            step = f"{args.kwok_nodes} KWOK Nodes"
            print(f"cluster.sh: control plane up; {step} ...", file=sys.stderr)
            simulated = start_kwok_nodes(plane, args.kwok_nodes)
        kwok_lines = [describe_kwok_nodes(simulated)] if simulated else []
        print(f"cluster.sh: control plane up ({plane.server}); installing archway ...",
              file=sys.stderr)
        if args.in_cluster:
            step = "archway in the cluster (image, helm install with hooks)"
            in_cluster = incluster.InClusterInstall(plane, node, archway_config=fragment,
                                                    values=values).install()
            return report(plane, state_dir, kwok_lines + incluster.describe(in_cluster))
        step = "archway (helm install, hooks, archway serve, second scheduler)"
        install = ChartInstall(plane, archway_config=fragment, values=values).install()
        if args.karpenter:
            step = "Karpenter (KWOK, its CRDs and RBAC, the process, NodePool default)"
            print(f"cluster.sh: archway up; {step} ...", file=sys.stderr)
            kwok_lines.append(karpenter.start_with_kwok(plane, install.namespace).describe())
    except Exception as e:   # whatever failed, nothing of the cluster or its node stays
        print(f"cluster.sh: up failed at: {step}: {type(e).__name__}: {e}", file=sys.stderr)
        print(f"cluster.sh: logs are in {plane.path('logs')}; cleaning up", file=sys.stderr)
        realnode.teardown(plane)
        plane.stop()
        keep = os.path.join(os.path.dirname(state_dir), "cluster-failed-logs")
        shutil.rmtree(keep, ignore_errors=True)
        if os.path.isdir(plane.path("logs")):
            shutil.copytree(plane.path("logs"), keep)
            print(f"cluster.sh: the logs were kept in {keep}", file=sys.stderr)
        shutil.rmtree(state_dir, ignore_errors=True)
        return 1
    assert install.webhook and install.extender
    return report(plane, state_dir, kwok_lines + [
        f"archway webhook {install.webhook.url} (log {install.webhook.process.log}), extender "
        f"{install.extender.url}, second scheduler '{install.scheduler_name}'"])


def report(plane: ControlPlane, state_dir: str, about_archway: list[str]) -> int:
    nodes = [f"{n} ({a})" for n, a in plane.nodes] + [
        f"{n} ({a}, real)" for n, a in realnode.real_nodes(plane)]
    print(f"cluster.sh: nodes: {', '.join(nodes) or 'none yet'}", file=sys.stderr)
    for line in about_archway:
        print(f"cluster.sh: {line}", file=sys.stderr)
    print(f"cluster.sh: kubectl: {kubectl_on_path(plane.binary('kubectl'))}", file=sys.stderr)
    print(f"cluster.sh: state and logs in {state_dir}; stop with: bash scripts/cluster.sh down",
          file=sys.stderr)
    print(f"export KUBECONFIG={plane.admin_kubeconfig}")
    return 0


def kubectl_on_path(built: str) -> str:
    """Where `kubectl` is: the one on PATH, else the one built with the control plane, linked
    into /usr/local/bin when that is writable (never over another kubectl)."""
    found = shutil.which("kubectl")
    if found:
        return found
    link = "/usr/local/bin/kubectl"
    try:
        os.symlink(built, link)
        return f"{link} -> {built}"
    except OSError:
        return f"{built} (put its folder on PATH)"


def down(args) -> int:
    if not os.path.exists(os.path.join(args.state_dir, "processes.json")):
        print(f"cluster.sh: no cluster in {args.state_dir}", file=sys.stderr)
        shutil.rmtree(args.state_dir, ignore_errors=True)
        return 0
    plane = ControlPlane.load(args.state_dir)
    left = realnode.teardown(plane)
    plane.stop()
    shutil.rmtree(args.state_dir, ignore_errors=True)
    if left:
        print("cluster.sh: could not remove: " + "; ".join(left), file=sys.stderr)
        return 1
    print(f"cluster.sh: stopped and removed {args.state_dir}", file=sys.stderr)
    return 0


def status(args) -> int:
    if not os.path.exists(os.path.join(args.state_dir, "processes.json")):
        print(f"no cluster in {args.state_dir}")
        return 3
    plane = ControlPlane.load(args.state_dir)
    running = plane.running()
    for name, alive in running.items():
        print(f"{name:28} {'running' if alive else 'STOPPED'}  (log {plane.processes[name].log})")
    about_karpenter = karpenter.status_line(plane)
    if about_karpenter:
        print(about_karpenter)
    print(f"export KUBECONFIG={plane.admin_kubeconfig}")
    return 0 if running and all(running.values()) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/cluster.sh", description=(
        "A real Kubernetes control plane on this machine (etcd, kube-apiserver, "
        "kube-controller-manager, kube-scheduler built from source; Nodes of several "
        "architectures, no kubelet) with archway installed by its Helm chart and running here."))
    parser.add_argument("--state-dir", default=default_state_dir(),
                        help="where processes, certificates and logs live (default: "
                             "$ARCHWAY_CLUSTER_DIR or ~/.local/state/archway/cluster)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start it (prints `export KUBECONFIG=...` last)")
    up.add_argument("--archway-config", metavar="FILE",
                    help="a YAML fragment of archway's configuration, deep-merged over the one "
                         "the chart renders (e.g. registry.insecure_hosts)")
    up.add_argument("--values", metavar="FILE", action="append",
                    help="extra Helm values for the chart (repeatable)")
    up.add_argument("--kwok-nodes", metavar="N", type=int, default=0,
                    help="also N Nodes simulated by KWOK (amd64, arm64, some ppc64le; pods "
                         "bound to them become Running)")
    up.add_argument("--karpenter", action="store_true",
                    help="no Nodes until Karpenter's KWOK provider launches them: KWOK, Karpenter "
                         "(NodePool default: amd64 and arm64, arm64 20%% cheaper) as its chart's "
                         "ServiceAccount, leader election on")
    up.add_argument("--real-node", action="store_true",
                    help="one real node of this machine's architecture (containerd, kubelet, "
                         "kube-proxy) instead of its API-only Nodes")
    up.add_argument("--in-cluster", action="store_true",
                    help="archway's image built from this checkout and installed by helm on the "
                         "real node, hooks and all (implies --real-node)")
    up.set_defaults(func=up)
    sub.add_parser("down", help="stop every process it started and remove its state"
                   ).set_defaults(func=down)
    sub.add_parser("status", help="which of its processes run").set_defaults(func=status)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
