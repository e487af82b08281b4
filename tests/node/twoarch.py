"""Two real architectures for the tier's tests: the real node of this machine's (amd64 here) and
an arm64 node that is a Debian VM under qemu-system-aarch64 (lab/cluster/vmnode.py) with its own
kubelet, containerd and runc, beside a real control plane. No API-only arm64 Node remains, so
every pod archway sends to arm64 is pulled and started by an arm64 kubelet.

The host registers qemu-user for arm64 (the image build needs it): an arm64 binary placed on the
amd64 node by mistake would run there, emulated. So on that side where a pod is bound is the
proof; the VM registers no emulator and is the strict side: an amd64 binary fails there with the
kernel's real exec format error.
"""
import contextlib
import os
import shutil

import pytest

from lab.cluster.controlplane import ControlPlane
from lab.cluster.nodeimages import OciImage, go_binary, machine_arch, push_index
from lab.cluster.realnode import RealNode, api_only_nodes, node_address, teardown
from lab.cluster.vmimage import MACHINES
from lab.cluster.vmnode import VmNode, teardown_vms, vm_leftovers
from lab.kube import pod_path

FOREIGN = "arm64"
HOST = machine_arch()
ARCHES = "archway.dev/architectures"
START_TIMEOUT = 240.0      # an emulated node pulls and starts a container in seconds; a busy CI
                           # machine's TCG may take minutes


@contextlib.contextmanager
def two_real_nodes(session_node, node_registry, tmp_path_factory, name: str):
    """(plane, amd64 RealNode, arm64 VmNode), both pulling from `node_registry`; afterwards
    nothing of them is left on this machine (asserted)."""
    if os.geteuid() != 0 or shutil.which(MACHINES[FOREIGN].qemu) is None:
        pytest.fail(f"the two-architecture tier needs root and {MACHINES[FOREIGN].qemu} (Debian's "
                    f"{MACHINES[FOREIGN].qemu_package}; scripts/setup.sh --test installs it)",
                    pytrace=False)
    if HOST == FOREIGN:
        pytest.fail("this tier boots an arm64 VM beside an amd64 machine's real node", pytrace=False)
    session_node.stop()          # one real node per machine: the session's makes way
    plane = ControlPlane(str(tmp_path_factory.mktemp(name)), node_ip=node_address(),
                         nodes=api_only_nodes(HOST, FOREIGN))
    try:
        plane.start()
        node = RealNode(plane, insecure_registries=[node_registry.host]).start()
        vm = VmNode(plane, MACHINES[FOREIGN], insecure_registries=[node_registry.host]).start()
        yield plane, node, vm
    finally:
        left = teardown_vms(plane) + teardown(plane)
        plane.stop()
        assert left == [] and vm_leftovers() == [], f"left on this machine: {left + vm_leftovers()}"


def whoami(registry, repo: str, arches: list[str]) -> dict[str, str]:
    """lab/cluster/go/whoami built for each of `arches`, pushed as `repo:<arch>`, and as an
    index of them all at `repo:multi`; returns arch -> manifest digest (and "index")."""
    digests, entries = {}, []
    for arch in arches:
        # The repository's name in the image: each test's digests are its own, so no node holds
        # them from a test before (a runtime that has a manifest does not fetch it again).
        image = OciImage.of({"/whoami": go_binary("whoami", arch), "/repository": repo.encode()},
                            entrypoint=["/whoami"], arch=arch)
        digests[arch] = image.push(registry, repo, arch)
        entries.append(image.index_entry())
    digests["index"] = push_index(registry, repo, "multi", entries)
    return digests


def wait_running(kube, namespace: str, name: str) -> dict:
    def running():
        obj = kube.get(pod_path(namespace, name))
        statuses = obj["status"].get("containerStatuses") or []
        return obj if statuses and all(s.get("ready") for s in statuses) else None
    return kube.wait_for(running, timeout=START_TIMEOUT, what=f"pod {name} Running")


def log_of(kube, namespace: str, name: str) -> str:
    """The container's first line, read through the apiserver from the kubelet that runs it
    (polled: a container Ready a moment ago may not have its line in the log file yet)."""
    def logged():
        response = kube.session.get(f"{kube.server}{pod_path(namespace, name)}/log", timeout=30)
        assert response.status_code == 200, response.text
        return response.text.strip()
    return kube.wait_for(logged, timeout=60, what=f"pod {name}'s log")
