"""The one-machine lab's command line, behind `scripts/cluster.sh`:

    python -m lab up [--archway-config FILE] [--values FILE] [--kwok-nodes N | --real-node |
                      --in-cluster | --karpenter] [--vm-node ARCH ...]
                                                       (last line: export KUBECONFIG=...)
    python -m lab status
    python -m lab down
    python -m lab vm-image ARCH    the VM node's image and binaries, built now (cached)

State and logs live in $ARCHWAY_CLUSTER_DIR (default ~/.local/state/archway/cluster). `up`
records where (~/.local/state/archway/cluster-dir): `status` and `down` in a new shell, without
the variable, find the cluster that `up` started.
"""
import argparse
import os
import shutil
import sys

import yaml

from lab.cluster import incluster, karpenter, kwok, realnode, vmnode
from lab.cluster.chart import ChartInstall, deep_merge
from lab.cluster.controlplane import ControlPlane


def _state_base() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "archway")


def default_state_dir() -> str:
    return os.environ.get("ARCHWAY_CLUSTER_DIR") or os.path.join(_state_base(), "cluster")


def record_path() -> str:
    """Where `up` writes the state folder it started in, for `down` and `status` to find."""
    return os.path.join(_state_base(), "cluster-dir")


def recorded_state_dir() -> str | None:
    try:
        with open(record_path()) as f:
            recorded = f.read().strip()
    except OSError:
        return None
    return recorded if os.path.isabs(recorded) else None


def record_state_dir(state_dir: str) -> None:
    os.makedirs(os.path.dirname(record_path()), exist_ok=True)
    with open(record_path(), "w") as f:
        f.write(os.path.abspath(state_dir) + "\n")


def forget_state_dir(state_dir: str) -> None:
    """The record goes with the cluster it names (never another `up`'s)."""
    if recorded_state_dir() == os.path.abspath(state_dir):
        os.unlink(record_path())


def state_dir_of(command: str) -> str:
    """--state-dir's default: $ARCHWAY_CLUSTER_DIR; else, for `status` and `down`, the folder
    the last `up` recorded; else ~/.local/state/archway/cluster."""
    if not os.environ.get("ARCHWAY_CLUSTER_DIR") and command in ("status", "down"):
        recorded = recorded_state_dir()
        if recorded:
            return recorded
    return default_state_dir()


class Refused(Exception):
    """`up` starts nothing: what to tell the user, and the exit status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def up(args) -> int:
    try:
        fragment, values = prepare(args)
    except Refused as e:
        print(f"cluster.sh: {e}", file=sys.stderr)
        return e.status
    plane = ControlPlane(args.state_dir, **plane_options(args))
    steps = ["control plane"]
    try:
        about = start(plane, args, fragment, values, steps)
    except Exception as e:   # whatever failed, nothing of the cluster or its node stays
        clean_up_after(plane, args.state_dir, steps[-1], e)
        return 1
    return report(plane, args, about)


def prepare(args) -> tuple[dict, dict]:
    """archway's configuration fragment and the Helm values of an `up` that may start (the
    state folder of a cluster that is down is removed); Refused otherwise."""
    if os.path.exists(os.path.join(args.state_dir, "processes.json")):
        if any(ControlPlane.load(args.state_dir).running().values()):
            raise Refused(f"a cluster is already up in {args.state_dir} "
                          f"(`scripts/cluster.sh down` first)", 1)
        shutil.rmtree(args.state_dir)
    fragment: dict = {}
    if args.archway_config:
        with open(args.archway_config) as f:
            fragment = yaml.safe_load(f) or {}
        if not isinstance(fragment, dict):
            raise Refused(f"{args.archway_config} must hold a YAML mapping (archway's "
                          f"configuration keys)", 2)
    values: dict = {}
    for path in args.values or []:
        with open(path) as f:
            values = deep_merge(values, yaml.safe_load(f) or {})
    if args.karpenter and (args.real_node or args.kwok_nodes or args.vm_node):
        raise Refused("--karpenter makes its own Nodes: it goes with neither --real-node, "
                      "--in-cluster, --vm-node nor --kwok-nodes", 2)
    unknown = sorted(set(args.vm_node) - set(vmnode.MACHINES))
    if unknown or realnode.machine_arch() in args.vm_node:
        raise Refused(f"--vm-node {', '.join(unknown or [realnode.machine_arch()])}: a VM node is of "
                      f"a foreign architecture, one of "
                      f"{', '.join(a for a in vmnode.MACHINES if a != realnode.machine_arch())}", 2)
    record_state_dir(args.state_dir)      # before anything starts: `down` finds even a half `up`
    return fragment, values


def plane_options(args) -> dict:
    """ControlPlane's arguments. Every schedulable Node runs its pods: KWOK plays its own Nodes
    (--kwok-nodes) and Karpenter's, so with either the plane makes none of its API-only Nodes,
    which kube-scheduler would fill and nothing would run. With the real node alone, the
    API-only Nodes of the other architectures stay, for archway to choose among; they run
    nothing (docs/real-control-plane.md). A later mapping's `nodes` wins."""
    return {**realnode.plane_options(args.real_node, args.vm_node),
            **karpenter.plane_options(args.karpenter), **kwok.plane_options(args.kwok_nodes)}


def start(plane: ControlPlane, args, fragment: dict, values: dict, steps: list[str]) -> list[str]:
    """Everything `up` starts, in order, each step's name appended to `steps` before it runs;
    the lines that say what runs."""
    print("cluster.sh: building or finding the control plane binaries ...", file=sys.stderr)
    plane.start()
    node, lines = None, []
    if args.real_node:
        steps.append("real node (containerd, kubelet, kube-proxy)")
        node = realnode.start_for(plane, fragment)
    for arch in args.vm_node:
        steps.append(f"VM node {arch} (qemu, its kubelet, containerd, kube-proxy)")
        print(f"cluster.sh: {steps[-1]}: booting (a few minutes the first time: its image "
              f"and binaries are built and cached) ...", file=sys.stderr)
        vmnode.start_for(plane, arch, fragment)
    if args.kwok_nodes:
        steps.append(f"{args.kwok_nodes} KWOK Nodes")
        print(f"cluster.sh: control plane up; {steps[-1]} ...", file=sys.stderr)
        lines.append(kwok.describe_kwok_nodes(kwok.start_kwok_nodes(plane, args.kwok_nodes)))
    print(f"cluster.sh: control plane up ({plane.server}); installing archway ...", file=sys.stderr)
    if args.in_cluster:
        assert node is not None   # --in-cluster implies --real-node
        steps.append("archway in the cluster (image, helm install with hooks)")
        installed = incluster.InClusterInstall(plane, node, archway_config=fragment,
                                               values=values).install()
        return lines + incluster.describe(installed)
    steps.append("archway (helm install, hooks, archway serve, second scheduler)")
    install = ChartInstall(plane, archway_config=fragment, values=values).install()
    assert install.webhook and install.extender
    if args.karpenter:
        steps.append("Karpenter (KWOK, its CRDs and RBAC, the process, NodePool default)")
        print(f"cluster.sh: archway up; {steps[-1]} ...", file=sys.stderr)
        lines.append(karpenter.start_with_kwok(plane, install.namespace).describe())
    return lines + [
        f"archway webhook {install.webhook.url} (log {install.webhook.process.log}), extender "
        f"{install.extender.url}, second scheduler '{install.scheduler_name}'"]


def clean_up_after(plane: ControlPlane, state_dir: str, step: str, error: Exception) -> None:
    """A failed `up`: say where, stop what it started, keep the logs, remove the rest."""
    print(f"cluster.sh: up failed at: {step}: {type(error).__name__}: {error}", file=sys.stderr)
    print(f"cluster.sh: logs are in {plane.path('logs')}; cleaning up", file=sys.stderr)
    vmnode.teardown_vms(plane)
    realnode.teardown(plane)
    plane.stop()
    keep = os.path.join(os.path.dirname(state_dir), "cluster-failed-logs")
    shutil.rmtree(keep, ignore_errors=True)
    if os.path.isdir(plane.path("logs")):
        shutil.copytree(plane.path("logs"), keep)
        print(f"cluster.sh: the logs were kept in {keep}", file=sys.stderr)
    shutil.rmtree(state_dir, ignore_errors=True)
    forget_state_dir(state_dir)


def report(plane: ControlPlane, args, about_archway: list[str]) -> int:
    nodes = [f"{n} ({a})" for n, a in plane.nodes] + [
        f"{n} ({a}, real)" for n, a in realnode.real_nodes(plane)] + [
        f"{n} ({a}, real, VM)" for n, a in vmnode.vm_nodes(plane)] + (
        [f"{args.kwok_nodes} KWOK Nodes"] if args.kwok_nodes else [])
    print(f"cluster.sh: nodes: {', '.join(nodes) or 'none yet'}", file=sys.stderr)
    for line in about_archway:
        print(f"cluster.sh: {line}", file=sys.stderr)
    print(f"cluster.sh: kubectl: {kubectl_on_path(plane.binary('kubectl'))}", file=sys.stderr)
    print(f"cluster.sh: state and logs in {args.state_dir}; stop with: bash scripts/cluster.sh down",
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
        forget_state_dir(args.state_dir)
        return 0
    plane = ControlPlane.load(args.state_dir)
    left = vmnode.teardown_vms(plane) + realnode.teardown(plane)
    plane.stop()
    shutil.rmtree(args.state_dir, ignore_errors=True)
    forget_state_dir(args.state_dir)
    if left:
        print("cluster.sh: could not remove: " + "; ".join(left), file=sys.stderr)
        return 1
    print(f"cluster.sh: stopped and removed {args.state_dir}", file=sys.stderr)
    return 0


def vm_image(args) -> int:
    """Build (or find cached) what a VM node of `args.arch` boots: scripts/setup.sh --test
    makes them before the tests, where no test's timeout counts the minutes."""
    machine = vmnode.MACHINES[args.arch]
    image = vmnode.vm_image(machine, log=lambda line: print(f"cluster.sh: {line}", file=sys.stderr))
    print(os.path.dirname(image.rootfs))
    print(vmnode.node_binaries(args.arch))
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


def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/cluster.sh", description=(
        "A real Kubernetes control plane on this machine (etcd, kube-apiserver, "
        "kube-controller-manager, kube-scheduler built from source; Nodes of several "
        "architectures, no kubelet) with archway installed by its Helm chart and running here."))
    parser.add_argument("--state-dir",
                        help="where processes, certificates and logs live (default: "
                             "$ARCHWAY_CLUSTER_DIR; for status and down, else where the last "
                             "up ran; else ~/.local/state/archway/cluster)")
    sub = parser.add_subparsers(dest="command", required=True)
    starting = sub.add_parser("up", help="start it (prints `export KUBECONFIG=...` last)")
    starting.add_argument("--archway-config", metavar="FILE",
                          help="a YAML fragment of archway's configuration, deep-merged over the "
                               "one the chart renders (e.g. registry.insecure_hosts)")
    starting.add_argument("--values", metavar="FILE", action="append",
                          help="extra Helm values for the chart (repeatable)")
    starting.add_argument("--kwok-nodes", metavar="N", type=int, default=0,
                          help="N Nodes simulated by KWOK (amd64, arm64, some ppc64le; pods "
                               "bound to them become Running) in place of the API-only Nodes")
    starting.add_argument("--karpenter", action="store_true",
                          help="no Nodes until Karpenter's KWOK provider launches them: KWOK, "
                               "Karpenter (NodePool default: amd64 and arm64, arm64 20%% "
                               "cheaper) as its chart's ServiceAccount, leader election on")
    starting.add_argument("--real-node", action="store_true",
                          help="one real node of this machine's architecture (containerd, "
                               "kubelet, kube-proxy) in place of the API-only Nodes of that "
                               "architecture (those of the others stay for archway to choose "
                               "among, and run nothing)")
    starting.add_argument("--in-cluster", action="store_true",
                          help="archway's image built from this checkout and installed by helm "
                               "on the real node, hooks and all (implies --real-node)")
    starting.add_argument("--vm-node", metavar="ARCH", action="append", default=[],
                          help="a real node of a foreign architecture (arm64, ppc64le, s390x): "
                               "a Debian VM under qemu-system whose own kubelet, containerd and "
                               "kube-proxy join, in place of the API-only Nodes of that "
                               "architecture (repeatable; root only)")
    starting.set_defaults(func=up)
    sub.add_parser("down", help="stop every process it started and remove its state"
                   ).set_defaults(func=down)
    sub.add_parser("status", help="which of its processes run").set_defaults(func=status)
    image = sub.add_parser("vm-image", help="build what a VM node boots (cached): its image, "
                                            "kernel and cross-compiled kubelet")
    image.add_argument("arch", choices=sorted(vmnode.MACHINES))
    image.set_defaults(func=vm_image)
    return parser


def parse(argv=None) -> argparse.Namespace:
    args = command_line().parse_args(argv)
    args.state_dir = args.state_dir or state_dir_of(args.command)
    if getattr(args, "in_cluster", False):
        args.real_node = True   # --in-cluster implies --real-node
    return args


def main(argv=None) -> int:
    args = parse(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
