"""`kubectl debug` on the real node, archway installed by its chart (its own webhook
configuration, called through its Service): an image without the node's architecture gets
archway's warning before anyone waits for the pull error."""
import subprocess

from lab.cluster.nodeimages import machine_arch
from lab.kube import pod_path
from tests.node.test_incluster import fresh_namespace, pause_image


def test_kubectl_debug_with_a_wrong_arch_image_prints_archways_warning(in_cluster, node_registry):
    plane, node = in_cluster.plane, in_cluster.node
    kube = plane.kube
    other = "arm64" if machine_arch() != "arm64" else "amd64"
    node_registry.push_image("node/debug-tools", other, f"linux/{other}")
    wrong = f"{node_registry.host}/node/debug-tools:{other}"
    namespace = fresh_namespace(plane, "debug")
    kube.create(pod_path(namespace), {"metadata": {"name": "x"}, "spec": {
        "containers": [{"name": "c", "image": pause_image(node_registry)}]}})
    kube.wait_for(lambda: kube.get(pod_path(namespace, "x"))["spec"].get("nodeName"),
                  timeout=90, what="the pod bound to the real node")
    assert kube.get(pod_path(namespace, "x"))["spec"]["nodeName"] == node.name

    done = subprocess.run([plane.binary("kubectl"), f"--kubeconfig={plane.admin_kubeconfig}",
                           "-n", namespace, "debug", "pod/x", f"--image={wrong}"],
                          capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    assert (f"Warning: debug image {wrong} cannot run on node {node.name} "
            f"(linux/{machine_arch()}): it has linux/{other}") in done.stderr, done.stderr
    kube.wait_for(lambda: [e for e in kube.events_for(namespace, "x")
                           if e.get("reason") == "ArchwayDebugImageCannotRun"],
                  timeout=30, what="archway's Event on the pod")
