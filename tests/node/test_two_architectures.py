"""Two real architectures (tests/node/twoarch.py: the real amd64 node and the arm64 VM node) beside
the real control plane, archway installed by its chart and serving from this machine: where every
kind of workload runs, and what an arm64 kubelet reports when an amd64 image is put there.
archway's own arm64 image serving from the arm64 node: test_archway_on_arm64.py.
"""
import json
import time

import pytest

from lab.cluster.chart import ChartInstall
from lab.cluster.realnode import node_address
from lab.cluster.vmimage import MACHINES
from lab.cluster.vmnode import vm_address
from lab.kube import pod_path
from tests.e2e.loop import app_pods, events
from tests.e2e.workloads import create_deployment, create_pod, deployment, describe, pod, pods_of
from tests.node.twoarch import (
    ARCHES,
    FOREIGN,
    HOST,
    START_TIMEOUT,
    log_of,
    two_real_nodes,
    wait_running,
    whoami,
)

# The first test boots both nodes and installs archway (scripts/setup.sh --test built the VM image).
pytestmark = [pytest.mark.slow, pytest.mark.realnode, pytest.mark.vmnode, pytest.mark.timeout(900)]


class TwoArchitectures:
    def __init__(self, plane, node, vm, install, registry):
        self.plane, self.node, self.vm, self.install, self.registry = plane, node, vm, install, registry
        self.kube = plane.kube


@pytest.fixture(scope="module")
def two_arch(session_node, node_registry, tmp_path_factory):
    with two_real_nodes(session_node, node_registry, tmp_path_factory, "two-arch") as (plane, node, vm):
        install = ChartInstall(plane, archway_config={
            "registry": {"insecure_hosts": [node_registry.host]},
            "remediation": {"evict": True}})
        try:
            install.install()
            yield TwoArchitectures(plane, node, vm, install, node_registry)
        finally:
            install.stop_processes()


def test_the_arm64_node_is_an_arm64_kubelet_and_its_packets_stay_here(two_arch):
    kube = two_arch.kube
    info = kube.get(f"/api/v1/nodes/{two_arch.vm.name}")["status"]["nodeInfo"]
    assert info["architecture"] == FOREIGN and info["kernelVersion"].endswith(f"-{FOREIGN}")
    assert info["containerRuntimeVersion"].startswith("containerd://")
    nodes = kube.items("/api/v1/nodes")
    # No API-only Node of either architecture: every pod bound to one of them runs.
    assert {n["metadata"]["name"] for n in nodes
            if n["metadata"]["labels"]["kubernetes.io/arch"] in (HOST, FOREIGN)} == {
        two_arch.node.name, two_arch.vm.name}
    assert two_arch.vm.guard_in_place() and two_arch.node.guard_in_place()
    addresses = {a["type"]: a["address"] for a in kube.get(
        f"/api/v1/nodes/{two_arch.vm.name}")["status"]["addresses"]}
    assert addresses["InternalIP"] == vm_address(MACHINES[FOREIGN])


def test_each_single_architecture_image_runs_on_its_own_node(two_arch):
    kube, registry = two_arch.kube, two_arch.registry
    namespace = two_arch.plane.new_namespace(f"two-arch-single-{int(time.time()) % 10**6}")
    whoami(registry, "whoami/single", [HOST, FOREIGN])
    for arch, node in ((FOREIGN, two_arch.vm.name), (HOST, two_arch.node.name)):
        created = create_pod(kube, namespace, pod(f"only-{arch}", [registry.ref("whoami/single", arch)]))
        assert created["metadata"]["annotations"][ARCHES] == arch, describe(kube, namespace, f"only-{arch}")
        running = wait_running(kube, namespace, f"only-{arch}")
        assert running["spec"]["nodeName"] == node, describe(kube, namespace, f"only-{arch}")
        assert log_of(kube, namespace, f"only-{arch}").strip() == f"running on linux/{arch}"


def test_a_multi_arch_deployment_spreads_and_each_runtime_pulls_its_architectures_manifest(two_arch):
    kube, registry = two_arch.kube, two_arch.registry
    namespace = two_arch.plane.new_namespace(f"two-arch-multi-{int(time.time()) % 10**6}")
    digests = whoami(registry, "whoami/multi", [HOST, FOREIGN])
    mark = registry.mark()
    body = deployment("spread", [registry.ref("whoami/multi", "multi")], replicas=2,
                      topologySpreadConstraints=[{
                          "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                          "whenUnsatisfiable": "DoNotSchedule",
                          "labelSelector": {"matchLabels": {"app": "spread"}}}])
    create_deployment(kube, namespace, body)
    pods = kube.wait_for(lambda: (found := pods_of(kube, namespace, "spread")) and len(found) == 2
                         and found, timeout=30, what="the Deployment's two pods")
    by_node = {}
    for one in pods:
        running = wait_running(kube, namespace, one["metadata"]["name"])
        assert running["metadata"]["annotations"][ARCHES] == ",".join(sorted([HOST, FOREIGN]))
        by_node[running["spec"]["nodeName"]] = running
    assert set(by_node) == {two_arch.node.name, two_arch.vm.name}
    for node, arch, address in ((two_arch.vm.name, FOREIGN, vm_address(MACHINES[FOREIGN])),
                                (two_arch.node.name, HOST, node_address())):
        running = by_node[node]
        name = running["metadata"]["name"]
        assert log_of(kube, namespace, name).strip() == f"running on linux/{arch}"
        # The runtime names the index archway read (archway.dev/images) as the image's digest...
        admitted = {e["image"]: e["digest"] for e in json.loads(
            running["metadata"]["annotations"]["archway.dev/images"])}
        (status,) = running["status"]["containerStatuses"]
        assert status["imageID"].endswith("@" + digests["index"])
        assert admitted[registry.ref("whoami/multi", "multi")] == digests["index"]
        # ...and its own containerd fetched that index's entry for its architecture, no other.
        fetched = {e.path.rsplit("/", 1)[1] for e in registry.requests_since(mark)
                   if e.remote == address and e.agent.startswith("containerd/")
                   and "/v2/whoami/multi/manifests/sha256:" in e.path}
        others = {digests[a] for a in (HOST, FOREIGN) if a != arch}
        assert digests[arch] in fetched and not fetched & others, (node, fetched, digests)


def test_without_archway_an_amd64_image_fails_on_arm64_for_real_and_with_it_moves_to_amd64(two_arch):
    """archway off for the namespace: the scheduler spreads an amd64-only Deployment over both
    nodes, and the arm64 kubelet reports what users meet. archway on again: the pod it never saw
    is found and evicted (or learned from its crash loop), and its replacement runs on amd64."""
    kube, registry = two_arch.kube, two_arch.registry
    namespace = two_arch.plane.new_namespace(f"two-arch-off-{int(time.time()) % 10**6}")
    kube.patch(f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": {"archway.dev/mode": "off"}}})
    whoami(registry, "whoami/amd64", [HOST])
    create_deployment(kube, namespace, deployment(
        "wrong", [registry.ref("whoami/amd64", HOST)], replicas=2, terminationGracePeriodSeconds=0,
        # The operator's own rule: the two architectures the cluster runs (not the API-only ones).
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{
                "key": "kubernetes.io/arch", "operator": "In", "values": [HOST, FOREIGN]}]}]}}},
        topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                    "whenUnsatisfiable": "DoNotSchedule",
                                    "labelSelector": {"matchLabels": {"app": "wrong"}}}]))

    def failed_on_arm64():
        for one in app_pods(kube, namespace, "wrong"):
            statuses = one["status"].get("containerStatuses") or []
            ended = [s for s in statuses if (s.get("lastState") or {}).get("terminated")
                     or (s.get("state") or {}).get("terminated")]
            if one["spec"].get("nodeName") == two_arch.vm.name and ended:
                return one, ended[0]
        return None
    failing, status = kube.wait_for(failed_on_arm64, timeout=START_TIMEOUT,
                                    what="the amd64 binary to fail on the arm64 node")
    assert ARCHES not in (failing["metadata"].get("annotations") or {})     # archway did not see it
    terminated = (status.get("state") or {}).get("terminated") or status["lastState"]["terminated"]
    print(f"an arm64 kubelet reports an amd64 binary as: {json.dumps(status, sort_keys=True)}")
    assert terminated["exitCode"] == 1 and terminated["reason"] == "Error"
    previous = kube.session.get(f"{kube.server}{pod_path(namespace, failing['metadata']['name'])}/log",
                                params={"previous": "true"} if status.get("lastState", {}).get(
                                    "terminated") else {}, timeout=30).text
    assert "exec format error" in previous, previous

    began = time.monotonic()
    kube.patch(f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": {"archway.dev/mode": None}}})

    def all_on_amd64():
        pods = app_pods(kube, namespace, "wrong")
        return len(pods) == 2 and all(p["spec"].get("nodeName") == two_arch.node.name and all(
            s.get("ready") for s in p["status"].get("containerStatuses") or [{}]) for p in pods) and pods
    kube.wait_for(all_on_amd64, timeout=START_TIMEOUT + 180,
                  what="both replicas Running on the amd64 node")
    print(f"archway on again: both replicas Running on amd64 {time.monotonic() - began:.0f} s later")
    told = {e["reason"] for reason in ("AdmittedWithoutArchway", "EvictedWrongArchitecture",
                                       "EvictedExecFormatError")
            for e in events(kube, namespace, reason)}
    assert told, "archway moved the pod without an Event saying why"


def test_an_amd64_only_daemonset_is_told_the_arm64_node_cannot_run_it_and_runs_on_amd64(two_arch):
    kube, registry = two_arch.kube, two_arch.registry
    namespace = two_arch.plane.new_namespace(f"two-arch-daemons-{int(time.time()) % 10**6}")
    whoami(registry, "whoami/agent", [HOST])
    labels = {"app": "agent"}
    created = kube.create(f"/apis/apps/v1/namespaces/{namespace}/daemonsets", {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "agent"},
        "spec": {"selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{"name": "c0", "image": registry.ref("whoami/agent", HOST)}]}}}})
    (told,) = kube.wait_for(lambda: events(kube, namespace, "ImagesCannotRunOnNodes", "DaemonSet", "agent"),
                            timeout=120, what="an Event on the DaemonSet naming the arm64 node")
    assert told["type"] == "Warning" and told["regarding"]["uid"] == created["metadata"]["uid"]
    assert two_arch.vm.name in told["note"] and two_arch.node.name not in told["note"], told["note"]

    def settled():
        pods = app_pods(kube, namespace, "agent")
        here = [p for p in pods if p["spec"].get("nodeName") == two_arch.node.name]
        return here and all(s.get("ready") for s in here[0]["status"].get("containerStatuses") or [{}]) and pods
    pods = kube.wait_for(settled, timeout=START_TIMEOUT, what="the DaemonSet's amd64 pod Running")
    assert log_of(kube, namespace, [p for p in pods if p["spec"].get("nodeName") == two_arch.node.name][0][
        "metadata"]["name"]).strip() == f"running on linux/{HOST}"
    # Nothing runs, so nothing crash-loops, on the arm64 node: its pod waits unbound.
    assert not [p for p in pods if p["spec"].get("nodeName") == two_arch.vm.name]
    assert all(s.get("restartCount", 0) == 0 for p in pods for s in p["status"].get("containerStatuses") or [])


def test_an_arm64_sif_pulled_over_oras_is_placed_on_the_arm64_node(two_arch, tmp_path):
    """Placement only: containerd does not run SIF (an Apptainer-aware runtime would)."""
    from tests.infra import sifbuild
    kube, registry = two_arch.kube, two_arch.registry
    namespace = two_arch.plane.new_namespace(f"two-arch-sif-{int(time.time()) % 10**6}")
    with open(sifbuild.siftool_image(str(tmp_path), "tool.sif", FOREIGN), "rb") as f:
        registry.push_sif("sif/tool", "v1", f.read())
    image = f"oras://{registry.ref('sif/tool', 'v1')}"
    create_pod(kube, namespace, pod("sif", [image]))
    # Placed at admission, or by the gate controller when reading the SIF outlasted admission's
    # deadline (4 s once on a busy CI machine): bound either way only once placed.
    bound = kube.wait_for(lambda: (obj := kube.get(pod_path(namespace, "sif")))["spec"].get("nodeName")
                          and obj, timeout=120, what="the SIF pod bound")
    assert bound["metadata"]["annotations"][ARCHES] == FOREIGN, describe(kube, namespace, "sif")
    assert bound["spec"]["nodeName"] == two_arch.vm.name
