"""Pods on the real node: the kubelet's identity, the egress guard, a pod that runs, and what a
real runtime reports for a binary the kernel refuses (exec format error)."""
import json
import time

from lab.cluster.nodeimages import EM_IA_64, OciImage, go_binary, machine_arch, with_machine
from lab.cluster.realnode import BRIDGE, POD_CIDR, node_address
from lab.kube import pod_path


def run_pod(kube, namespace: str, name: str, image: str, node: str) -> dict:
    kube.create(pod_path(namespace), {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": node},
                 "containers": [{"name": "c", "image": image}]}})
    return kube.wait_for(lambda: _finished(kube.get(pod_path(namespace, name))), timeout=120,
                         what=f"pod {name} to finish")


def _finished(pod: dict) -> dict | None:
    return pod if pod["status"].get("phase") in ("Succeeded", "Failed") else None


def pod_log(kube, namespace: str, name: str) -> str:
    response = kube.session.get(f"{kube.server}{pod_path(namespace, name)}/log",
                                params={"container": "c", "limitBytes": 4096}, timeout=30)
    response.raise_for_status()
    return response.text


def test_the_node_is_this_machine_and_its_kubelet_is_a_node_not_an_admin(real_cluster):
    plane, node = real_cluster
    stored = plane.kube.get(f"/api/v1/nodes/{node.name}")
    assert stored["metadata"]["labels"]["kubernetes.io/arch"] == machine_arch()
    assert stored["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    addresses = {a["type"]: a["address"] for a in stored["status"]["addresses"]}
    assert addresses["InternalIP"] == node_address()
    arches = {n["metadata"]["name"]: n["metadata"]["labels"]["kubernetes.io/arch"]
              for n in plane.kube.items("/api/v1/nodes")}
    assert [n for n, a in arches.items() if a == machine_arch()] == [node.name]
    assert len(set(arches.values())) == 3          # the other architectures stay, API-only


def test_the_egress_guard_is_in_place_while_the_node_runs(real_cluster):
    """Read the FORWARD chain (never probe by sending a packet out)."""
    plane, node = real_cluster
    assert node.guard_in_place()
    with open(node.path("cni", "net.d", "10-archway.conflist")) as f:
        (bridge,) = json.load(f)["plugins"]
    assert bridge["bridge"] == BRIDGE and bridge["ipMasq"] is False
    assert bridge["ipam"]["ranges"] == [[{"subnet": POD_CIDR}]]
    with open(node.path("resolv.conf")) as f:
        servers = [line.split()[1] for line in f if line.startswith("nameserver")]
    assert servers == ["127.0.0.1"]


def test_a_binary_the_kernel_refuses_fails_as_a_real_kubelet_reports_it(real_cluster,
                                                                          node_registry, tmp_path):
    """What containerd + runc report for a wrong-architecture binary: exit code 1, reason Error,
    no message; `exec format error` only in the container's log. If a future runtime reports it
    otherwise, this test says so."""
    plane, node = real_cluster
    hello = go_binary("hello", "amd64")
    with open(hello, "rb") as f:
        binary = f.read()
    good = OciImage.of({"/hello": binary if machine_arch() == "amd64" else go_binary("hello")},
                       entrypoint=["/hello"])
    bad = OciImage.of({"/hello": with_machine(binary, EM_IA_64)}, entrypoint=["/hello"])
    good.push(node_registry, "node/hello", "good")
    bad.push(node_registry, "node/hello", "refused")
    namespace = plane.new_namespace(f"runtime-{int(time.time() * 1000) % 10**8}")

    started = time.monotonic()
    ran = run_pod(plane.kube, namespace, "good", f"{node_registry.host}/node/hello:good", node.name)
    took = time.monotonic() - started
    assert ran["status"]["phase"] == "Succeeded", ran["status"]
    assert "hello from a binary" in pod_log(plane.kube, namespace, "good")
    print(f"pod created -> Succeeded on the real node: {took:.1f} s")

    failed = run_pod(plane.kube, namespace, "refused", f"{node_registry.host}/node/hello:refused",
                     node.name)
    (status,) = failed["status"]["containerStatuses"]
    terminated = status["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (1, "Error"), status
    assert "message" not in terminated, status
    assert "exec format error" in pod_log(plane.kube, namespace, "refused")
    print("the runtime reported:", json.dumps(status["state"]))


def test_the_kubelet_is_system_node_under_the_node_authorizer(real_cluster):
    """The kubelet's client certificate: its own Node, yes; another Node or every Secret, no."""
    plane, node = real_cluster
    session = node.kubelet_session()
    other = next(n["metadata"]["name"] for n in plane.kube.items("/api/v1/nodes")
                 if n["metadata"]["name"] != node.name)
    review = session.post(f"{plane.server}/apis/authentication.k8s.io/v1/selfsubjectreviews",
                          json={"apiVersion": "authentication.k8s.io/v1",
                                "kind": "SelfSubjectReview"}, timeout=30).json()
    assert review["status"]["userInfo"]["username"] == f"system:node:{node.name}"
    assert "system:nodes" in review["status"]["userInfo"]["groups"]
    assert session.get(f"{plane.server}/api/v1/nodes/{node.name}", timeout=30).status_code == 200
    assert session.patch(f"{plane.server}/api/v1/nodes/{other}",
                         json={"metadata": {"labels": {"taken": "1"}}}, timeout=30,
                         headers={"Content-Type": "application/merge-patch+json"}
                         ).status_code == 403
    assert session.get(f"{plane.server}/api/v1/secrets", timeout=30).status_code == 403
