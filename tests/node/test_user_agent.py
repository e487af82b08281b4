"""archway names itself to registries (issue 38, finding 8): on the real node, with archway
installed by its chart, the node registry's access log shows `archway/<version>` for every
request archway's pods made while admitting a pod -- never python-requests."""
import time

from archway import __version__
from lab.kube import pod_path
from tests.node.test_incluster import fresh_namespace

ARCH_ANNOTATION = "archway.dev/architectures"


def test_the_node_registry_sees_archway_and_its_version(in_cluster, node_registry):
    plane = in_cluster.plane
    repo = f"node/agent-{int(time.time() * 1000) % 10**8}"   # never read before: no cache
    node_registry.push_index(repo, "1", ["linux/amd64", "linux/arm64"])
    mark = node_registry.mark()
    namespace = fresh_namespace(plane, "agent")
    created = plane.kube.create(pod_path(namespace), {"metadata": {"name": "named"}, "spec": {
        "containers": [{"name": "c", "image": f"{node_registry.host}/{repo}:1"}]}})
    assert created["metadata"]["annotations"][ARCH_ANNOTATION] == "amd64,arm64"

    seen = [entry for entry in node_registry.requests_since(mark)
            if entry.path.startswith(f"/v2/{repo}/")]
    archways = [entry for entry in seen if entry.agent == f"archway/{__version__}"]
    assert archways, seen
    # Nothing else reads it but the node's containerd, should the pod land on the real node.
    assert all(entry in archways or entry.agent.startswith("containerd/") for entry in seen), seen
    assert not any("python-requests" in entry.agent
                   for entry in node_registry.requests_since(mark)), seen
