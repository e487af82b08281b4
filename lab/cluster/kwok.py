"""Simulated Nodes at scale on the real control plane (controlplane.py): KWOK (sigs.k8s.io/kwok,
built and cached by scripts/kwok-build.sh) keeps N Node objects Ready and heartbeating (their
Leases) and plays the pods bound to them (Running, completed, deleted), with no kubelet.

    kwok = Kwok(plane).start()                      # ~1 s; one `kwok` process, in plane.processes
    names = kwok.add_nodes(300)                     # mixed amd64 / arm64 / ppc64le, labelled
    kwok.wait_ready(names)                          # KWOK's node-initialize stage ran on each

KWOK's behaviour is its Stages: those of its own module (kustomize/stage, cached beside the
binary) are written into its configuration file here, at start, with one change: node-initialize
reports the Node's kubernetes.io/arch label as status.nodeInfo.architecture (KWOK writes "amd64"
when the Node does not say otherwise). Only Nodes annotated kwok.x-k8s.io/node=fake are KWOK's,
so the plane's other Nodes stay as they are: `scripts/cluster.sh up --kwok-nodes N` makes none of
the plane's API-only Nodes (plane_options), so every Node runs the pods bound to it. Notes
measured here: /work/shared/spec/real-nodes.md ("Simulated nodes at scale") and
docs/real-control-plane.md.
"""
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import yaml

from lab.cluster.controlplane import ControlPlane
from lab.cluster.processes import ControlPlaneError, pid_alive, start_process, tail
from lab.kube import KubeError
from lab.procs import REPO, free_port

KWOK_BUILD = os.path.join(REPO, "scripts", "kwok-build.sh")
ANNOTATION = "kwok.x-k8s.io/node"
LABEL = "archway.dev/simulated"          # on every KWOK Node: what tests select them by
# (stage file in the module's kustomize/stage): Nodes Ready with Leases renewed, pods Running.
STAGES = ("node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
          "pod/fast/pod-ready.yaml", "pod/fast/pod-complete.yaml", "pod/fast/pod-delete.yaml")
ARCH_DEFAULT = '{{ or $nodeInfo.architecture "amd64" }}'
ARCH_FROM_LABEL = '{{ or $nodeInfo.architecture (index .metadata.labels "kubernetes.io/arch") "amd64" }}'
# Pod IPs: a /16 (a /24 holds 254 pod IPs for the whole cluster); apart from the Service range.
POD_CIDR = "10.128.0.0/16"
# (share, arch, instance type, cpu, memory): the fleet's mix, cloud instance types of 4 vCPUs.
FLEET = ((0.45, "amd64", "m6i.xlarge", "4", "16Gi"),
         (0.45, "arm64", "m7g.xlarge", "4", "16Gi"),
         (0.10, "ppc64le", "s922.4x", "4", "32Gi"))
ZONES = ("zone-a", "zone-b", "zone-c")


def build_kwok() -> str:
    """The folder holding `kwok` and its module's `stage/` (built once per version, cached)."""
    done = subprocess.run(["bash", KWOK_BUILD], capture_output=True, text=True)
    if done.returncode != 0:
        raise ControlPlaneError(f"scripts/kwok-build.sh failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def fleet(count: int) -> list[tuple[str, str, str, str, str]]:
    """(name, arch, instance type, cpu, memory) of `count` Nodes in FLEET's proportions,
    interleaved so any prefix of the fleet is mixed too."""
    nodes, made = [], {arch: 0 for _, arch, *_ in FLEET}
    for _ in range(count):
        # The arch furthest below its share so far: amd64, arm64, amd64, arm64, ..., ppc64le.
        _, arch, kind, cpu, memory = min(FLEET, key=lambda f: (made[f[1]] / f[0], -f[0]))
        made[arch] += 1
        nodes.append((f"kwok-{arch}-{made[arch]:05d}", arch, kind, cpu, memory))
    return nodes


def node_object(name: str, arch: str, kind: str, cpu: str, memory: str, index: int) -> dict:
    """A Node as a cloud kubelet registers it: the well-known labels, allocatable (cpu, memory,
    110 pods), an InternalIP; no conditions (KWOK's node-initialize makes it Ready)."""
    resources = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi"}
    zone = ZONES[index % len(ZONES)]
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {ANNOTATION: "fake"},
                         "labels": {"kubernetes.io/arch": arch, "kubernetes.io/os": "linux",
                                    "kubernetes.io/hostname": name,
                                    "node.kubernetes.io/instance-type": kind,
                                    "topology.kubernetes.io/region": "region-1",
                                    "topology.kubernetes.io/zone": f"region-1-{zone}",
                                    LABEL: "kwok"}},
            "status": {"capacity": resources, "allocatable": resources,
                       "addresses": [{"type": "InternalIP",
                                      "address": f"10.250.{index // 250}.{index % 250 + 1}"},
                                     {"type": "Hostname", "address": name}],
                       "nodeInfo": {"architecture": arch, "operatingSystem": "linux",
                                    "kubeletVersion": "", "containerRuntimeVersion": "",
                                    "kernelVersion": "", "osImage": "", "machineID": "",
                                    "systemUUID": "", "bootID": "", "kubeProxyVersion": ""}}}


def configuration(stage_dir: str, port: int) -> str:
    """KWOK's configuration file: a KwokConfiguration and the Stages read from its module."""
    options = {"cidr": POD_CIDR, "nodeLeaseDurationSeconds": 40,
               # With a file these are not defaulted: 0 makes kwok exit at start.
               "nodeLeaseParallelism": 4, "podPlayStageParallelism": 4,
               "nodePlayStageParallelism": 4, "podsOnNodeSyncParallelism": 4,
               "manageAllNodes": False, "manageNodesWithAnnotationSelector": f"{ANNOTATION}=fake",
               "serverAddress": f"127.0.0.1:{port}"}
    docs = [yaml.safe_dump({"apiVersion": "config.kwok.x-k8s.io/v1alpha1",
                            "kind": "KwokConfiguration", "options": options})]
    for stage in STAGES:
        with open(os.path.join(stage_dir, stage)) as f:
            text = f.read()
        if stage.endswith("node-initialize.yaml"):
            if ARCH_DEFAULT not in text:
                raise ControlPlaneError(f"KWOK's {stage} no longer holds {ARCH_DEFAULT!r}: the "
                                        f"arm64 and ppc64le Nodes would report amd64")
            text = text.replace(ARCH_DEFAULT, ARCH_FROM_LABEL)
        docs.append(text)
    return "\n---\n".join(doc.strip() for doc in docs) + "\n"


class Kwok:
    def __init__(self, plane: ControlPlane, folder: str | None = None):
        self.plane = plane
        self.folder = folder

    def start(self) -> "Kwok":
        self.folder = self.folder or build_kwok()
        port = free_port()
        path = self.plane.path("kwok.yaml")
        with open(path, "w") as f:
            f.write(configuration(os.path.join(self.folder, "stage"), port))
        process = start_process("kwok", [
            os.path.join(self.folder, "kwok"), f"--kubeconfig={self.plane.admin_kubeconfig}",
            f"--config={path}", "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={ANNOTATION}=fake",
            f"--server-address=127.0.0.1:{port}", "--v=WARN"], self.plane.state_dir)
        self.plane.processes["kwok"] = process
        self.plane.save()
        time.sleep(0.5)
        if not pid_alive(process.pid):
            raise ControlPlaneError(f"kwok exited at start; its log {process.log} ends:\n"
                                    f"{tail(process.log)}")
        return self

    def add_nodes(self, count: int, *, first: int = 0, parallel: int = 8) -> list[str]:
        """`count` KWOK Nodes (FLEET's mix); their names."""
        assert self.plane.kube is not None
        kube = self.plane.kube
        nodes = fleet(first + count)[first:]

        def create(item):
            index, (name, arch, kind, cpu, memory) = item
            stored = kube.create("/api/v1/nodes", node_object(name, arch, kind, cpu, memory, index))
            return stored["metadata"]["name"]

        with ThreadPoolExecutor(parallel) as pool:
            return list(pool.map(create, enumerate(nodes, start=first)))

    def ready(self) -> dict[str, str]:
        """name -> reported architecture of every KWOK Node that is Ready."""
        assert self.plane.kube is not None
        ready = {}
        for node in self.plane.kube.items("/api/v1/nodes", labelSelector=LABEL):
            conditions = node.get("status", {}).get("conditions") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                ready[node["metadata"]["name"]] = node["status"]["nodeInfo"]["architecture"]
        return ready

    def wait_ready(self, names, timeout: float = 300.0) -> dict[str, str]:
        """Until every Node of `names` is Ready; name -> reported architecture."""
        wanted, end = set(names), time.monotonic() + timeout
        while True:
            process = self.plane.processes.get("kwok")
            if process is not None and not pid_alive(process.pid):
                raise ControlPlaneError(f"kwok exited; its log {process.log} ends:\n"
                                        f"{tail(process.log)}")
            try:
                ready = self.ready()
            except KubeError:
                ready = {}
            if wanted <= ready.keys():
                return {name: ready[name] for name in names}
            if time.monotonic() > end:
                raise ControlPlaneError(f"{len(wanted - ready.keys())} of {len(wanted)} KWOK "
                                        f"Nodes not Ready after {timeout:g} s; kwok's log ends:\n"
                                        f"{tail(self.plane.path('logs', 'kwok.log'))}")
            time.sleep(1)


def plane_options(count: int) -> dict:
    """ControlPlane arguments for a cluster with `count` KWOK Nodes: none of the plane's API-only
    Nodes. They are Ready, untainted and roomier than KWOK's, so kube-scheduler would fill them
    first (110 pods each) and, KWOK not playing them, their pods would stay Pending for ever."""
    return {"nodes": ()} if count else {}


def start_kwok_nodes(plane: ControlPlane, count: int, timeout: float = 600.0) -> dict[str, str]:
    """KWOK on `plane` with `count` Ready Nodes (scripts/cluster.sh up --kwok-nodes N);
    name -> reported architecture."""
    kwok = Kwok(plane).start()
    return kwok.wait_ready(kwok.add_nodes(count), timeout=timeout)


def describe_kwok_nodes(ready: dict[str, str]) -> str:
    archs: dict[str, int] = {}
    for arch in ready.values():
        archs[arch] = archs.get(arch, 0) + 1
    mix = ", ".join(f"{n} {arch}" for arch, n in sorted(archs.items()))
    return f"{len(ready)} KWOK Nodes Ready ({mix}; label {LABEL}=kwok)"
