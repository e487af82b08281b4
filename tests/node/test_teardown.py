"""`scripts/cluster.sh up --real-node` and `down`, and a node whose start fails: nothing of the
node is left on this machine afterwards — no process, mount, network namespace, bridge,
iptables chain or rule, cgroup, folder under /var/lib/kubelet or /run/containerd, changed sysctl
(lab/cluster/nodehost.py lists what it looks at)."""
import os
import shutil
import subprocess

import pytest
import yaml

from lab.cluster.controlplane import ControlPlane, ControlPlaneError
from lab.cluster.nodehost import HostRecord, leftovers
from lab.cluster.nodeimages import machine_arch
from lab.cluster.realnode import (
    BRIDGE,
    CGROUP_ROOT,
    RealNode,
    api_only_nodes,
    node_address,
    owned_dirs,
    teardown,
)
from lab.kube import Kube
from lab.procs import REPO

SCRIPT = os.path.join(REPO, "scripts", "cluster.sh")


def cluster_sh(state_dir, *args, timeout=400) -> subprocess.CompletedProcess:
    env = dict(os.environ, ARCHWAY_CLUSTER_DIR=str(state_dir), ARCHWAY_SKIP_SETUP="1",
               XDG_STATE_HOME=os.path.join(os.path.dirname(state_dir), "xdg-state"))
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.mark.timeout(900)      # `up --in-cluster` (400 s at most) and `down`
def test_up_in_cluster_then_down_leaves_nothing_behind(tmp_path, session_node, node_registry):
    """`up --in-cluster` (so pods run: netns, veths, volume mounts, container cgroups), then
    `down`."""
    session_node.stop()                     # one real node per machine at a time
    state = tmp_path / "cluster"
    node_dir = str(state / "node")
    before = HostRecord.take(CGROUP_ROOT, BRIDGE, node_dir, list(owned_dirs(node_dir)))
    fragment = tmp_path / "archway.yaml"
    fragment.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [node_registry.host]}}))
    up = cluster_sh(state, "up", "--in-cluster", "--archway-config", str(fragment))
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert up.stdout.strip().splitlines()[-1] == f"export KUBECONFIG={state}/admin.kubeconfig"
        with open(state / "admin.kubeconfig") as f:
            config = yaml.safe_load(f)
        kube = Kube(config["clusters"][0]["cluster"]["server"], config["users"][0]["user"]["token"],
                    config["clusters"][0]["cluster"]["certificate-authority"])
        ready = {n["metadata"]["name"]: n["metadata"]["labels"]["kubernetes.io/arch"]
                 for n in kube.items("/api/v1/nodes")}
        assert ready[f"{machine_arch()}-node"] == machine_arch()
        assert sorted(ready) == sorted([f"{machine_arch()}-node", *(n for n, _ in api_only_nodes())])
        hosts = os.listdir(state / "node" / "containerd" / "certs.d")
        assert hosts == [node_registry.host]
        running = [p for p in kube.items("/api/v1/namespaces/archway-system/pods")
                   if p["status"].get("phase") == "Running"]
        assert len(running) >= 3, [p["metadata"]["name"] for p in running]   # webhook x2, scheduler
        assert "archway in the cluster" in up.stderr
        status = cluster_sh(state, "status")
        assert "kubelet" in status.stdout and "containerd" in status.stdout, status.stdout
        assert leftovers(before), "the node changed nothing this test could see"
    finally:
        down = cluster_sh(state, "down")
    assert down.returncode == 0, down.stderr[-3000:]
    assert leftovers(before) == []
    assert not state.exists()


def test_a_node_whose_kubelet_fails_to_start_is_cleaned_up(tmp_path, session_node):
    session_node.stop()
    plane = ControlPlane(str(tmp_path / "plane"), node_ip=node_address(),
                         nodes=api_only_nodes()).start()
    try:
        node_dir = plane.path("node")
        before = HostRecord.take(CGROUP_ROOT, BRIDGE, node_dir, list(owned_dirs(node_dir)))
        broken = tmp_path / "bin"
        broken.mkdir()
        for name in os.listdir(plane.bin_dir):
            os.symlink(os.path.join(plane.bin_dir, name), broken / name)
        os.unlink(broken / "kubelet")
        os.symlink(shutil.which("false") or "/bin/false", broken / "kubelet")
        plane.bin_dir = str(broken)
        with pytest.raises(ControlPlaneError, match="kubelet exited at start"):
            RealNode(plane).start()
        assert leftovers(before), "containerd, the guard and the cgroups were made"
        assert teardown(plane) == []
        assert leftovers(before) == []
        assert "containerd" not in plane.processes
    finally:
        teardown(plane)
        plane.stop()
