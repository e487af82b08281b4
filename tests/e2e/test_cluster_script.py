"""`scripts/cluster.sh` as an operator (or an acceptance test) uses it: up with a config fragment,
a workload placed through it, status, down; a failed up that says where it failed and leaves
nothing running; up with Karpenter; and up with KWOK Nodes, every one of which runs its pods."""
import os
import subprocess

import yaml

from lab.cluster.kwok import ANNOTATION
from lab.kube import Kube, pod_path
from lab.procs import REPO

from .workloads import arches_of, create_deployment, deployment, wait_bound

SCRIPT = os.path.join(REPO, "scripts", "cluster.sh")


def cluster_sh(state_dir, *args, timeout=300, variable=True) -> subprocess.CompletedProcess:
    """scripts/cluster.sh with ARCHWAY_CLUSTER_DIR=`state_dir` (variable=False: as a new shell
    without it runs), recording where `up` ran beside `state_dir`, never in the user's home."""
    env = {k: v for k, v in os.environ.items() if k != "ARCHWAY_CLUSTER_DIR"}
    env.update(ARCHWAY_SKIP_SETUP="1", XDG_STATE_HOME=os.path.join(os.path.dirname(state_dir),
                                                                   "xdg-state"))
    if variable:
        env["ARCHWAY_CLUSTER_DIR"] = str(state_dir)
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def running_under(path) -> list[str]:
    """Command lines of the processes that name `path` (what an `up` there started)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat", "rb") as f:
                zombie = f.read().split(b") ", 1)[1][:1] == b"Z"
        except OSError:
            continue
        if str(path) in line and not zombie and int(pid) != os.getpid():
            found.append(line)
    return found


def admin_of(state) -> Kube:
    """A client of the cluster `up` started in `state`, as its admin kubeconfig says."""
    with open(state / "admin.kubeconfig") as f:
        config = yaml.safe_load(f)
    return Kube(config["clusters"][0]["cluster"]["server"], config["users"][0]["user"]["token"],
                config["clusters"][0]["cluster"]["certificate-authority"])


def test_up_places_a_workload_then_down_stops_everything(tmp_path, images):
    state = tmp_path / "cluster"
    fragment = tmp_path / "archway.yaml"
    fragment.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [images.registry.host]}}))
    up = cluster_sh(state, "up", "--archway-config", str(fragment))
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        last = up.stdout.strip().splitlines()[-1]
        assert last == f"export KUBECONFIG={state}/admin.kubeconfig", up.stdout
        kube = admin_of(state)
        nodes = {n["metadata"]["name"]: n["metadata"]["labels"]["kubernetes.io/arch"]
                 for n in kube.items("/api/v1/nodes")}
        assert sorted(nodes.values()) == ["amd64", "amd64", "arm64", "arm64", "ppc64le"]
        assert all(n["status"]["allocatable"]["pods"] == "110" for n in kube.items("/api/v1/nodes"))
        assert kube.get("/version")["gitVersion"].startswith("v1.")

        kube.create("/api/v1/namespaces", {"metadata": {"name": "shop"}})
        kube.wait_for(lambda: kube.get("/api/v1/namespaces/shop/serviceaccounts/default"), timeout=30)
        create_deployment(kube, "shop", deployment("web", [images.ref("e2e/arm64")], replicas=4))
        assert arches_of(kube, wait_bound(kube, "shop", "web", 4)) == {"arm64"}

        status = cluster_sh(state, "status")
        assert status.returncode == 0, status.stdout
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                     "archway-webhook", "archway-extender", "archway-scheduler"):
            assert f"{name} " in status.stdout and "STOPPED" not in status.stdout
        assert running_under(state)
        # A new shell, without the variable, finds the cluster `up` started (issue 38).
        assert str(state) in cluster_sh(state, "status", variable=False).stdout
    finally:
        down = cluster_sh(state, "down", variable=False)
    assert down.returncode == 0, down.stderr
    assert f"stopped and removed {state}" in down.stderr
    assert not state.exists()
    assert running_under(state) == []
    assert cluster_sh(state, "status").returncode == 3
    assert cluster_sh(state, "status", variable=False).returncode == 3


def test_a_failed_up_names_the_step_and_the_log_and_leaves_nothing_running(tmp_path):
    state = tmp_path / "cluster"
    fragment = tmp_path / "archway.yaml"
    fragment.write_text(yaml.safe_dump({"admission": {"gate_max_secnds": 5}}))   # a typo
    up = cluster_sh(state, "up", "--archway-config", str(fragment))
    assert up.returncode == 1
    assert "up failed at: archway" in up.stderr
    assert "archway serve (archway-webhook) exited at start" in up.stderr
    assert "gate_max_secnds" in up.stderr           # the log's last lines say why
    assert "export KUBECONFIG" not in up.stdout
    assert not state.exists()
    kept = tmp_path / "cluster-failed-logs"
    assert (kept / "archway-webhook.log").exists() and (kept / "kube-apiserver.log").exists()
    assert running_under(state) == []


def test_up_with_karpenter_has_no_node_until_a_pod_needs_one_and_down_stops_it(tmp_path, images):
    state = tmp_path / "cluster"
    fragment = tmp_path / "archway.yaml"
    fragment.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [images.registry.host]}}))
    refused = cluster_sh(state, "up", "--karpenter", "--kwok-nodes", "3")
    assert refused.returncode == 2 and "--karpenter makes its own Nodes" in refused.stderr
    assert not state.exists()
    up = cluster_sh(state, "up", "--karpenter", "--archway-config", str(fragment))
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert "nodes: none yet" in up.stderr and "NodePool default" in up.stderr
        kube = admin_of(state)
        assert kube.items("/api/v1/nodes") == []     # archway's own Deployments were idled
        lease = kube.get("/apis/coordination.k8s.io/v1/namespaces/karpenter/leases/"
                         "karpenter-leader-election")
        assert lease["spec"]["holderIdentity"]       # leader election on

        kube.create("/api/v1/namespaces", {"metadata": {"name": "shop"}})
        kube.wait_for(lambda: kube.get("/api/v1/namespaces/shop/serviceaccounts/default"), timeout=30)
        create_deployment(kube, "shop", deployment("web", [images.ref("e2e/amd64")], replicas=2))
        assert arches_of(kube, wait_bound(kube, "shop", "web", 2, timeout=120)) == {"amd64"}

        status = cluster_sh(state, "status")
        assert status.returncode == 0, status.stdout
        assert "kwok " in status.stdout and "karpenter " in status.stdout
        assert "1 NodeClaims (amd64)" in status.stdout, status.stdout
    finally:
        down = cluster_sh(state, "down")
    assert down.returncode == 0, down.stderr
    assert running_under(state) == []


def test_up_with_kwok_nodes_makes_only_nodes_kwok_plays_and_every_bound_pod_runs(tmp_path, images):
    """Issue 34, finding 8: beside KWOK's Nodes, the plane's five API-only Nodes (Ready,
    untainted, roomier) took the scheduler's pods, which stayed Pending for ever. Now every Node
    is KWOK's: the pods archway places and the ones it skips alike become Running."""
    state = tmp_path / "cluster"
    fragment = tmp_path / "archway.yaml"
    fragment.write_text(yaml.safe_dump({"registry": {"insecure_hosts": [images.registry.host]}}))
    up = cluster_sh(state, "up", "--kwok-nodes", "6", "--archway-config", str(fragment))
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        kube = admin_of(state)
        kube.create("/api/v1/namespaces", {"metadata": {"name": "shop"}})
        kube.wait_for(lambda: kube.get("/api/v1/namespaces/shop/serviceaccounts/default"), timeout=30)
        create_deployment(kube, "shop", deployment("web", [images.ref("e2e/everywhere")], replicas=12))
        skipped = deployment("skipped", [images.ref("e2e/amd64")], replicas=4)
        skipped["spec"]["template"]["metadata"]["annotations"] = {"archway.dev/skip": "true"}
        create_deployment(kube, "shop", skipped)

        def all_running():
            pods = kube.items(pod_path("shop"))
            return pods if len(pods) == 16 and all(
                p.get("status", {}).get("phase") == "Running" for p in pods) else None
        try:
            pods = kube.wait_for(all_running, timeout=120, what="16 pods Running")
        except AssertionError:
            pending = {p["metadata"]["name"]: p["spec"].get("nodeName")
                       for p in kube.items(pod_path("shop"))
                       if p.get("status", {}).get("phase") != "Running"}
            raise AssertionError(f"pods not Running (name -> node): {pending}") from None
        nodes = kube.items("/api/v1/nodes")
        assert len(nodes) == 6
        assert all(n["metadata"]["annotations"].get(ANNOTATION) == "fake" for n in nodes)
        assert {p["spec"]["nodeName"] for p in pods} <= {n["metadata"]["name"] for n in nodes}
        assert "nodes: 6 KWOK Nodes" in up.stderr, up.stderr[-3000:]
    finally:
        down = cluster_sh(state, "down")
    assert down.returncode == 0, down.stderr
    assert running_under(state) == []
